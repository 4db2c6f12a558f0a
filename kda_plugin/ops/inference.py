"""`kda_inference`: forward-only KDA over packed sequences with native segment IDs, one pass.

Implementations (`implementation=`):
- `pallas_tpu`: the Mosaic kernel (`kda_plugin.ops.pallas_tpu`).
- `pallas_gpu`: the Pallas GPU (Triton) kernel (`kda_plugin.ops.pallas_gpu`).
- `xla`: `kda_plugin.ops.inference_xla.kda_inference_xla`, the XLA lowering of the same algorithm.
- `auto`: by the target platform (`jax.default_backend()`, or the abstract device's platform under
  `jax.sharding.use_abstract_mesh` when exporting ahead of time): tpu -> pallas_tpu,
  gpu -> pallas_gpu, anything else -> xla.
Nothing falls back silently: an implementation that cannot run the call raises and names the limit.
The arguments are validated once per call, here (the XLA path is entered past its own checks).

Math: docs/kda.md sections 'Token recurrence' and 'Chunked form (WY/UT)', docs/packing.md section 'Segment-native chunk algorithm'. Every 64-token
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
from kda_plugin.ops.pallas_tpu import LANE, MAX_KV as TPU_MAX_KV

IMPLEMENTATIONS = ("auto", "pallas_tpu", "pallas_gpu", "xla")
C = ss.CHUNK


def target_platform() -> str:
  """The platform the call is traced for: the abstract device's platform under
  `jax.sharding.use_abstract_mesh` (ahead-of-time export for a TPU or GPU from any host), else
  `jax.default_backend()`."""
  get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
  device = getattr(get_mesh(), "abstract_device", None) if get_mesh is not None else None
  platform = device.platform if device is not None else jax.default_backend()
  return "gpu" if platform in ("cuda", "rocm") else platform


def resolve_implementation(implementation: str) -> str:
  """Maps `implementation` ("auto" included) to a concrete kernel name; ValueError for unknown names."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown implementation {implementation!r}; expected one of {IMPLEMENTATIONS}")
  if implementation != "auto":
    return implementation
  return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(target_platform(), "xla")




def _choose_implementation(implementation) -> str:
  return resolve_implementation("auto" if implementation is None else implementation)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def lane_padding(implementation: str, key_dim: int, value_dim: int) -> tuple[int, int]:
  """Padded (Kp, Vp) of a Pallas kernel: multiples of 128 on TPU, powers of two >= 16 on GPU."""
  if implementation == "pallas_tpu":
    return _round_up(key_dim, LANE), _round_up(value_dim, LANE)
  from kda_plugin.ops import pallas_gpu  # noqa: PLC0415  (imports Triton's Pallas lowering: only when chosen)
  return pallas_gpu.padded_dims(key_dim, value_dim)


def _check_kernel_limits(name: str, key_dim: int, value_dim: int, num_segments: int, interpret) -> None:
  platform = target_platform()
  if name == "pallas_tpu":
    kp, vp = lane_padding(name, key_dim, value_dim)
    if max(kp, vp) > TPU_MAX_KV:
      raise ValueError(
          f"implementation 'pallas_tpu' supports K and V up to {TPU_MAX_KV} (after padding to "
          f"{LANE} lanes); got K={key_dim}, V={value_dim}")
    if not interpret and platform != "tpu":
      raise RuntimeError(
          f"implementation 'pallas_tpu' needs a TPU, but the target platform is {platform!r}; pass "
          "interpret=True to simulate the kernel on CPU, or use implementation='xla'")
  elif name == "pallas_gpu":
    from kda_plugin.ops import pallas_gpu  # noqa: PLC0415  (imports Triton's Pallas lowering: only when chosen)
    pallas_gpu.check_limits(key_dim, value_dim, num_segments)
    if not interpret and platform != "gpu":
      raise RuntimeError(
          f"implementation 'pallas_gpu' needs a CUDA GPU, but the target platform is {platform!r}; "
          "pass interpret=True to run the kernel in interpret mode, or use implementation='xla'")


