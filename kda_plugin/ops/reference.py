"""The KDA token recurrence: the definition every other path must equal.

Math (docs/kda.md section 'Token recurrence'; Kimi Linear tech report, arXiv 2510.26692, eq. for the gated
delta rule with per-channel decay; fla `ops/kda/naive.py`), per head, with state S in R^{K x V}:

    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)

evaluated in the order decay, predict, write, read. Everything runs in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kda_plugin.ops._contract import check_kda_inputs, default_scale


def delta_rule_step(state, q, k, v, g, beta):
  """One token of the KDA recurrence for every head.

  Args:
    state: float32 `[..., H, K, V]`, key-major.
    q: float32 `[..., H, K]`, already multiplied by the scale.
    k, g: float32 `[..., H, K]` (g is the log-space decay, <= 0).
    v: float32 `[..., H, V]`.
    beta: float32 `[..., H]`.

  Returns:
    (o `[..., H, V]`, new state `[..., H, K, V]`), both float32.
  """
  state = state * jnp.exp(g)[..., None]
  pred = jnp.einsum("...hkv,...hk->...hv", state, k, precision=lax.Precision.HIGHEST)
  delta = beta[..., None] * (v - pred)
  state = state + k[..., :, None] * delta[..., None, :]
  o = jnp.einsum("...hkv,...hk->...hv", state, q, precision=lax.Precision.HIGHEST)
  return o, state


def kda_reference(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                  segment_ids=None, max_num_segments=None):
  """KDA by the token recurrence (`lax.scan`, float32 state).

  Args:
    q, k: `[B, T, H, K]` float32 or bfloat16.
    v: `[B, T, H, V]`.
    g: `[B, T, H, K]` log-space decay (<= 0), already activated (see `kda_gate_softplus`).
    beta: `[B, T, H]` in [0, 1].
    scale: query scale, default K**-0.5.
    initial_state: float32 `[B, N, H, K, V]` with `segment_ids`, else `[B, H, K, V]`; zeros if None.
    output_final_state: also return the final state(s).
    segment_ids: int32 `[B, T]` or `[T]` (shared by every row); 0 = padding, label n uses slot n-1.
    max_num_segments: N, static; inferred from initial_state or concrete segment_ids when None.

  Returns:
    `(o, final_state)`: o `[B, T, H, V]` in q's dtype (exactly 0 on padding); final_state float32 in
    the layout of initial_state (an absent label keeps its initial state), or None.

  Raises:
    ValueError, TypeError: see `kda_plugin.ops._contract.check_kda_inputs`.
  """
  p = check_kda_inputs(q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids,
                       max_num_segments=max_num_segments, scale=scale)
  scale = default_scale(scale, p.key_dim)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  packed = p.segment_ids is not None
  n = p.num_segments if packed else 1
  seg = p.segment_ids if packed else jnp.ones((p.batch, p.seq_len), jnp.int32)
  if initial_state is None:
    h0 = jnp.zeros((p.batch, n, p.num_heads, p.key_dim, p.value_dim), jnp.float32)
  else:
    h0 = f32(initial_state) if packed else f32(initial_state)[:, None]

  def run_row(qr, kr, vr, gr, br, sr, h0r):
    def step(states, xs):
      qt, kt, vt, gt, bt, st = xs
      slot = jnp.maximum(st - 1, 0)
      o, new = delta_rule_step(states[slot], qt, kt, vt, gt, bt)
      valid = st > 0
      states = states.at[slot].set(jnp.where(valid, new, states[slot]))
      return states, jnp.where(valid, o, 0.0)

    return lax.scan(step, h0r, (qr, kr, vr, gr, br, sr))

  final, o = jax.vmap(run_row)(f32(q) * scale, f32(k), f32(v), f32(g), f32(beta), seg, h0)
  o = o.astype(jnp.asarray(q).dtype)
  if not output_final_state:
    return o, None
  return o, (final if packed else final[:, 0])
