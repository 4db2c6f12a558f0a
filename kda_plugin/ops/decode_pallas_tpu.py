"""Pallas TPU (Mosaic) kernel for the KDA decode step: one read and one write of the state.

Decode is bound by HBM traffic over the float32 `[B, H, K, V]` state (one token per sequence: about
6KV FLOPs per head against 8KV bytes). XLA does not do the step in one pass over the state: the
update `S' = Diag(a) S + k delta^T` needs `delta = beta (v - (a k)^T S)`, a reduction over the same
state, so XLA reads S once for the reduction and again for the update (three state transfers
instead of two). This kernel holds a block of sequences' states in VMEM, computes the reductions
and the update there, and writes the new state over the old one (`input_output_aliases`): two
state transfers, the HBM floor.

Grid `(B / BB,)`, BB sequences (all their heads) a step, "parallel"; BB divides B. The operands
keep the caller's `[B, H, ...]` layout and dtypes (the blocks' last two dims are whole), so no XLA
op reshapes or converts them around the kernel. Per sequence (a loop) and head (unrolled):
  pred = sum_k (a k)[k] S[k, :],  qS = sum_k (a q)[k] S[k, :]   (VPU multiply and sublane reduce:
                                                                  float32, no MXU passes)
  delta = beta (v - pred);  S' = a[:, None] S + k[:, None] delta;  o = qS + (q . k) delta
The per-key columns `a`, `k`, `a k`, `a q` of a sequence's heads come from one in-VMEM transpose
of its `[4H, K]` rows. Same math as `reference.delta_rule_step`, up to float32 rounding
(docs/kda.md 'Token recurrence').
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

SUBLANE, LANE = 8, 128
# Steps per call: each step adds a fixed overhead (about 0.35 us in the Pallas TPU docs, ASSUMED),
# while the first block's read and the last block's write are not overlapped with anything
# (2 x block bytes / HBM bandwidth). Their sum is least at sqrt(2 x state bytes / (HBM_BW x
# STEP_OVERHEAD_S)) steps; BB is the divisor of B closest to that.
STEP_OVERHEAD_S = 0.35e-6
HBM_BYTES_PER_S = 819e9  # v5e; the choice moves little between generations (square root)
MAX_VMEM_BYTES = 100 << 20  # of v5e's 128 MiB VMEM (the smallest of the supported generations)


def _padded_state_bytes(key_dim: int, value_dim: int) -> int:
  """One head's float32 `[K, V]` state as VMEM holds it, (8, 128)-tiled."""
  return -(-key_dim // SUBLANE) * SUBLANE * -(-value_dim // LANE) * LANE * 4


def vmem_limit_bytes(seqs_per_step: int, heads: int, key_dim: int, value_dim: int) -> int:
  """Double-buffered state blocks in and out, the same again for the kernel's temporaries, plus 8
  MiB for the small blocks; at least 32 MiB."""
  return max(32 << 20, 6 * seqs_per_step * heads * _padded_state_bytes(key_dim, value_dim) + (8 << 20))


def seqs_per_step(batch: int, heads: int, key_dim: int, value_dim: int) -> int:
  """BB: the divisor of B whose step count is closest to the optimum above, within the VMEM plan."""
  total = batch * heads * _padded_state_bytes(key_dim, value_dim)
  want_steps = max(1.0, math.sqrt(2 * total / (HBM_BYTES_PER_S * STEP_OVERHEAD_S)))
  fits = [d for d in range(1, batch + 1)
          if batch % d == 0 and vmem_limit_bytes(d, heads, key_dim, value_dim) <= MAX_VMEM_BYTES]
  return min(fits or [1], key=lambda d: abs(math.log(batch / d / want_steps)))


def check_limits(batch: int, heads: int, key_dim: int, value_dim: int) -> None:
  """Raises ValueError when one sequence's states overflow the kernel's VMEM plan (names the limit)."""
  need = vmem_limit_bytes(1, heads, key_dim, value_dim)
  if need > MAX_VMEM_BYTES:
    raise ValueError(
        f"implementation 'pallas_tpu' of the decode step needs {need / 2**20:.0f} MiB of VMEM for "
        f"H={heads}, K={key_dim}, V={value_dim} (limit {MAX_VMEM_BYTES / 2**20:.0f} MiB: one "
        "sequence's float32 states double-buffered in and out); use implementation='xla'")


def _kernel(q_ref, k_ref, g_ref, v_ref, beta_ref, s_ref, o_ref, so_ref, orow_ref, *, bb, heads, scale):
  f32 = jnp.float32
  first = pl.program_id(0) * bb

  def sequence(i, carry):
    q = q_ref[i].astype(f32) * scale  # [H, K]
    k = k_ref[i].astype(f32)
    a = jnp.exp(g_ref[i].astype(f32))
    v = v_ref[i].astype(f32)  # [H, V]
    beta = beta_ref[pl.ds(first + i, 1), :]  # [1, H]
    cols = jnp.concatenate([a, k, a * k, a * q], axis=0).T  # [K, 4H]: column j is row j
    qk = jnp.sum(q * k, axis=1, keepdims=True)  # [H, 1]
    col = lambda c, h: cols[:, c * heads + h:c * heads + h + 1]  # [K, 1]
    for h in range(heads):
      s = s_ref[i, h]  # [K, V]
      pred = jnp.sum(s * col(2, h), axis=0, keepdims=True)  # [1, V]
      qs = jnp.sum(s * col(3, h), axis=0, keepdims=True)
      delta = beta[:, h:h + 1] * (v[h:h + 1, :] - pred)
      so_ref[i, h] = col(0, h) * s + col(1, h) * delta
      orow_ref[h:h + 1, :] = qs + qk[h:h + 1, :] * delta
    o_ref[i] = orow_ref[...].astype(o_ref.dtype)
    return carry

  lax.fori_loop(0, bb, sequence, 0)


def decode_step_tpu(state, q, k, v, g, beta, *, scale, interpret=False, seqs_per_step_override=None):
  """One decode step for every sequence and head on the TPU.

  Args:
    state: float32 `[B, H, K, V]`.
    q, k, g: `[B, H, K]`, float32 or bfloat16 (g is the log-space decay, <= 0); q not yet scaled.
    v: `[B, H, V]`.
    beta: float32 `[B, H]`.
    scale: the query scale (a Python float).
    interpret: run the kernel in Pallas interpret mode (CPU tests).
    seqs_per_step_override: BB instead of `seqs_per_step`'s choice (tools/bench/decode_block_sweep.py
      times the choices on a chip); must divide B and fit the VMEM plan.

  Returns:
    `(o [B, H, V] in q's dtype, new_state float32 [B, H, K, V])`; new_state is written over
    `state`'s buffer (aliased): a caller that donates the state (or carries it in a loop) pays no
    copy.

  Raises:
    ValueError: the shape is beyond the VMEM plan (`check_limits`), or a bad override.
  """
  b, h, kd, vd = state.shape
  check_limits(b, h, kd, vd)
  bb = seqs_per_step(b, h, kd, vd) if seqs_per_step_override is None else seqs_per_step_override
  if b % bb or vmem_limit_bytes(bb, h, kd, vd) > MAX_VMEM_BYTES:
    raise ValueError(f"seqs_per_step_override={bb}: must divide B={b} and fit {MAX_VMEM_BYTES >> 20} MiB "
                     f"of VMEM (needs {vmem_limit_bytes(bb, h, kd, vd) >> 20} MiB)")
  vecs = lambda d: pl.BlockSpec((bb, h, d), lambda i: (i, 0, 0))
  states = pl.BlockSpec((bb, h, kd, vd), lambda i: (i, 0, 0, 0))
  return pl.pallas_call(
      functools.partial(_kernel, bb=bb, heads=h, scale=float(scale)),
      out_shape=(jax.ShapeDtypeStruct((b, h, vd), q.dtype), jax.ShapeDtypeStruct((b, h, kd, vd), jnp.float32)),
      grid=(b // bb,),
      in_specs=[vecs(kd), vecs(kd), vecs(kd), vecs(vd), pl.BlockSpec((b, h), lambda i: (0, 0)), states],
      out_specs=(vecs(vd), states),
      scratch_shapes=[pltpu.VMEM((h, vd), jnp.float32)],
      input_output_aliases={5: 1},
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                           vmem_limit_bytes=vmem_limit_bytes(bb, h, kd, vd)),
      interpret=interpret, name="kda_decode_step_tpu")(q, k, g, v, beta, state)