# HBM one jax device may use, by `device_kind`, for an abstract (ahead-of-time) target, where there
# is no `memory_stats()`: libtpu 0.0.52's own figure, read from its compile-time out-of-memory message
# (tools/aot_compile.py probes it the same way). A real TPU device reports `bytes_limit` instead.
USABLE_HBM_BYTES = {"TPU v5 lite": int(15.75 * 2**30), "TPU v5": int(95.73 * 2**30),
                    "TPU v6 lite": int(31.24 * 2**30), "TPU7x": int(94.74 * 2**30)}


def device_hbm_bytes() -> tuple[str, int] | None:
  """(device kind, HBM bytes one device may use) of the TPU being traced for, or None when unknown
  (not a TPU, or a device kind missing from `USABLE_HBM_BYTES` that reports no memory stats)."""
  get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
  device = getattr(get_mesh(), "abstract_device", None) if get_mesh is not None else None
  if device is not None:
    if device.platform != "tpu":
      return None
    kind = device.device_kind
    return (kind, USABLE_HBM_BYTES[kind]) if kind in USABLE_HBM_BYTES else None
  if jax.default_backend() != "tpu":
    return None
  dev = jax.devices()[0]
  try:
    limit = (dev.memory_stats() or {}).get("bytes_limit")
  except jax.errors.JaxRuntimeError:
    limit = None
  if limit is None:
    limit = USABLE_HBM_BYTES.get(dev.device_kind)
  return None if limit is None else (dev.device_kind, int(limit))


def _check_fits_hbm(q, k, v, g, beta, *, segment_ids, initial_state, output_final_state, num_segments,
                    a_log, dt_bias, num_heads) -> None:
  """ValueError before lowering when the TPU kernel's HBM buffers (`estimate_peak_memory`, within
  10 % of the compiled figure) exceed what one device has: libtpu would otherwise fail the compile
  with RESOURCE_EXHAUSTED, or the run would fail at allocation."""
  hbm = device_hbm_bytes()
  if hbm is None:
    return
  kind, limit = hbm
  need = estimate_peak_memory(q, k, v, g, beta, segment_ids=segment_ids, initial_state=initial_state,
                              output_final_state=output_final_state, max_num_segments=num_segments,
                              a_log=a_log, dt_bias=dt_bias, num_heads=num_heads, implementation="pallas_tpu")
  if need > limit:
    raise ValueError(
        f"kda_inference(implementation='pallas_tpu') needs about {need / 2**30:.2f} GiB of HBM for these "
        f"shapes (q {tuple(np.shape(q))}; estimate_peak_memory) but one {kind} device has "
        f"{limit / 2**30:.2f} GiB: split the batch or the sequence (or shard it over a mesh)")


def _check_gate_args(g_is_raw, a_log, dt_bias, lower_bound, num_heads, key_dim):
  if not g_is_raw:
    if dt_bias is not None or lower_bound is not None:
      raise ValueError("dt_bias and lower_bound are gate parameters: they need a_log (raw g input)")
    return None
  if lower_bound is not None:
    lower_bound = check_lower_bound(lower_bound)
  if np.size(a_log) != num_heads:
    raise ValueError(f"a_log must have H={num_heads} values (shape [H]), got shape {np.shape(a_log)}")
  if dt_bias is not None and np.size(dt_bias) != num_heads * key_dim:
    raise ValueError(f"dt_bias must have H*K={num_heads * key_dim} values (shape [H*K] or [H, K]), "
                     f"got shape {np.shape(dt_bias)}")
  return lower_bound


