"""Child script: compiles one MLA layer's prefill attention (`MultiHeadLatentAttention.attend`, no cached
prefix) ahead of time for a TPU topology and prints one JSON line with `memory_analysis()` figures.

Run in a libtpu compile venv by `tests/aot/test_mla_compile.py` through `AotRunner`, one compile per
process. The layer has the real MLA widths of Kimi-Linear-48B (qk_nope 128 + qk_rope 64, v 128,
kv_lora_rank 512) at `--hidden` and `--heads`; its parameters and x `[B, T, hidden]` are abstract
arrays (nothing allocated), traced under `partitioning.mesh_context` of one device of the topology, so
`mla_impl=auto` resolves for TPU. One row of `--docs` equal packed documents.

Usage: python -m tests.aot.compile_mla_tpu --chip v5e --seq-len 8192 [--impl auto] [--grad]
  [--heads 8 --hidden 1024 --batch 1 --docs 1 --dtype bfloat16]

Output (last stdout line): {"chip", "impl", "seq_len", "argument_bytes", "output_bytes", "temp_bytes",
"flops", "has_tpu_custom_call", "compile_s"}; with --kernel-only also "entry_parameters" (the compiled
executable's inputs) and "arguments" (what a caller passes: 4).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

TOPOLOGIES = {"v5e": "v5e:1x1", "v5e-2x2": "v5e:2x2", "v6e": "v6e:1x1"}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--chip", choices=sorted(TOPOLOGIES), required=True)
  ap.add_argument("--seq-len", type=int, required=True)
  ap.add_argument("--impl", choices=["auto", "splash", "tiled", "dense"], default="auto")
  ap.add_argument("--grad", action="store_true", help="compile the gradient w.r.t. x (training's backward)")
  ap.add_argument("--heads", type=int, default=8)
  ap.add_argument("--hidden", type=int, default=1024)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--docs", type=int, default=1)
  ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
  ap.add_argument("--kernel-only", action="store_true",
                  help="compile model.nn.attention.splash_attention alone on q, k [B, T, H, 192], v [B, T, H, 128] "
                       "(no flax: the jax 0.10.2 compile venv has none)")
  ap.add_argument("--with-lse", action="store_true",
                  help="with --kernel-only: the residual-saving form (output and log-sum-exp), as a cached prefill calls it")
  ap.add_argument("--decode", action="store_true",
                  help="compile one decode step of the layer (`decode_latent`, its cache donated) for --batch "
                       "sequences against a latent cache of --seq-len rows, and report the cache's copies")
  args = ap.parse_args(argv)
  if args.kernel_only:
    return _kernel_only(args)
  if args.decode:
    return _decode(args)

  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415
  from jax.experimental import topologies  # noqa: PLC0415

  from model import partitioning  # noqa: PLC0415
  from model.config import ModelArgs, load_config  # noqa: PLC0415
  from model.nn.mla import MultiHeadLatentAttention  # noqa: PLC0415

  cfg = load_config(["kimi_linear_48b_a3b", f"hidden_size={args.hidden}", f"num_attention_heads={args.heads}",
                     f"mla_impl={args.impl}", f"dtype={args.dtype}", f"weight_dtype={args.dtype}",
                     "num_experts=16", "ici_data_parallelism=1"])
  margs = ModelArgs.from_config(cfg, validate=False)
  topo = topologies.get_topology_desc(topology_name=TOPOLOGIES[args.chip], platform="tpu")
  mesh = partitioning.create_mesh(cfg, topo.devices[:1])
  b, t = args.batch, args.seq_len
  bounds = [round(i * t / args.docs) for i in range(args.docs + 1)]
  seg_np = np.zeros((b, t), np.int32)
  for i in range(args.docs):
    seg_np[:, bounds[i]:bounds[i + 1]] = i + 1

  start = time.perf_counter()
  with partitioning.mesh_context(mesh, cfg):
    with nnx.use_eager_sharding(False):
      abstract = nnx.eval_shape(lambda: MultiHeadLatentAttention(margs, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), state)
    x = jax.ShapeDtypeStruct((b, t, args.hidden), jnp.dtype(args.dtype), sharding=sharding)

    def prefill(st, x):
      return nnx.merge(graphdef, st).attend(x, segment_ids=jnp.asarray(seg_np))[0]

    def grad(st, x):
      return jax.grad(lambda x: jnp.sum(prefill(st, x).astype(jnp.float32)))(x)

    compiled = jax.jit(grad if args.grad else prefill).lower(state, x).compile()
  compile_s = time.perf_counter() - start
  ma = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  from model.nn import attention  # noqa: PLC0415
  report = dict(chip=args.chip, impl=attention.resolve_impl(args.impl, "tpu"), seq_len=t, grad=args.grad,
                argument_bytes=int(ma.argument_size_in_bytes), output_bytes=int(ma.output_size_in_bytes),
                temp_bytes=int(ma.temp_size_in_bytes), flops=float((cost or {}).get("flops", -1.0)),
                has_tpu_custom_call="tpu_custom_call" in compiled.as_text(), compile_s=round(compile_s, 2),
                jax=jax.__version__)
  print(json.dumps(report))
  return 0


def _kernel_only(args) -> int:
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.experimental import topologies  # noqa: PLC0415

  from model.nn import attention  # noqa: PLC0415

  topo = topologies.get_topology_desc(topology_name=TOPOLOGIES[args.chip], platform="tpu")
  mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  b, t, h, dt = args.batch, args.seq_len, args.heads, jnp.dtype(args.dtype)
  sds = lambda shape, d: jax.ShapeDtypeStruct(shape, d, sharding=sharding)
  q, k, v = sds((b, t, h, 192), dt), sds((b, t, h, 192), dt), sds((b, t, h, 128), dt)
  seg = sds((b, t), jnp.int32)
  fwd = lambda q, k, v, s: attention.splash_attention(q, k, v, s, scale=192 ** -0.5, with_lse=False)[0]
  if args.with_lse:
    fwd = lambda q, k, v, s: attention.splash_attention(q, k, v, s, scale=192 ** -0.5, with_lse=True)
  fn = (lambda q, k, v, s: jax.grad(lambda q, k, v: jnp.sum(fwd(q, k, v, s)), argnums=(0, 1, 2))(q, k, v)) \
      if args.grad else fwd
  start = time.perf_counter()
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    if args.grad:   # another trace first, as a train step's remat and grad sub-traces are
      jax.jit(fwd).lower(q, k, v, seg)
    compiled = jax.jit(fn).lower(q, k, v, seg).compile()
  ma = compiled.memory_analysis()
  print(json.dumps(dict(chip=args.chip, impl="splash", seq_len=t, grad=args.grad, kernel_only=True,
                        entry_parameters=_entry_parameters(compiled.as_text()), arguments=4,
                        argument_bytes=int(ma.argument_size_in_bytes), output_bytes=int(ma.output_size_in_bytes),
                        temp_bytes=int(ma.temp_size_in_bytes),
                        has_tpu_custom_call="tpu_custom_call" in compiled.as_text(),
                        compile_s=round(time.perf_counter() - start, 2), jax=jax.__version__)))
  return 0


def _decode(args) -> int:
  """One MLA decode step at the real widths: the latent cache's width, the layout XLA gives it, how many
  whole-cache copies the step makes, and XLA's bytes accessed (an estimate of the HBM traffic)."""
  import re  # noqa: PLC0415  (this mode only)

  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415
  from jax.experimental import topologies  # noqa: PLC0415

  from model import partitioning  # noqa: PLC0415
  from model.config import ModelArgs, load_config  # noqa: PLC0415
  from model.nn import cache as cache_lib  # noqa: PLC0415
  from model.nn.mla import MultiHeadLatentAttention  # noqa: PLC0415

  cfg = load_config(["kimi_linear_48b_a3b", f"dtype={args.dtype}", f"weight_dtype={args.dtype}", "num_experts=16",
                     "ici_data_parallelism=1"])
  margs = ModelArgs.from_config(cfg, validate=False)
  topo = topologies.get_topology_desc(topology_name=TOPOLOGIES[args.chip], platform="tpu")
  mesh = partitioning.create_mesh(cfg, topo.devices[:1])
  # the cache's rows as the model makes them for --seq-len tokens (rounded up to a multiple of 8)
  s, length, dt = args.batch, cache_lib.mla_rows(args.seq_len), jnp.dtype(args.dtype)
  with partitioning.mesh_context(mesh, cfg):
    with nnx.use_eager_sharding(False):
      abstract = nnx.eval_shape(lambda: MultiHeadLatentAttention(margs, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    sds = lambda shape, d: jax.ShapeDtypeStruct(shape, d, sharding=sharding)
    state = jax.tree.map(lambda a: sds(a.shape, a.dtype), state)
    width = abstract.latent_width
    args_ = (state, sds((s, margs.hidden_size), dt), sds((s, length, width), dt), sds((s,), jnp.int32))
    compiled = jax.jit(lambda st, x, c, n: nnx.merge(graphdef, st).decode_latent(x, c, n),
                       donate_argnums=2).lower(*args_).compile()
  hlo = compiled.as_text()
  entry = hlo[hlo.index("ENTRY"):]
  name = f"{jnp.dtype(dt).name.replace('bfloat16', 'bf16').replace('float32', 'f32')}[{s},{length},{width}]"
  layout = re.search(re.escape(name) + r"\{([0-9,]+)", entry)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  ma = compiled.memory_analysis()
  print(json.dumps(dict(chip=args.chip, decode=True, batch=s, cache_length=length, latent_width=width,
                        unpadded_width=abstract.rank + abstract.dr, cache_layout=layout.group(1) if layout else None,
                        cache_copies=len(re.findall(re.escape(name) + r"\S* copy\(", entry)),
                        cache_bytes=s * length * width * dt.itemsize, temp_bytes=int(ma.temp_size_in_bytes),
                        bytes_accessed=float((cost or {}).get("bytes accessed", -1.0)), jax=jax.__version__)))
  return 0


def _entry_parameters(hlo: str) -> int:
  """The number of parameters of the compiled HLO's ENTRY computation: the inputs the executable takes."""
  lines = hlo.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
  n = 0
  for line in lines[start + 1:]:
    if line.startswith("}"):
      break
    n += " parameter(" in line
  return n


if __name__ == "__main__":
  sys.exit(main())
