"""The script behind tpu_v5e_kda_train_op_e26fd32.json (runs at commit e26fd32, whose kda_chunk_core has
`schedule`): kda_chunked forward + backward on the chip, schedules x inverse forms."""
import concurrent.futures as cf, json, os, sys, time
import numpy as np
import jax, jax.numpy as jnp
from jax import lax
sys.path.insert(0, os.getcwd())
import kda_plugin.ops.chunked as ch
from kda_plugin.ops.chunked import kda_chunk_core, chunk_prep
from kda_plugin.ops._chunk_common import SUB

def loop_inverse(lmat):  # the fori_loop form of 767dc9a
  c = lmat.shape[-1]; nb = c // SUB; lead = lmat.shape[:-2]
  blocks = jnp.stack([lmat[..., i * SUB:(i + 1) * SUB, i * SUB:(i + 1) * SUB] for i in range(nb)], -3)
  strict = jnp.where(jnp.arange(SUB)[:, None] > jnp.arange(SUB)[None, :], blocks, 0.0)
  eye = jnp.eye(SUB, dtype=lmat.dtype)
  def row_step(r, x):
    l_r = lax.dynamic_index_in_dim(strict, r, axis=-2, keepdims=False)
    row = lax.dynamic_index_in_dim(eye, r, axis=0, keepdims=False) - ch._mm("...j,...jc->...c", l_r, x)
    return lax.dynamic_update_index_in_dim(x, row, r, axis=-2)
  x = lax.fori_loop(1, SUB, row_step, jnp.broadcast_to(eye, blocks.shape))
  size = SUB
  while size < c:
    m = c // (2 * size)
    x = x.reshape(lead + (m, 2, size, size)); x11, x22 = x[..., 0, :, :], x[..., 1, :, :]
    l21 = jnp.stack([lmat[..., (2 * j + 1) * size:(2 * j + 2) * size, 2 * j * size:(2 * j + 1) * size] for j in range(m)], axis=-3)
    x21 = -ch._mm("...ij,...jk->...ik", x22, ch._mm("...ij,...jk->...ik", l21, x11))
    x = jnp.concatenate([jnp.concatenate([x11, jnp.zeros_like(x11)], -1), jnp.concatenate([x21, x22], -1)], -2)
    size *= 2
  return x.reshape(lead + (c, c))

product_inverse = ch._unit_lower_inverse
out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": []}
shapes = [(8, 2048, 8, 128), (1, 8192, 32, 128)]
VARIANTS = {(8, 2048, 8, 128): [("sequential", 1, "loop"), ("sequential", 1, "product"), ("parallel", 4, "product"),
                                 ("parallel", 8, "product"), ("parallel", 32, "product"), ("sequential", 8, "product")],
            (1, 8192, 32, 128): [("sequential", 1, "loop"), ("parallel", 8, "product"), ("parallel", 16, "product")]}
rng = np.random.default_rng(0)
lowered = []
for (B, T, H, K) in shapes:
  dt = jnp.bfloat16
  q, k, v, g = (jnp.asarray(rng.normal(size=(B, T, H, K)), dt) for _ in range(4))
  beta = jnp.asarray(rng.uniform(size=(B, T, H)), jnp.float32)
  a_log = jnp.asarray(np.log(rng.uniform(1, 16, H)), jnp.float32)
  dtb = jnp.asarray(rng.normal(size=(H * K,)) - 4.0, jnp.float32)
  seg = np.ones((B, T), np.int32)
  if B > 1:  # packed: 4 documents a row
    seg = np.repeat(np.arange(1, 5), T // 4)[None].repeat(B, 0).astype(np.int32)
  seg = jnp.asarray(seg)
  ct = jnp.asarray(rng.normal(size=(B, T, H, K)), jnp.float32)
  for sched, grp, inv in VARIANTS.get((B, T, H, K), [("sequential", 1, "loop"), ("parallel", 1, "product"), ("sequential", 4, "product")]):
    ch._unit_lower_inverse = loop_inverse if inv == "loop" else product_inverse
    def loss(q, k, v, g, beta, sched=sched, grp=grp):
      o, _ = kda_chunk_core(q, k, v, g, beta, seg, None, scale=K ** -0.5, n_slots=4, want_final=False,
                            prep=chunk_prep((a_log, dtb), None, True), out_dtype=jnp.float32, schedule=sched, group=grp)
      return jnp.sum(o * ct)
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    t0 = time.perf_counter(); low = f.lower(q, k, v, g, beta)
    lowered.append(((B, T, H, K), f"{sched}/g{grp}", inv, low, (q, k, v, g, beta), time.perf_counter() - t0))
print(f"lowered {len(lowered)}", flush=True)
def comp(item):
  t0 = time.perf_counter()
  try:
    return item[3].compile(), time.perf_counter() - t0
  except Exception as e:
    return e, time.perf_counter() - t0
with cf.ThreadPoolExecutor(8) as ex:
  compiled = list(ex.map(comp, lowered))
ref = {}
for (shape, sched, inv, _, args, tl), (exe, tc) in zip(lowered, compiled):
  row = {"B_T_H_K": shape, "schedule": sched, "inverse": inv, "compile_s": round(tc, 1)}
  if isinstance(exe, Exception):
    row["error"] = str(exe)[:300]; out["rows"].append(row); print(row, flush=True); continue
  m = exe.memory_analysis()
  row["code_mb"] = round(m.generated_code_size_in_bytes / 1e6, 1); row["temp_gib"] = round(m.temp_size_in_bytes / 2**30, 2)
  r = exe(*args); jax.block_until_ready(r)
  ts = []
  for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(3):
      r = exe(*args)
    jax.block_until_ready(r); ts.append((time.perf_counter() - t0) / 3 * 1e3)
  row["fwd_bwd_ms_median"] = round(float(np.median(ts)), 3); row["spread_ms"] = [round(min(ts), 3), round(max(ts), 3)]
  val, grads = r
  if shape not in ref:
    ref[shape] = (val, grads)
  else:
    rv, rg = ref[shape]
    row["loss_rel_diff_vs_first"] = float(abs(val - rv) / abs(rv))
    row["grad_rel_diff_vs_first"] = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) / (float(jnp.max(jnp.abs(b.astype(jnp.float32)))) + 1e-30)) for a, b in zip(grads, rg)]
  out["rows"].append(row); print(row, flush=True)
  json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "kda_train_op.json"), "w"), indent=1)