def kda_inference(q, k, v, g, beta, *, segment_ids=None, initial_state=None, output_final_state=False,
                  scale=None, a_log=None, dt_bias=None, lower_bound=None, use_qk_l2norm=False,
                  max_num_segments=None, num_heads=None, implementation=None, interpret=False):
  """KDA forward over (packed) sequences, equal to `kda_reference`.

  Args:
    q, k: `[B, T, H, K]`, or lane-dense `[B, T, H*K]` with `num_heads=H` (the layout the model's
      projections produce; the TPU kernel reads it without a copy when K is a multiple of 128 and T
      of 64); float32 or bfloat16.
    v: `[B, T, H, V]`, or `[B, T, H*V]` with `num_heads`.
    g: like q: the log-space decay (<= 0), or, when `a_log` is given, the raw gate input activated
      in the kernel (`kda_gate_softplus`, or `kda_gate_bounded` with `lower_bound`).
    beta: `[B, T, H]` in [0, 1].
    segment_ids: int32 `[B, T]` or `[T]` (shared by every row); 0 = padding, label n uses slot n-1.
    initial_state: float32 `[B, N, H, K, V]` with segment_ids, else `[B, H, K, V]`; zeros if None.
    output_final_state: also return the final state(s) (an absent label keeps its initial state).
    scale: query scale (a Python float), default K**-0.5.
    a_log: `[H]` log decay rate per head (turns on the in-kernel gate); dt_bias: `[H*K]` or `[H, K]`.
    lower_bound: static float in [-5, 0) selecting the bounded gate family.
    use_qk_l2norm: L2-normalise q and k per head inside the kernel (eps 1e-6 inside the sqrt).
    max_num_segments: N, static; needed under jit when no initial_state gives it.
    num_heads: H, static; given exactly when q, k, v, g come in the lane-dense 3-D layout.
    implementation: the kernel: "auto" (default: by the target platform, see the module
      docstring), "pallas_tpu", "pallas_gpu" or "xla".
    interpret: run a Pallas kernel in interpret mode (TPU: `pltpu.InterpretParams()`, or pass one).

  Returns:
    `(o, final_state)`: o in q's layout (`[B, T, H, V]`, or `[B, T, H*V]` with `num_heads`) and
    dtype, exactly 0 on padding; final_state float32 in initial_state's layout, or None.

  Raises:
    ValueError / TypeError: invalid inputs (see `check_kda_inputs`), gate parameters without a_log,
      an unknown implementation, a shape beyond the chosen kernel's limit, or (pallas_tpu, before
      lowering) buffers larger than one TPU device's HBM (`device_hbm_bytes`).
    RuntimeError: a Pallas kernel requested on a platform that cannot run it (without interpret).
  """
  name = _choose_implementation(implementation)
  g_is_raw = a_log is not None
  p = check_kda_inputs(q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids,
                       max_num_segments=max_num_segments, scale=scale, g_is_raw=g_is_raw,
                       num_heads=num_heads)
  lower_bound = _check_gate_args(g_is_raw, a_log, dt_bias, lower_bound, p.num_heads, p.key_dim)
  lane_dense = num_heads is not None
  if name == "xla":
    if interpret:
      raise ValueError("interpret=True applies to the Pallas kernels only, not to implementation='xla'")
    from kda_plugin.ops.inference_xla import run_validated  # noqa: PLC0415
    split = lambda x: x.reshape(*x.shape[:2], p.num_heads, -1) if lane_dense else x
    o, final = run_validated(p, split(q), split(k), split(v), split(g), beta,
                             initial_state=initial_state, output_final_state=output_final_state,
                             scale=scale, a_log=a_log, dt_bias=dt_bias, lower_bound=lower_bound,
                             use_qk_l2norm=use_qk_l2norm)
    return (o.reshape(*o.shape[:2], -1) if lane_dense else o), final
  _check_kernel_limits(name, p.key_dim, p.value_dim, p.num_segments or 1, interpret)
  if name == "pallas_tpu" and not interpret:
    _check_fits_hbm(q, k, v, g, beta, segment_ids=segment_ids, initial_state=initial_state,
                    output_final_state=output_final_state,
                    num_segments=p.num_segments if segment_ids is not None else None,
                    a_log=a_log, dt_bias=dt_bias, num_heads=num_heads)
  if scale is not None and not is_concrete(scale):
    raise ValueError("scale must be a static Python float for the Pallas kernels, not a traced value")
  scale = float(default_scale(scale, p.key_dim))
  packed = segment_ids is not None
  n = p.num_segments if packed else 1
  h0 = initial_state
  if h0 is not None and not packed:
    h0 = jnp.asarray(h0)[:, None]
  if interpret is True and name == "pallas_tpu":
    from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
    interpret = pltpu.InterpretParams()
  gate = None
  if g_is_raw:
    a_log = jnp.asarray(a_log, jnp.float32).reshape(p.num_heads)
    dt_bias = (jnp.zeros((p.num_heads, p.key_dim), jnp.float32) if dt_bias is None
               else jnp.asarray(dt_bias, jnp.float32).reshape(p.num_heads, p.key_dim))
    gate = (a_log, dt_bias)
  seg = None
  if packed:  # a shared [T] map stays one row: every batch row's grid steps read the same labels
    seg = (jnp.asarray(segment_ids, jnp.int32)[None] if np.ndim(segment_ids) == 1
           else p.segment_ids)
  o, final = _forward(q, k, v, g, beta, seg, h0, gate,
                      implementation=name, num_heads=p.num_heads, num_segments=n, scale=scale,
                      lower_bound=lower_bound, use_l2norm=bool(use_qk_l2norm),
                      want_final=bool(output_final_state), interpret=interpret)
  if not output_final_state:
    return o, None
  return o, (final if packed else final[:, 0])


