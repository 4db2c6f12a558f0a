"""XLA backend of `kda_inference`: the segment-native chunked forward of `kda_chunked`, with the gate
activation and the q/k L2 norm applied per chunk inside the scan.

Math: docs/kda.md sections 'Chunked form (WY/UT)' and 'Gates', docs/packing.md section 'Segment-native chunk algorithm'. The algorithm
is `kda_plugin.ops.chunked.kda_chunk_core` (shared with the training path, not a second copy); this
module only validates the arguments, chooses the static score factorisation a bounded gate permits,
and fuses the gate / L2 norm into the per-chunk work.

Chunk size: 64 rows, as the training op, and two chunks per scan step (`CHUNKS_PER_STEP`): their
gates, scores and inverses are built together, then the state runs through them one after the other,
so that larger operations keep both cores of a small CPU busy (the A/B figures behind both choices:
docs/performance.md section 'CPU: kda_inference (XLA) against tokamax xla_chunked').

Entry points of the dispatch table (`kda_plugin.ops.inference`): `check(call)`, `run(call)`,
`peak_memory_bytes(...)`; `kda_inference_xla` is the same path as a standalone op (it validates).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kda_plugin.ops._chunk_common import CHUNK, SUB
from kda_plugin.ops._contract import InferenceCall, check_gate_args, check_kda_inputs
from kda_plugin.ops.chunked import FACTOR_LIMIT, chunk_prep, kda_chunk_core, run_with_slots

CHUNKS_PER_STEP = 2  # see the module docstring


def kda_inference_xla(q, k, v, g, beta, *, segment_ids=None, initial_state=None,
                      output_final_state=False, scale=None, a_log=None, dt_bias=None,
                      lower_bound=None, use_qk_l2norm=False, max_num_segments=None):
  """KDA forward over (packed) sequences in plain XLA (any platform; the CPU path of `kda_inference`).

  Equal to `kda_reference` applied to the explicitly activated gate and normalised q, k.

  Boundaries and steep gates: as `kda_chunked` (the same chunk core): the cumulative gate restarts
  at every document's first row, inside a chunk too, and every decay exponent is a direct sum of the
  gates it spans. With the bounded gate (`lower_bound`), the 16-row diagonal sub-blocks are instead
  factored around the sub-block's midpoint (exponents at most 8 |lower_bound| <= 40 nats in size, a
  relative rounding of at most ~80 * 2^-24 per score).

  Args:
    q, k: `[B, T, H, K]` float32 or bfloat16 (computed in float32, upcast once per chunk).
    v: `[B, T, H, V]`.
    g: `[B, T, H, K]`: the log-space decay (<= 0), or with `a_log` the raw gate input, activated in
      float32 by `kda_gate_softplus` (or `kda_gate_bounded` when `lower_bound` is given).
    beta: `[B, T, H]` in [0, 1].
    segment_ids: int32 `[B, T]` or `[T]`; 0 = padding, label n uses state slot n-1.
    initial_state: float32 `[B, N, H, K, V]` with segment_ids, else `[B, H, K, V]`; zeros if None.
    output_final_state: also return the final state(s) (an absent label keeps its initial state).
    scale: query scale (a Python float), default K**-0.5.
    a_log: `[H]` per-head log decay rate; turns on the in-kernel gate.
    dt_bias: `[H*K]` or `[H, K]` gate bias (with a_log only), zeros if None.
    lower_bound: static float in [-5, 0) selecting the bounded gate (with a_log only).
    use_qk_l2norm: L2-normalise q and k per head (eps 1e-6 inside the sqrt, `gates.l2norm`).
    max_num_segments: N (static); needed under jit when no initial_state gives it.

  Returns:
    `(o, final_state)`: o `[B, T, H, V]` in q's dtype (exactly 0 on padding); final_state float32 in
    initial_state's layout, or None.

  Raises:
    ValueError, TypeError: invalid inputs (see `check_kda_inputs`), dt_bias or lower_bound without
      a_log, lower_bound outside [-5, 0), or a_log / dt_bias of the wrong size.
  """
  g_is_raw = a_log is not None
  p = check_kda_inputs(q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids,
                       max_num_segments=max_num_segments, scale=scale, g_is_raw=g_is_raw)
  lb = check_gate_args(g_is_raw, a_log, dt_bias, lower_bound, p.num_heads, p.key_dim)
  return run(InferenceCall(p, q, k, v, g, beta, segment_ids, initial_state, output_final_state, scale,
                           a_log, dt_bias, lb, use_qk_l2norm, lane_dense=False, interpret=False))


def check(call) -> None:
  """Raises ValueError for `interpret=True`, which only the Pallas kernels have."""
  if call.interpret:
    raise ValueError("interpret=True applies to the Pallas kernels only, not to implementation='xla'")


def run(call):
  """`(o, final_state)` of a validated call (see `kda_inference`): lane-dense operands are split into
  heads (a free reshape) and o is merged back."""
  p = call.problem
  q, k, v, g = (call.split_heads(x) for x in (call.q, call.k, call.v, call.g))
  gate = call.kernel_gate()
  lb = call.lower_bound
  # A bounded gate decays by less than |lower_bound| nats per token, so every 16-row sub-block stays
  # inside the range where the midpoint factorisation is exact: no run-time check is needed.
  diag_mode = "factor" if (lb is not None and SUB * abs(lb) <= FACTOR_LIMIT) else "auto"
  want_final = bool(call.output_final_state)
  core = lambda seg, h0, sc, n: _forward(q, k, v, g, call.beta, seg, h0, gate, scale=sc, n_slots=n,
                                         want_final=want_final, diag_mode=diag_mode, lower_bound=lb,
                                         use_l2norm=bool(call.use_qk_l2norm))
  o, final = run_with_slots(p, q, call.initial_state, call.scale, call.output_final_state, core)
  return (o.reshape(*o.shape[:2], -1) if call.lane_dense else o), final


def peak_memory_bytes(q, k, v, g, beta, *, segment_ids, initial_state, output_final_state, a_log,
                      dt_bias, lane_dense, dims) -> int:
  """Measured, not modelled: arguments + outputs + temporaries - aliased bytes of the compiled
  executable (`memory_analysis()`) on the current platform. dims: (B, T, H, K, V, N)."""
  b, t, h, _, _, n = dims
  shp = lambda x: tuple(np.shape(x))
  split = (lambda x: jax.ShapeDtypeStruct((b, t, h, shp(x)[2] // h), x.dtype)) if lane_dense else (
      lambda x: jax.ShapeDtypeStruct(shp(x), x.dtype))
  fn = functools.partial(kda_inference_xla, output_final_state=output_final_state,
                         max_num_segments=n if segment_ids is not None else None)
  args = [split(x) for x in (q, k, v, g)] + [jax.ShapeDtypeStruct(shp(beta), beta.dtype)]
  kw = {name: jax.ShapeDtypeStruct(shp(x), x.dtype) for name, x in
        (("segment_ids", segment_ids), ("initial_state", initial_state), ("a_log", a_log),
         ("dt_bias", dt_bias)) if x is not None}
  ma = jax.jit(lambda *a, **k_: fn(*a, **k_)).lower(*args, **kw).compile().memory_analysis()
  return int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
             - ma.alias_size_in_bytes)


@functools.partial(jax.jit, static_argnames=("scale", "n_slots", "want_final", "diag_mode",
                                             "lower_bound", "use_l2norm"))
def _forward(q, k, v, g, beta, seg, h0, gate, *, scale, n_slots, want_final, diag_mode, lower_bound,
             use_l2norm):
  return kda_chunk_core(q, k, v, g, beta, seg, h0, scale=scale, n_slots=n_slots,
                        want_final=want_final, diag_mode=diag_mode,
                        prep=chunk_prep(gate, lower_bound, use_l2norm),
                        group=CHUNKS_PER_STEP if q.shape[1] > CHUNK else 1)
