"""KDA gate activations (log-space decay g <= 0), beta, and the q/k L2 norm.

Two gate families exist in the wild (docs/kda.md section 'Gates'):
- Kimi's unbounded softplus gate (Kimi-Linear-48B; transformers `KimiDeltaAttention`, fla
  `fused_kda_gate`): `g = -exp(A_log[h]) * softplus(raw + dt_bias)`.
- The bounded sigmoid gate (tokamax `xla_chunked`, the tokamax-fork kernels):
  `g = lower_bound * sigmoid(exp(A_log[h]) * (raw + dt_bias))`, `-5 <= lower_bound < 0`.
Both are computed in float32 whatever the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kda_plugin.ops._chunk_common import L2NORM_EPS
from kda_plugin.ops._contract import LOWER_BOUND_RANGE, check_lower_bound  # noqa: F401  (re-exported)



def _gate_params(raw, a_log, dt_bias):
  raw = jnp.asarray(raw)
  if raw.ndim < 2:
    raise ValueError(f"raw gate input must have shape [..., H, K], got {raw.shape}")
  h, kd = raw.shape[-2:]
  if not jnp.issubdtype(raw.dtype, jnp.floating):
    raise TypeError(f"raw gate input must be floating, got dtype {raw.dtype}")
  a_log = jnp.asarray(a_log, jnp.float32)
  if a_log.size != h:
    raise ValueError(f"a_log must have H={h} values (shape [H]), got shape {a_log.shape}")
  a_log = a_log.reshape(h, 1)
  if dt_bias is None:
    dt_bias = jnp.zeros((h, kd), jnp.float32)
  dt_bias = jnp.asarray(dt_bias, jnp.float32)
  if dt_bias.size != h * kd:
    raise ValueError(f"dt_bias must have H*K={h * kd} values (shape [H*K] or [H, K]), got shape {dt_bias.shape}")
  return raw.astype(jnp.float32), a_log, dt_bias.reshape(h, kd)


def kda_gate_softplus(raw, a_log, dt_bias=None):
  """Kimi's softplus gate: `g = -exp(a_log[h]) * softplus(raw + dt_bias)` (float32, g <= 0).

  Source: transformers `models/kimi_linear` (`KimiDeltaAttention.forward`), fla `fused_kda_gate`.

  Args:
    raw: `[..., H, K]` gate pre-activation (`f_b_proj(f_a_proj(x))` in Kimi-Linear).
    a_log: `[H]` log of the per-head decay rate (checkpoint `A_log [1, 1, H, 1]` flattened).
    dt_bias: `[H*K]` or `[H, K]`, or None for zeros.

  Returns:
    float32 `[..., H, K]`, the log-space decay per channel (nats per token).

  Raises:
    ValueError, TypeError: shapes that do not match H and K, or a non-floating raw input.
  """
  raw, a_log, dt_bias = _gate_params(raw, a_log, dt_bias)
  return -jnp.exp(a_log) * jax.nn.softplus(raw + dt_bias)


def kda_gate_bounded(raw, a_log, dt_bias=None, *, lower_bound):
  """The bounded sigmoid gate: `g = lower_bound * sigmoid(exp(a_log[h]) * (raw + dt_bias))`.

  Source: tokamax 0.0.17 `ops/kda` (bounded gate of `xla_chunked`), docs/kda.md section 'Gates'.

  Args:
    raw: `[..., H, K]` gate pre-activation.
    a_log: `[H]`.
    dt_bias: `[H*K]` or `[H, K]`, or None for zeros.
    lower_bound: static float in [-5, 0): the most negative log decay per token.

  Returns:
    float32 `[..., H, K]` in [lower_bound, 0] (open in exact arithmetic; the sigmoid saturates in float32).

  Raises:
    ValueError: lower_bound out of range, or mismatched shapes.
  """
  lb = check_lower_bound(lower_bound)
  raw, a_log, dt_bias = _gate_params(raw, a_log, dt_bias)
  # sigmoid(x) = (1 + tanh(x / 2)) / 2: XLA CPU evaluates tanh faster than exp plus a division.
  half = 0.5 * lb
  return half + half * jnp.tanh((0.5 * jnp.exp(a_log)) * (raw + dt_bias))


def activate_gate(raw, a_log, dt_bias=None, lower_bound=None):
  """Dispatches to the bounded gate when `lower_bound` is given, else the softplus gate."""
  if lower_bound is None:
    return kda_gate_softplus(raw, a_log, dt_bias)
  return kda_gate_bounded(raw, a_log, dt_bias, lower_bound=lower_bound)


def l2norm(x, eps: float = L2NORM_EPS, axis: int = -1):
  """`x / sqrt(sum(x**2) + eps)` along `axis`, computed in float32, returned in x's dtype.

  The epsilon sits inside the square root as in fla `l2norm` and transformers' Kimi-Linear
  (docs/kda.md section 'Gates', step 1).
  """
  x = jnp.asarray(x)
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=axis, keepdims=True) + eps)).astype(x.dtype)