@functools.partial(jax.jit, static_argnames=("implementation", "num_heads", "num_segments", "scale",
                                             "lower_bound", "use_l2norm", "want_final", "interpret"))
def _forward(q, k, v, g, beta, seg, h0, gate, *, implementation, num_heads, num_segments, scale,
             lower_bound, use_l2norm, want_final, interpret):
  """Pads and lays out the operands, runs the kernel (which builds its chunk tables), unpads.

  q, k, v, g come as `[B, T, H, D]` or lane-dense `[B, T, H*D]`; o leaves in the same layout.
  """
  lane_dense = q.ndim == 3
  b, t = q.shape[:2]
  h = num_heads
  if implementation == "pallas_gpu":  # the GPU kernel owns its layout (kda_plugin.ops.pallas_gpu)
    from kda_plugin.ops.pallas_gpu import kda_inference_gpu  # noqa: PLC0415
    if seg is not None:
      seg = jnp.broadcast_to(seg, (b, t))
    split = lambda x: x.reshape(b, t, h, -1) if lane_dense else x
    o, final = kda_inference_gpu(split(q), split(k), split(v), split(g), beta, seg, h0, gate,
                                 num_segments=num_segments, scale=scale, lower_bound=lower_bound,
                                 use_l2norm=use_l2norm, want_final=want_final, interpret=interpret)
    return (o.reshape(b, t, -1) if lane_dense else o), final
  kd = q.shape[-1] // h if lane_dense else q.shape[-1]
  vd = v.shape[-1] // h if lane_dense else v.shape[-1]
  kp, vp = lane_padding(implementation, kd, vd)
  tp = _round_up(t, C)
  tp2 = _round_up(tp, LANE)
  if seg is None:
    seg = jnp.ones((1, t), jnp.int32)
  seg = seg.astype(jnp.int32)

  def dense(x, d, dp):  # -> [B, Tp, H*Dp]: a no-op for aligned lane-dense inputs
    x = x.reshape(b, t, h, d)
    if dp != d or tp != t:
      x = jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, dp - d)))
    return x.reshape(b, tp, h * dp)

  from kda_plugin.ops.pallas_tpu import kda_pallas_tpu  # noqa: PLC0415
  # [B, T, H, D] inputs that need no padding are read in place by the kernel (no relayout copy:
  # on TPU [B, T, H, D] -> [B, T, H*D] moves every element, the tiles cover different dims)
  in_place = _reads_in_place(lane_dense, kd, vd, t, h, (q, k, v, g))
  if in_place:
    q2, k2, g2, v2 = q, k, g, v
  else:
    q2, k2, g2, v2 = dense(q, kd, kp), dense(k, kd, kp), dense(g, kd, kp), dense(v, vd, vp)
  # beta lane-dense along T: [B, H, Tp2] (a free transpose of XLA's T-minor layout of [B, T, H])
  beta_t = jnp.swapaxes(beta, 1, 2)
  if tp2 != t:
    beta_t = jnp.pad(beta_t, ((0, 0), (0, 0), (0, tp2 - t)))
  seg_p = jnp.pad(seg, ((0, 0), (0, tp2 - t))) if tp2 != t else seg
  if h0 is not None:
    h0 = h0.astype(jnp.float32)
    if (kp, vp) != (kd, vd):
      h0 = jnp.pad(h0, ((0, 0),) * 3 + ((0, kp - kd), (0, vp - vd)))
  a_log = dt_row = None
  if gate is not None:
    a_log, dt_bias = gate
    if kp != kd:
      dt_bias = jnp.pad(dt_bias, ((0, 0), (0, kp - kd)))
    dt_row = dt_bias.reshape(1, h * kp)
  o2, final = kda_pallas_tpu(q2, k2, v2, g2, beta_t, seg_p, num_heads=h, key_dim=kd,
                             scale=scale, use_l2norm=use_l2norm, a_log=a_log, dt_bias=dt_row,
                             lower_bound=lower_bound, initial_state=h0, num_segments=num_segments,
                             want_final=want_final, interpret=interpret)
  if (vp, tp) != (vd, t):
    o2 = o2.reshape(b, tp, h, vp)[:, :t, :, :vd].reshape(b, t, h * vd)
  o = o2 if lane_dense else o2.reshape(b, t, h, vd)
  if final is not None and (kp, vp) != (kd, vd):
    final = final[..., :kd, :vd]
  return o, final


