"""XLA backend of `kda_inference`: the segment-native chunked forward of `kda_chunked`, with the gate
activation and the q/k L2 norm applied per chunk inside the scan.

Math: docs/kda.md sections 'Chunked form (WY/UT)' and 'Gates', docs/packing.md section 'Segment-native chunk algorithm'. The algorithm
is `kda_plugin.ops.chunked.kda_chunk_core` (shared with the training path, not a second copy); this
module only validates the arguments, chooses the static score factorisation a bounded gate permits,
and fuses the gate / L2 norm into the per-chunk work.

Chunk size: 64 rows, as the training op, and two chunks per scan step (`CHUNKS_PER_STEP`): their
gates, scores and inverses are built together, then the state runs through them one after the other.
Larger operations keep both cores of a small CPU busy: 5-6 % faster at T = 512 to 8192 in float32
(paired runs in one process; 4 per step is no better, 8 spills the cache and is 20 % slower). 32-row
chunks have 20 % fewer FLOPs per token and win only on a loaded CPU; idle, 64 is 5-10 % faster.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kda_plugin.ops._contract import check_kda_inputs
from kda_plugin.ops.chunked import CHUNK, FACTOR_LIMIT, SUB, kda_chunk_core, run_with_slots
from kda_plugin.ops.gates import activate_gate, check_lower_bound, l2norm

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
  if not g_is_raw and (dt_bias is not None or lower_bound is not None):
    raise ValueError("dt_bias and lower_bound configure the in-kernel gate and require a_log "
                     "(without a_log, g must already be the activated log-space decay)")
  if g_is_raw:
    if np.size(a_log) != p.num_heads:
      raise ValueError(f"a_log must have H={p.num_heads} values (shape [H]), got shape {np.shape(a_log)}")
    if dt_bias is not None and np.size(dt_bias) != p.num_heads * p.key_dim:
      raise ValueError(f"dt_bias must have H*K={p.num_heads * p.key_dim} values (shape [H*K] or "
                       f"[H, K]), got shape {np.shape(dt_bias)}")
  lb = None if lower_bound is None else check_lower_bound(lower_bound)
  return run_validated(p, q, k, v, g, beta, initial_state=initial_state,
                       output_final_state=output_final_state, scale=scale, a_log=a_log,
                       dt_bias=dt_bias, lower_bound=lb, use_qk_l2norm=use_qk_l2norm)


def run_validated(p, q, k, v, g, beta, *, initial_state, output_final_state, scale, a_log, dt_bias,
                  lower_bound, use_qk_l2norm):
  """`kda_inference_xla` on arguments already validated by `check_kda_inputs` (whose `KDAProblem` is
  `p`) and the gate checks: `kda_inference` validates once and calls this directly. Shapes as
  `kda_inference_xla` ([B, T, H, D] layout); `lower_bound` already checked."""
  gate = None
  if a_log is not None:
    a_log = jnp.asarray(a_log, jnp.float32).reshape(p.num_heads)
    dt_bias = (jnp.zeros((p.num_heads, p.key_dim), jnp.float32) if dt_bias is None
               else jnp.asarray(dt_bias, jnp.float32).reshape(p.num_heads, p.key_dim))
    gate = (a_log, dt_bias)
  lb = lower_bound
  # A bounded gate decays by less than |lower_bound| nats per token, so every 16-row sub-block stays
  # inside the range where the midpoint factorisation is exact: no run-time check is needed.
  diag_mode = "factor" if (lb is not None and SUB * abs(lb) <= FACTOR_LIMIT) else "auto"
  want_final = bool(output_final_state)
  core = lambda seg, h0, sc, n: _forward(q, k, v, g, beta, seg, h0, gate, scale=sc, n_slots=n,
                                         want_final=want_final, diag_mode=diag_mode, lower_bound=lb,
                                         use_l2norm=bool(use_qk_l2norm))
  return run_with_slots(p, q, initial_state, scale, output_final_state, core)


@functools.partial(jax.jit, static_argnames=("scale", "n_slots", "want_final", "diag_mode",
                                             "lower_bound", "use_l2norm"))
def _forward(q, k, v, g, beta, seg, h0, gate, *, scale, n_slots, want_final, diag_mode, lower_bound,
             use_l2norm):
  def prep(qc, kc, gc):  # float32 chunk [..., C, H, K]
    if use_l2norm:
      qc, kc = l2norm(qc), l2norm(kc)
    if gate is not None:
      gc = activate_gate(gc, gate[0], gate[1], lower_bound)
    return qc, kc, gc

  use_prep = use_l2norm or gate is not None
  return kda_chunk_core(q, k, v, g, beta, seg, h0, scale=scale, n_slots=n_slots,
                        want_final=want_final, diag_mode=diag_mode,
                        prep=prep if use_prep else None,
                        group=CHUNKS_PER_STEP if q.shape[1] > CHUNK else 1)
