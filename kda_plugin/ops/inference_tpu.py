"""The `pallas_tpu` implementation of `kda_inference`: the wrapper around the Mosaic kernel.

It owns everything TPU-specific outside the kernel body (`kda_plugin.ops.pallas_tpu`): its limits
(K and V up to `pallas_tpu.MAX_KV` after padding to 128 lanes, a TPU target unless interpreted), its
memory model (the HBM each device kind offers, the closed-form peak of one call, checked before
lowering), and the layout: K and V padded to 128 lanes, T to the 64-row chunk, beta and the segment
map to lane-dense 128-token rows, `[B, T, H, D]` operands read in place when the kernel can
(`pallas_tpu.heads_layout_ok`), else relaid to `[B, T, H*D]`; o leaves in the caller's layout.

Entry points of the dispatch table (`kda_plugin.ops.inference`): `check(call)`, `run(call)`,
`peak_memory_bytes(...)`; `forward` (the padded layout around the kernel) also serves the training
op's forward (`chunked_tpu`); `call` is the validated `_contract.InferenceCall`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from kda_plugin.ops._chunk_common import CHUNK as C
from kda_plugin.ops._platform import abstract_device, target_platform
from kda_plugin.ops.pallas_tpu import LANE, MAX_KV, heads_layout_ok, kda_pallas_tpu

NAME = "pallas_tpu"

# HBM one jax device may use, by `device_kind`, for an abstract (ahead-of-time) target, where there
# is no `memory_stats()`: libtpu 0.0.52's own figure, read from its compile-time out-of-memory message
# (tools/aot_compile.py probes it the same way). A real TPU device reports `bytes_limit` instead.
USABLE_HBM_BYTES = {"TPU v5 lite": int(15.75 * 2**30), "TPU v5": int(95.73 * 2**30),
                    "TPU v6 lite": int(31.24 * 2**30), "TPU7x": int(94.74 * 2**30)}


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def padded_dims(key_dim: int, value_dim: int) -> tuple[int, int]:
  """(Kp, Vp): K and V rounded up to whole 128-lane vregs."""
  return _round_up(key_dim, LANE), _round_up(value_dim, LANE)


def device_hbm_bytes() -> tuple[str, int] | None:
  """(device kind, HBM bytes one device may use) of the TPU being traced for, or None when unknown
  (not a TPU, or a device kind missing from `USABLE_HBM_BYTES` that reports no memory stats)."""
  device = abstract_device()
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


def check(call) -> None:
  """Raises before lowering when the kernel cannot run `call`.

  Raises:
    ValueError: K or V above `MAX_KV` after padding; buffers (`peak_memory_bytes`, within 10 % of the
      compiled figure) larger than one TPU device's HBM (`device_hbm_bytes`), which libtpu would
      otherwise report as RESOURCE_EXHAUSTED at compile time or the run at allocation.
    RuntimeError: a target platform that is not a TPU, without `interpret`.
  """
  p = call.problem
  kp, vp = padded_dims(p.key_dim, p.value_dim)
  if max(kp, vp) > MAX_KV:
    raise ValueError(
        f"implementation 'pallas_tpu' supports K and V up to {MAX_KV} (after padding to "
        f"{LANE} lanes); got K={p.key_dim}, V={p.value_dim}")
  platform = target_platform()
  if not call.interpret and platform != "tpu":
    raise RuntimeError(
        f"implementation 'pallas_tpu' needs a TPU, but the target platform is {platform!r}; pass "
        "interpret=True to simulate the kernel on CPU, or use implementation='xla'")
  if call.interpret:
    return
  hbm = device_hbm_bytes()
  if hbm is None:
    return
  kind, limit = hbm
  need = peak_memory_bytes(call.q, call.k, call.v, call.g, call.beta, segment_ids=call.segment_ids,
                           initial_state=call.initial_state, output_final_state=call.output_final_state,
                           a_log=call.a_log, dt_bias=call.dt_bias, lane_dense=call.lane_dense,
                           dims=(p.batch, p.seq_len, p.num_heads, p.key_dim, p.value_dim, call.num_slots))
  if need > limit:
    raise ValueError(
        f"kda_inference(implementation='pallas_tpu') needs about {need / 2**30:.2f} GiB of HBM for these "
        f"shapes (q {tuple(np.shape(call.q))}; estimate_peak_memory) but one {kind} device has "
        f"{limit / 2**30:.2f} GiB: split the batch or the sequence (or shard it over a mesh)")


def run(call):
  """`(o, final_state)` of a validated call (see `kda_inference`)."""
  interpret = call.interpret
  if interpret is True:
    from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
    interpret = pltpu.InterpretParams()
  o, final, _ = forward(call.q, call.k, call.v, call.g, call.beta, call.kernel_segment_ids(),
                      call.slot_states(), call.kernel_gate(), num_heads=call.problem.num_heads,
                      num_segments=call.num_slots, scale=call.kernel_scale(),
                      lower_bound=call.lower_bound, use_l2norm=bool(call.use_qk_l2norm),
                      want_final=bool(call.output_final_state), interpret=interpret)
  return call.unslot_final(o, final)


@functools.partial(jax.jit, static_argnames=("num_heads", "num_segments", "scale", "lower_bound",
                                             "use_l2norm", "want_final", "want_states", "interpret"))
def forward(q, k, v, g, beta, seg, h0, gate, *, num_heads, num_segments, scale, lower_bound,
            use_l2norm, want_final, interpret, want_states=False):
  """Pads and lays out the operands, runs the kernel (which builds its chunk tables), unpads.

  q, k, v, g come as `[B, T, H, D]` or lane-dense `[B, T, H*D]`; o leaves in the same layout.
  Returns `(o, final | None, states | None)`: states (with `want_states`) float32
  `[NC, B, H, K, V]`, the state entering each 64-row chunk (`pallas_tpu.kda_pallas_tpu`).
  """
  lane_dense = q.ndim == 3
  b, t = q.shape[:2]
  h = num_heads
  kd = q.shape[-1] // h if lane_dense else q.shape[-1]
  vd = v.shape[-1] // h if lane_dense else v.shape[-1]
  kp, vp = padded_dims(kd, vd)
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

  # [B, T, H, D] inputs that need no padding are read in place by the kernel (no relayout copy:
  # on TPU [B, T, H, D] -> [B, T, H*D] moves every element, the tiles cover different dims)
  if _reads_in_place(lane_dense, kd, vd, t, h, (q, k, v, g)):
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
  o2, final, states = kda_pallas_tpu(q2, k2, v2, g2, beta_t, seg_p, num_heads=h, key_dim=kd,
                                     scale=scale, use_l2norm=use_l2norm, a_log=a_log, dt_bias=dt_row,
                                     lower_bound=lower_bound, initial_state=h0,
                                     num_segments=num_segments, want_final=want_final,
                                     want_states=want_states, interpret=interpret)
  if (vp, tp) != (vd, t):
    o2 = o2.reshape(b, tp, h, vp)[:, :t, :, :vd].reshape(b, t, h * vd)
  o = o2 if lane_dense else o2.reshape(b, t, h, vd)
  if (kp, vp) != (kd, vd):
    final = None if final is None else final[..., :kd, :vd]
    states = None if states is None else states[..., :kd, :vd]
  return o, final, states


def _reads_in_place(lane_dense, kd, vd, t, h, arrays) -> bool:
  """Whether the kernel reads `[B, T, H, D]` q, k, v, g in place (`pallas_tpu.heads_layout_ok`: H a
  multiple of 8, K and V of 128 at most 128, T a multiple of 64): no padding and no relayout copy
  before the call (four relayout copies cost device time: docs/performance.md)."""
  kp, vp = padded_dims(kd, vd)
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


def peak_memory_bytes(q, k, v, g, beta, *, segment_ids, initial_state, output_final_state, a_log,
                      dt_bias, lane_dense, dims) -> int:
  """The closed-form HBM peak of one call (nothing is compiled): the buffers alive during the kernel
  in TPU's tiled layout (last dim padded to 128 lanes, second-to-last to the sublane tile).

    arguments = q, k, v, g, beta, segment_ids, initial_state, a_log, dt_bias as passed
    outputs   = o in q's layout and dtype + final states B*N*H*K*V*4 when requested (the kernel
                writes them into a copy of the initial states, or into zeros)
    temporaries = the segment map padded to Tp2 and flattened for the kernel's SMEM blocks (two
               int32 [B, Tp2] arrays at most: the kernel builds its piece tables itself);
               beta `[B, H, Tp2]` when T needs padding (otherwise a free transpose);
               plus, only when K, V or T are not aligned (K, V to 128, T to 64) or q comes as
               [B, T, H, K] the kernel cannot read in place (`_reads_in_place`), padded / relaid
               copies of q, k, g and v and the padded state buffer.

  The map has one row for a shared `[T]` map (or no map), B rows for a `[B, T]` map. Tp = T rounded
  up to 64, Tp2 = Tp rounded up to 128. VMEM (on-chip) is not counted. Checked against
  `compiled.memory_analysis()` on v5e, v6e and TPU7x by tests/aot/test_tpu_kernel_compile.py.
  dims: (B, T, H, K, V, N) with N = 1 without segment_ids.
  """
  b, t, h, kd, vd, n = dims
  shp = lambda x: tuple(np.shape(x))
  kp, vp = padded_dims(kd, vd)
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
    # (an upper bound: XLA's buffer assignment may reuse it, docs/performance.md)
    temps += b * t * h * vd * dt.itemsize
  elif not lane_dense or kp != kd or tp != t:
    temps += b * tp * h * kp * (2 * dt.itemsize + jnp.dtype(g.dtype).itemsize)
  if not in_place and (not lane_dense or vp != vd or tp != t):
    # v in the kernel layout
    temps += b * tp * h * vp * dt.itemsize
  if not in_place and vp != vd:
    # the kernel's o padded along V before its slice: with four chunks per grid step XLA gives it its
    # own peak (compiled on TPU7x, K=V=64: 84 MB of temporaries, 16.8 MB of them this o); padded along
    # T alone it still shares a buffer (docs/performance.md)
    temps += b * tp * h * vp * dt.itemsize
  if (kp, vp) != (kd, vd) and (output_final_state or initial_state is not None):
    temps += state
  return int(inputs + outputs + temps)