def _reads_in_place(lane_dense, kd, vd, t, h, arrays) -> bool:
  """Whether the TPU kernel reads `[B, T, H, D]` q, k, v, g in place (`pallas_tpu.heads_layout_ok`:
  H a multiple of 8, K and V of 128 at most 128, T a multiple of 64): no padding and no relayout
  copy before the call (tools/tpu_cost.py, TPU7x seed shape (ESTIMATE): 0.287 ms with the four
  copies, 0.228 ms without)."""
  from kda_plugin.ops.pallas_tpu import heads_layout_ok  # noqa: PLC0415
  kp, vp = lane_padding("pallas_tpu", kd, vd)
  return (not lane_dense and (kp, vp) == (kd, vd) and t % C == 0
          and all(heads_layout_ok(h, kp, vp, x.dtype) for x in arrays))


def _tiled_bytes(shape, dtype) -> int:
  """HBM bytes of an array in TPU's default tiled layout: the last dim padded to 128 lanes and the
  second-to-last to the sublane tile (8 rows of 32 bits: 8 float32, 16 bfloat16, 32 int8)."""
  item = jnp.dtype(dtype).itemsize
  shape = tuple(shape) or (1,)
  if len(shape) == 1:
    return _round_up(shape[0], LANE) * item
  sub = 8  # XLA's TPU tiles: (8, 128) for 32-bit, (8, 128)(2, 1) for bf16 (the compiled HLO's layouts)
  return math.prod(shape[:-2]) * _round_up(shape[-2], sub) * _round_up(shape[-1], LANE) * item


