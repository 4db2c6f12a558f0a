"""Pallas TPU (Mosaic) kernel for the KDA decode step: one read and one write of the state.

Decode is bound by HBM traffic over the float32 `[B, H, K, V]` state (one token per sequence: about
6KV FLOPs per head against 8KV bytes). XLA does not do the step in one pass over the state: the
update `S' = Diag(a) S + k delta^T` needs `delta = beta (v - (a k)^T S)`, a reduction over the same
state, so XLA reads S once for the reduction and again for the update (three state transfers
instead of two). This kernel holds a block of heads' states in VMEM, computes the reductions and the
update there, and writes the new state over the old one (`input_output_aliases`): two state
transfers, the HBM floor.

Grid `(ceil(R / HB),)` over the R = B*H heads, HB heads a step ("parallel"; the last step may be
partial: heads are independent, and rows past R are never written back). Per head (unrolled):
  pred = sum_k (a k)[k] S[k, :],  qS = sum_k (a q)[k] S[k, :]   (VPU multiply and sublane reduce:
                                                                  float32, no MXU passes)
  delta = beta (v - pred);  S' = a[:, None] S + k[:, None] delta;  o = qS + (q . k) delta
The per-key columns `a`, `k`, `a k`, `a q` come from one in-VMEM transpose of the step's `[4 HB, K]`
rows. Same math as `reference.delta_rule_step`, up to float32 rounding (docs/kda.md 'Token
recurrence').
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

SUBLANE, LANE = 8, 128
# State bytes one grid step moves each way: large enough that a step's DMA hides the per-step
# overhead, small enough to double-buffer input and output blocks well inside VMEM (32 heads at
# K=V=128).
STEP_STATE_BYTES = 2 << 20
MAX_HEADS_PER_STEP = 32  # the per-head loop is unrolled: this bounds the kernel's code size
MAX_VMEM_BYTES = 100 << 20  # of v5e's 128 MiB VMEM (the smallest of the supported generations)


def _padded_state_bytes(key_dim: int, value_dim: int) -> int:
  """One head's float32 `[K, V]` state as VMEM holds it, (8, 128)-tiled."""
  return -(-key_dim // SUBLANE) * SUBLANE * -(-value_dim // LANE) * LANE * 4


def heads_per_step(num_rows: int, key_dim: int, value_dim: int) -> int:
  """HB: every head in one step when B*H (`num_rows`) fits STEP_STATE_BYTES and
  MAX_HEADS_PER_STEP, else the largest multiple of 8 that does (at least 8)."""
  fit = min(MAX_HEADS_PER_STEP, STEP_STATE_BYTES // _padded_state_bytes(key_dim, value_dim))
  if num_rows <= max(fit, 1):
    return num_rows
  return max(SUBLANE, fit // SUBLANE * SUBLANE)


def vmem_limit_bytes(num_rows: int, key_dim: int, value_dim: int) -> int:
  """Double-buffered state blocks in and out, the same again for the kernel's temporaries, plus 8
  MiB for the small blocks; at least 32 MiB."""
  block = heads_per_step(num_rows, key_dim, value_dim) * _padded_state_bytes(key_dim, value_dim)
  return max(32 << 20, 6 * block + (8 << 20))


def check_limits(num_rows: int, key_dim: int, value_dim: int) -> None:
  """Raises ValueError when the kernel's VMEM plan cannot hold the shape (names the limit)."""
  need = vmem_limit_bytes(num_rows, key_dim, value_dim)
  if need > MAX_VMEM_BYTES:
    raise ValueError(
        f"implementation 'pallas_tpu' of the decode step needs {need / 2**20:.0f} MiB of VMEM for "
        f"K={key_dim}, V={value_dim} (limit {MAX_VMEM_BYTES / 2**20:.0f} MiB: 8 heads' float32 states "
        "double-buffered in and out); use implementation='xla'")


def _kernel(q_ref, k_ref, g_ref, v_ref, beta_ref, s_ref, o_ref, so_ref, *, hb):
  q, k = q_ref[...], k_ref[...]
  a = jnp.exp(g_ref[...])
  cols = jnp.concatenate([a, k, a * k, a * q], axis=0).T  # [K, 4 HB]: column j is row j
  qk = jnp.sum(q * k, axis=1, keepdims=True)  # [HB, 1]
  v, beta = v_ref[...], beta_ref[...]
  col = lambda i, j: cols[:, i * hb + j:i * hb + j + 1]  # [K, 1]
  for j in range(hb):
    s = s_ref[j]
    pred = jnp.sum(s * col(2, j), axis=0, keepdims=True)  # [1, V]
    qs = jnp.sum(s * col(3, j), axis=0, keepdims=True)
    delta = beta[j:j + 1, :] * (v[j:j + 1, :] - pred)
    so_ref[j] = col(0, j) * s + col(1, j) * delta
    o_ref[j:j + 1, :] = qs + qk[j:j + 1, :] * delta


def decode_step_tpu(state, q, k, v, g, beta, *, interpret=False):
  """One decode step for every head on the TPU.

  Args:
    state: float32 `[R, K, V]` (R = B*H heads, flattened).
    q: float32 `[R, K]`, already multiplied by the scale.
    k, g: float32 `[R, K]` (g is the log-space decay, <= 0).
    v: float32 `[R, V]`.
    beta: float32 `[R, 1]`.
    interpret: run the kernel in Pallas interpret mode (CPU tests).

  Returns:
    `(o float32 [R, V], new_state float32 [R, K, V])`; new_state is written over `state`'s buffer
    (aliased): a caller that donates the state (or carries it in a loop) pays no copy.

  Raises:
    ValueError: the shape is beyond the VMEM plan (`check_limits`).
  """
  r, kd, vd = state.shape
  check_limits(r, kd, vd)
  hb = heads_per_step(r, kd, vd)
  rows = lambda d: pl.BlockSpec((hb, d), lambda i: (i, 0))
  states = pl.BlockSpec((hb, kd, vd), lambda i: (i, 0, 0))
  f32 = jnp.float32
  return pl.pallas_call(
      functools.partial(_kernel, hb=hb),
      out_shape=(jax.ShapeDtypeStruct((r, vd), f32), jax.ShapeDtypeStruct((r, kd, vd), f32)),
      grid=(pl.cdiv(r, hb),),
      in_specs=[rows(kd), rows(kd), rows(kd), rows(vd), rows(1), states],
      out_specs=(rows(vd), states),
      input_output_aliases={5: 1},
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                           vmem_limit_bytes=vmem_limit_bytes(r, kd, vd)),
      interpret=interpret, name="kda_decode_step_tpu")(q, k, g, v, beta, state)
