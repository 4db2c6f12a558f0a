"""Fused single-token KDA step for decode (one new token per sequence)."""

from __future__ import annotations

import jax.numpy as jnp

from jax import lax

from kda_plugin.ops._contract import check_kda_inputs, default_scale


def _step(state, q, k, v, g, beta):
  """One token of the recurrence (`reference.delta_rule_step`'s math) arranged to pass over the
  `[..., H, K, V]` state twice instead of five times (decode reads every slot's state each step, so
  it is bound by those passes, not by FLOPs):

      a = exp(g);  [k a; q a]^T S  in one product  ->  pred = (k a)^T S,  qS = (q a)^T S
      delta = beta (v - pred);  S' = Diag(a) S + k delta^T;  o = q^T S' = qS + (q . k) delta

  Equal to the reference step up to float32 rounding (tests/ops/test_gates_conv.py)."""
  a = jnp.exp(g)
  both = jnp.einsum("...hkv,...hjk->...hjv", state, jnp.stack([k * a, q * a], axis=-2),
                    precision=lax.Precision.HIGHEST)
  pred, qs = both[..., 0, :], both[..., 1, :]
  delta = beta[..., None] * (v - pred)
  new_state = a[..., None] * state + k[..., :, None] * delta[..., None, :]
  o = qs + jnp.sum(q * k, axis=-1, keepdims=True) * delta
  return o, new_state


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
  o, new_state = _step(f32(state), f32(qt[:, 0]) * scale, f32(kt[:, 0]), f32(vt[:, 0]), f32(gt[:, 0]),
                       f32(bt[:, 0]))
  o = o.astype(q.dtype)
  return (o[:, None] if with_time else o), new_state