def estimate_peak_memory(q, k, v, g, beta, *, segment_ids=None, initial_state=None,
                         output_final_state=False, max_num_segments=None, a_log=None, dt_bias=None,
                         num_heads=None, implementation=None, **unused) -> int:
  """Estimated peak device memory (bytes) of one `kda_inference` call; arrays or ShapeDtypeStructs.

  "pallas_tpu": a closed form (nothing is compiled), the HBM buffers alive during the kernel in
  TPU's tiled layout (last dim padded to 128 lanes, second-to-last to the sublane tile):
    arguments = q, k, v, g, beta, segment_ids, initial_state, a_log, dt_bias as passed
    outputs   = o in q's layout and dtype + final states B*N*H*K*V*4 when requested (the kernel
                writes them into a copy of the initial states, or into zeros)
    temporaries = the segment map padded to Tp2 and flattened for the kernel's SMEM blocks (two
               int32 [B, Tp2] arrays at most: the kernel builds its piece tables itself);
               beta `[B, H, Tp2]` when T needs padding (otherwise a free transpose);
               plus, only when K, V or T are not aligned (K, V to 128, T to 64) or q comes as
               [B, T, H, K] the kernel cannot read in place (`_reads_in_place`), padded / relaid
               copies of q, k, g and v and the padded state buffer.
  The map has one row for a shared `[T]` map (or no map), B rows for a `[B, T]` map.
  Tp = T rounded up to 64, Tp2 = Tp rounded up to 128. VMEM (on-chip) is not counted. Checked
  against `compiled.memory_analysis()` (arguments + outputs + temporaries) on v5e, v6e and TPU7x by
  tests/aot/test_tpu_kernel_compile.py.
  "pallas_gpu": inputs and outputs as passed (GPU buffers are row-major, untiled) plus
    `pallas_gpu.workspace_bytes` (the chunk kernel's outputs read by the state pass, the zero-filled
    padded output and the per-row tables).
  "xla": measured from the compiled executable (`memory_analysis()` arguments + outputs +
  temporaries - aliased bytes) on the current platform.
  """
  name = _choose_implementation(implementation)
  shp = lambda x: tuple(np.shape(x))
  lane_dense = num_heads is not None
  if lane_dense:
    b, t, hk = shp(q)
    h = int(num_heads)
    kd, vd = hk // h, shp(v)[2] // h
  else:
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
    from kda_plugin.ops.inference_xla import kda_inference_xla  # noqa: PLC0415
    split = (lambda x: jax.ShapeDtypeStruct((b, t, h, shp(x)[2] // h), x.dtype)) if lane_dense else (
        lambda x: jax.ShapeDtypeStruct(shp(x), x.dtype))
    fn = functools.partial(kda_inference_xla, output_final_state=output_final_state,
                           max_num_segments=n if segment_ids is not None else None)
    args = [split(x) for x in (q, k, v, g)] + [jax.ShapeDtypeStruct(shp(beta), beta.dtype)]
    kw = {name_: jax.ShapeDtypeStruct(shp(x), x.dtype) for name_, x in
          (("segment_ids", segment_ids), ("initial_state", initial_state), ("a_log", a_log),
           ("dt_bias", dt_bias)) if x is not None}
    ma = jax.jit(lambda *a, **k_: fn(*a, **k_)).lower(*args, **kw).compile().memory_analysis()
    return int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
               - ma.alias_size_in_bytes)
  if name == "pallas_gpu":
    from kda_plugin.ops import pallas_gpu  # noqa: PLC0415  (imports Triton's Pallas lowering: only when chosen)
    plain = lambda x: math.prod(shp(x)) * jnp.dtype(x.dtype).itemsize
    inputs = sum(plain(x) for x in (q, k, v, g, beta, segment_ids, initial_state, a_log, dt_bias)
                 if x is not None)
    outputs = b * t * h * vd * jnp.dtype(q.dtype).itemsize + (
        b * n * h * kd * vd * 4 if output_final_state else 0)
    return int(inputs + outputs + pallas_gpu.workspace_bytes(b, t, h, kd, vd, q.dtype))
  kp, vp = lane_padding(name, kd, vd)
  tp = _round_up(t, C)
  tp2 = _round_up(tp, LANE)
  dt = jnp.dtype(q.dtype)
  arrays = [x for x in (q, k, v, g, beta, segment_ids, initial_state, a_log, dt_bias) if x is not None]
  # XLA lays entry arguments out compactly (beta [B, T, H] with T minor); a 1-D array still takes
  # at least one 128-element tile
  inputs = sum(math.prod(shp(x)) * jnp.dtype(x.dtype).itemsize if len(shp(x)) > 1
               else _tiled_bytes(shp(x), x.dtype) for x in arrays)
  o_shape = (b, t, h * vd) if lane_dense else (b, t, h, vd)
  state = b * n * h * kp * vp * 4
  outputs = _tiled_bytes(o_shape, dt) + (
      _tiled_bytes((b, n, h, kd, vd), jnp.float32) if output_final_state else 0)
  rows = b if segment_ids is not None and len(shp(segment_ids)) == 2 else 1
  temps = _tiled_bytes((rows, tp2), jnp.int32) + rows * tp2 * 4
  if tp2 != t:
    temps += _tiled_bytes((b, h, tp2), beta.dtype)  # beta padded along T
  in_place = _reads_in_place(lane_dense, kd, vd, t, h, (q, k, v, g))
  if in_place:
    # q, k, v, g read as passed; the kernel's lane-dense o before its relayout to [B, T, H, V]
    # (an upper bound: memory_analysis on TPU7x counts it at H=32 without final states, 67.3 MB,
    # but finds 0 bytes of temporaries at the seed shape, H=8 with final states)
    temps += b * t * h * vd * dt.itemsize
  elif not lane_dense or kp != kd or tp != t:
    temps += b * tp * h * kp * (2 * dt.itemsize + jnp.dtype(g.dtype).itemsize)
  if not in_place and (not lane_dense or vp != vd or tp != t):
    # v in the kernel layout; the kernel's padded o is not counted: XLA's buffer assignment gives it
    # no extra peak (measured with K=V=64 on TPU7x: temporaries = the four padded inputs)
    temps += b * tp * h * vp * dt.itemsize
  if (kp, vp) != (kd, vd) and (output_final_state or initial_state is not None):
    temps += state
  return int(inputs + outputs + temps)
