"""Constants and helpers every chunked KDA implementation shares: the chunk and sub-block sizes, the
L2-norm epsilon, the in-kernel gate activation and the factored-diagonal rule of the bounded gate.

One definition for the XLA chunk core (`chunked`), the TPU kernel math (`_chunk_math`) and the GPU
kernel math (`_gpu_chunk_math`), so that the implementations cannot drift apart on them. Everything
here is elementwise or a Python-level rule: it lowers under XLA, Mosaic and Triton alike.
Math: docs/kda.md sections 'Gates' and 'Chunked form (WY/UT)'.
"""

from __future__ import annotations

import jax.numpy as jnp

CHUNK = 64  # rows per chunk: the block of the UT transform (C)
SUB = 16  # rows per diagonal sub-block of the score matrices (the smallest MXU / tensor-core tile)
SUB_SHIFT = 4  # log2(SUB): block index by shift (vector integer division is not lowered everywhere)
NEG_INF = float("-inf")
# epsilon inside the square root of the q/k L2 norm, as fla `l2norm` and transformers' Kimi-Linear
L2NORM_EPS = 1e-6

# Largest |exponent| a factored diagonal block may meet (`factored_diagonal`): exp(60) ~ 1e26 keeps every
# matmul operand (a factor times a q or k entry) finite; the products that are kept are bounded by
# |q_r| |k_i| whatever the factors.
MAX_FACTORED_EXPONENT = 60.0
# The steepest per-row log decay of a chunk that still takes the factored diagonal blocks when the gate
# has no static bound (the TPU kernel checks each chunk's rows at run time): factored_shift(-8) = 60,
# MAX_FACTORED_EXPONENT.
GENTLE_LOG_DECAY = -8.0


def activate_gate(raw, a_exp, dt_bias, lower_bound):
  """The gate activation of `gates.py` on a kernel tile, in float32: the softplus family, or the
  bounded (sigmoid) family when `lower_bound` is set.

  raw `[C, K]`; a_exp = exp(A_log[h]) and dt_bias as `[1, K]` rows (broadcastable).
  softplus(x) = max(x, 0) + log1p(exp(-|x|)) (the overflow-free form of log(1 + e^x)).
  """
  x = raw + dt_bias
  if lower_bound is None:
    return -a_exp * (jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x))))
  return lower_bound * (1.0 / (1.0 + jnp.exp(-(a_exp * x))))


def factored_shift(lower_bound) -> float:
  """d = (SUB - 1) / 2 * |lower_bound|: the reference G_first - d of a 16-row block sits half way down
  the steepest decay the bounded gate allows, so exp(G_r - ref) and exp(ref - G_i) of any rows r, i
  of the block lie in [exp(-d), exp(d)]."""
  return (SUB - 1) / 2 * abs(float(lower_bound))


def factored_diagonal(lower_bound) -> bool:
  """Whether the diagonal 16x16 score blocks may come from one matmul of two exponential factors:
  only for the bounded gate (every per-row log decay in [lower_bound, 0], a static bound known
  because the gate is activated in the kernel) with `factored_shift` <= MAX_FACTORED_EXPONENT.
  Unbounded gates (softplus, a raw log decay) have no bound, so their diagonal blocks keep one masked
  exponent per entry."""
  return lower_bound is not None and factored_shift(lower_bound) <= MAX_FACTORED_EXPONENT
