"""`kda_inference`: forward-only KDA over packed sequences with native segment IDs, one pass.

Backends:
- `pallas_tpu`: the Mosaic megakernel (`kda_plugin.ops.pallas_tpu`).
- `pallas_gpu`: the Pallas GPU (Triton) kernel (`kda_plugin.ops.pallas_gpu`).
- `xla`: `kda_plugin.ops.inference_xla.kda_inference_xla`, the XLA lowering of the same algorithm.
- `auto`: by the target platform (`jax.default_backend()`, or the abstract device's platform under
  `jax.sharding.use_abstract_mesh` when exporting ahead of time): tpu -> pallas_tpu,
  gpu -> pallas_gpu, anything else -> xla.
Nothing falls back silently: a backend that cannot run the call raises and names the limit.

Math: ../shared/docs/kda.md sections 1-3 and ../shared/docs/segment_native_chunk.md. Every 64-token
chunk is solved in place whatever it holds (padding, one document, several documents); documents that
start inside a chunk with a non-zero initial state get one masked matmul each.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from kda_plugin.ops import _segment_schedule as ss
from kda_plugin.ops._contract import check_kda_inputs, default_scale, is_concrete
from kda_plugin.ops.gates import check_lower_bound

BACKENDS = ("auto", "pallas_tpu", "pallas_gpu", "xla")
C = ss.CHUNK
TPU_MAX_KV = 256  # Kp, Vp (after padding to 128 lanes) at most this: the VMEM plan holds [Kp, Vp] states
GPU_MAX_KV = 128  # K, V at most this: the Triton kernel keeps the [K, V] state in registers


def target_platform() -> str:
  """The platform the call is traced for: the abstract device's platform under
  `jax.sharding.use_abstract_mesh` (ahead-of-time export for a TPU or GPU from any host), else
  `jax.default_backend()`."""
  get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
  device = getattr(get_mesh(), "abstract_device", None) if get_mesh is not None else None
  platform = device.platform if device is not None else jax.default_backend()
  return "gpu" if platform in ("cuda", "rocm") else platform


def resolve_backend(backend: str) -> str:
  """Maps `backend` ("auto" included) to a concrete backend name; ValueError for unknown names."""
  if backend not in BACKENDS:
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
  if backend != "auto":
    return backend
  return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(target_platform(), "xla")


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def lane_padding(backend: str, key_dim: int, value_dim: int) -> tuple[int, int]:
  """Padded (Kp, Vp) of a Pallas backend: multiples of 128 on TPU, powers of two >= 16 on GPU."""
  if backend == "pallas_tpu":
    return _round_up(key_dim, 128), _round_up(value_dim, 128)
  return max(16, _next_pow2(key_dim)), max(16, _next_pow2(value_dim))


def _check_backend_limits(backend: str, key_dim: int, value_dim: int, interpret) -> None:
  platform = target_platform()
  if backend == "pallas_tpu":
    kp, vp = lane_padding(backend, key_dim, value_dim)
    if max(kp, vp) > TPU_MAX_KV:
      raise ValueError(
          f"backend 'pallas_tpu' supports K and V up to {TPU_MAX_KV} (after padding to 128 lanes); "
          f"got K={key_dim}, V={value_dim}")
    if not interpret and platform != "tpu":
      raise RuntimeError(
          f"backend 'pallas_tpu' needs a TPU, but the target platform is {platform!r}; pass "
          "interpret=True to simulate the kernel on CPU, or use backend='xla'")
  elif backend == "pallas_gpu":
    if max(key_dim, value_dim) > GPU_MAX_KV:
      raise ValueError(
          f"backend 'pallas_gpu' supports K and V up to {GPU_MAX_KV}; got K={key_dim}, V={value_dim}")
    if not interpret and platform != "gpu":
      raise RuntimeError(
          f"backend 'pallas_gpu' needs a CUDA GPU, but the target platform is {platform!r}; pass "
          "interpret=True to run the kernel in interpret mode, or use backend='xla'")


def _check_gate_args(g_is_raw, dt_bias, lower_bound, num_heads, key_dim):
  if not g_is_raw:
    if dt_bias is not None or lower_bound is not None:
      raise ValueError("dt_bias and lower_bound are gate parameters: they need a_log (raw g input)")
    return None
  if lower_bound is not None:
    lower_bound = check_lower_bound(lower_bound)
  if dt_bias is not None and np.size(dt_bias) != num_heads * key_dim:
    raise ValueError(f"dt_bias must have H*K={num_heads * key_dim} values (shape [H*K] or [H, K]), "
                     f"got shape {np.shape(dt_bias)}")
  return lower_bound


def kda_inference(q, k, v, g, beta, *, segment_ids=None, initial_state=None, output_final_state=False,
                  scale=None, a_log=None, dt_bias=None, lower_bound=None, use_qk_l2norm=False,
                  max_num_segments=None, backend="auto", interpret=False):
  """KDA forward over (packed) sequences, equal to `kda_reference`.

  Args:
    q, k: `[B, T, H, K]` float32 or bfloat16.
    v: `[B, T, H, V]`.
    g: `[B, T, H, K]`: the log-space decay (<= 0), or, when `a_log` is given, the raw gate input
      activated in the kernel (`kda_gate_softplus`, or `kda_gate_bounded` with `lower_bound`).
    beta: `[B, T, H]` in [0, 1].
    segment_ids: int32 `[B, T]` or `[T]` (shared by every row); 0 = padding, label n uses slot n-1.
    initial_state: float32 `[B, N, H, K, V]` with segment_ids, else `[B, H, K, V]`; zeros if None.
    output_final_state: also return the final state(s) (an absent label keeps its initial state).
    scale: query scale (a Python float), default K**-0.5.
    a_log: `[H]` log decay rate per head (turns on the in-kernel gate); dt_bias: `[H*K]` or `[H, K]`.
    lower_bound: static float in [-5, 0) selecting the bounded gate family.
    use_qk_l2norm: L2-normalise q and k per head inside the kernel (eps 1e-6 inside the sqrt).
    max_num_segments: N, static; needed under jit when no initial_state gives it.
    backend: "auto", "pallas_tpu", "pallas_gpu" or "xla".
    interpret: run a Pallas backend in interpret mode (TPU: `pltpu.InterpretParams()`, or pass one).

  Returns:
    `(o, final_state)`: o `[B, T, H, V]` in q's dtype (exactly 0 on padding); final_state float32 in
    initial_state's layout, or None.

  Raises:
    ValueError / TypeError: invalid inputs (see `check_kda_inputs`), gate parameters without a_log,
      an unknown backend, or a shape beyond the chosen backend's limit.
    RuntimeError: a Pallas backend requested on a platform that cannot run it (without interpret).
  """
  name = resolve_backend(backend)
  g_is_raw = a_log is not None
  p = check_kda_inputs(q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids,
                       max_num_segments=max_num_segments, scale=scale, g_is_raw=g_is_raw)
  lower_bound = _check_gate_args(g_is_raw, dt_bias, lower_bound, p.num_heads, p.key_dim)
  if name == "xla":
    if interpret:
      raise ValueError("interpret=True applies to the Pallas backends only, not to backend='xla'")
    from kda_plugin.ops.inference_xla import kda_inference_xla  # lazy: lands separately
    return kda_inference_xla(q, k, v, g, beta, segment_ids=segment_ids, initial_state=initial_state,
                             output_final_state=output_final_state, scale=scale, a_log=a_log,
                             dt_bias=dt_bias, lower_bound=lower_bound, use_qk_l2norm=use_qk_l2norm,
                             max_num_segments=max_num_segments)
  _check_backend_limits(name, p.key_dim, p.value_dim, interpret)
  if scale is not None and not is_concrete(scale):
    raise ValueError("scale must be a static Python float for the Pallas backends, not a traced value")
  scale = float(default_scale(scale, p.key_dim))
  packed = segment_ids is not None
  n = p.num_segments if packed else 1
  h0 = initial_state
  if h0 is not None and not packed:
    h0 = jnp.asarray(h0)[:, None]
  if interpret is True and name == "pallas_tpu":
    from jax.experimental.pallas import tpu as pltpu
    interpret = pltpu.InterpretParams()
  gate = None
  if g_is_raw:
    a_log = jnp.asarray(a_log, jnp.float32).reshape(p.num_heads)
    dt_bias = (jnp.zeros((p.num_heads, p.key_dim), jnp.float32) if dt_bias is None
               else jnp.asarray(dt_bias, jnp.float32).reshape(p.num_heads, p.key_dim))
    gate = (a_log, dt_bias)
  o, final = _forward(q, k, v, g, beta, p.segment_ids if packed else None, h0, gate,
                      backend=name, num_segments=n, scale=scale, lower_bound=lower_bound,
                      use_l2norm=bool(use_qk_l2norm), want_final=bool(output_final_state),
                      interpret=interpret)
  if not output_final_state:
    return o, None
  return o, (final if packed else final[:, 0])


@functools.partial(jax.jit, static_argnames=("backend", "num_segments", "scale", "lower_bound",
                                             "use_l2norm", "want_final", "interpret"))
def _forward(q, k, v, g, beta, seg, h0, gate, *, backend, num_segments, scale, lower_bound,
             use_l2norm, want_final, interpret):
  """Pads and lays out the operands, builds the schedule, runs the kernel, unpads."""
  if backend == "pallas_gpu":  # the GPU kernel owns its layout (kda_plugin.ops.pallas_gpu)
    from kda_plugin.ops.pallas_gpu import kda_inference_gpu
    return kda_inference_gpu(q, k, v, g, beta, seg, h0, gate, num_segments=num_segments, scale=scale,
                             lower_bound=lower_bound, use_l2norm=use_l2norm, want_final=want_final,
                             interpret=interpret)
  b, t, h, kd = q.shape
  vd = v.shape[3]
  kp, vp = lane_padding(backend, kd, vd)
  tp = _round_up(t, C)
  nc = tp // C
  if seg is None:
    seg = jnp.ones((b, t), jnp.int32)
  seg = jnp.pad(seg.astype(jnp.int32), ((0, 0), (0, tp - t)))
  pad4 = lambda x, last: jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, last - x.shape[3])))
  q2 = pad4(q, kp).reshape(b, tp, h * kp)
  k2 = pad4(k, kp).reshape(b, tp, h * kp)
  g2 = pad4(g, kp).reshape(b, tp, h * kp)
  v2 = pad4(v, vp).reshape(b, tp, h * vp)
  # beta as a float32 column per head: a [C, 1] block of a 32-bit type is a plain sublane tile.
  beta4 = jnp.pad(jnp.swapaxes(beta, 1, 2).astype(jnp.float32), ((0, 0), (0, 0), (0, tp - t)))[..., None]
  segc = seg[:, :, None]
  segr = seg.reshape(b, nc, 1, C)
  n_steps = ss.num_steps(tp, num_segments)
  sched = ss.build_schedule(seg, n_steps, has_initial_state=h0 is not None)
  if h0 is not None:
    h0 = jnp.pad(h0.astype(jnp.float32), ((0, 0),) * 3 + ((0, kp - kd), (0, vp - vd)))
  a_exp = dt_row = None
  if gate is not None:
    a_log, dt_bias = gate
    a_exp = jnp.broadcast_to(jnp.exp(a_log)[:, None, None], (h, 1, kp))
    dt_row = jnp.pad(dt_bias, ((0, 0), (0, kp - kd)))[:, None, :]
  kwargs = dict(num_heads=h, key_dim=kd, num_segments=num_segments, n_steps=n_steps, scale=scale,
                use_l2norm=use_l2norm, a_exp=a_exp, dt_bias=dt_row, lower_bound=lower_bound,
                initial_state=h0, want_final=want_final, interpret=interpret)
  from kda_plugin.ops.pallas_tpu import kda_pallas_tpu as run
  sched = sched.reshape(-1)
  o2, final = run(q2, k2, v2, g2, beta4, segc, segr, sched, **kwargs)
  o = o2.reshape(b, tp, h, vp)[:, :t, :, :vd]
  if final is not None:
    final = final[..., :kd, :vd]
  return o, final


def estimate_peak_memory(q, k, v, g, beta, *, segment_ids=None, initial_state=None,
                         output_final_state=False, max_num_segments=None, a_log=None, dt_bias=None,
                         backend="auto", **unused) -> int:
  """Estimated peak device memory (bytes) of one `kda_inference` call; arrays or ShapeDtypeStructs.

  Pallas backends, documented formula (HBM buffers alive during the kernel):
    inputs   = bytes of q, k, v, g, beta, segment_ids, initial_state, a_log, dt_bias
    outputs  = o [B, T, H, V] in q's dtype + final states B*N*H*K*V*4 when requested
               (the kernel writes them in place of a copy of the initial states / of zeros)
    temporaries = padded copies of q, k, g, v and o when K, V or T are not already aligned
               (K, V to 128 lanes on TPU, powers of two on GPU; T to 64), the padded state
               buffer when K or V are padded, beta transposed to float32 [B, H, Tp], the
               segment map as column and row (2 * B * Tp int32) and the step schedule
               (B * S * 15 int32).
  VMEM scratch (per core, `pallas_tpu.vmem_limit_bytes`) is on-chip and not counted.
  backend "xla": measured from the compiled executable (`memory_analysis()` arguments + outputs +
  temporaries - aliased bytes) on the current platform.
  """
  name = resolve_backend(backend)
  shp = lambda x: tuple(np.shape(x))
  nbytes = lambda x: 0 if x is None else math.prod(shp(x)) * jnp.dtype(x.dtype).itemsize
  b, t, h, kd = shp(q)
  vd = shp(v)[3]
  n = 1
  if segment_ids is not None:
    if max_num_segments is not None:
      n = int(max_num_segments)
    elif initial_state is not None:
      n = shp(initial_state)[1]
    else:
      n = max(1, int(np.max(np.asarray(segment_ids))))
  if name == "xla":
    from kda_plugin.ops.inference_xla import kda_inference_xla
    fn = functools.partial(kda_inference_xla, output_final_state=output_final_state,
                           max_num_segments=max_num_segments if segment_ids is not None else None)
    args = [jax.ShapeDtypeStruct(shp(x), x.dtype) for x in (q, k, v, g, beta)]
    kw = {name_: jax.ShapeDtypeStruct(shp(x), x.dtype) for name_, x in
          (("segment_ids", segment_ids), ("initial_state", initial_state), ("a_log", a_log),
           ("dt_bias", dt_bias)) if x is not None}
    if segment_ids is not None and max_num_segments is None:
      fn = functools.partial(fn, max_num_segments=n)
    ma = jax.jit(lambda *a, **k_: fn(*a, **k_)).lower(*args, **kw).compile().memory_analysis()
    return int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
               - ma.alias_size_in_bytes)
  kp, vp = lane_padding(name, kd, vd)
  tp = _round_up(t, C)
  item = jnp.dtype(q.dtype).itemsize
  inputs = sum(nbytes(x) for x in (q, k, v, g, beta, segment_ids, initial_state, a_log, dt_bias))
  outputs = b * t * h * vd * item + (b * n * h * kd * vd * 4 if output_final_state else 0)
  temps = 0
  if kp != kd or tp != t:
    temps += b * tp * h * kp * (2 * item + jnp.dtype(g.dtype).itemsize)
  if vp != vd or tp != t:
    temps += 2 * b * tp * h * vp * item  # padded v and the padded o before slicing
  if output_final_state and (kp != kd or vp != vd):
    temps += b * n * h * kp * vp * 4
  temps += b * h * tp * 4 + 2 * b * tp * 4
  temps += b * ss.num_steps(tp, n) * ss.NUM_FIELDS * 4
  return int(inputs + outputs + temps)
