"""Fused single-token KDA step for decode (one new token per sequence)."""

from __future__ import annotations

import jax.numpy as jnp

from kda_plugin.ops._contract import check_kda_inputs, default_scale
from kda_plugin.ops.reference import delta_rule_step


def kda_decode_step(q, k, v, g, beta, state, *, scale=None):
  """Advances each sequence's KDA state by one token and reads it.

  Same math as one step of `kda_reference` (docs/kda.md section 'Token recurrence').

  Args:
    q, k, g: `[B, H, K]` (or `[B, 1, H, K]`); g is the activated log-space decay (<= 0).
    v: `[B, H, V]` (or `[B, 1, H, V]`).
    beta: `[B, H]` (or `[B, 1, H]`) in [0, 1].
    state: float32 `[B, H, K, V]`, the state after the previous token.
    scale: query scale, default K**-0.5.

  Returns:
    `(o, new_state)`: o `[B, H, V]` (or `[B, 1, H, V]`, following q) in q's dtype; new_state float32
    `[B, H, K, V]`.

  Raises:
    ValueError, TypeError: bad shapes or dtypes, beta outside [0, 1], g > 0 (when concrete), or a
      state that is not `[B, H, K, V]`.
  """
  if state is None:
    raise ValueError("state is required for a decode step: pass the [B, H, K, V] float32 cache "
                     "(zeros for a fresh sequence)")
  q, k, v, g, beta = (jnp.asarray(x) for x in (q, k, v, g, beta))
  with_time = q.ndim == 4
  if with_time:
    if q.shape[1] != 1:
      raise ValueError(f"kda_decode_step takes one token per sequence; q has T={q.shape[1]}")
    add_t = lambda x: x
  else:
    add_t = lambda x: x[:, None]
  qt, kt, vt, gt, bt = (add_t(x) for x in (q, k, v, g, beta))
  p = check_kda_inputs(qt, kt, vt, gt, bt, initial_state=state, scale=scale)
  scale = default_scale(scale, p.key_dim)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  o, new_state = delta_rule_step(f32(state), f32(qt[:, 0]) * scale, f32(kt[:, 0]), f32(vt[:, 0]),
                                 f32(gt[:, 0]), f32(bt[:, 0]))
  o = o.astype(q.dtype)
  return (o[:, None] if with_time else o), new_state
