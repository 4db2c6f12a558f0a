"""The float64 KDA oracle every test compares against: the token recurrence in NumPy.

Written from the recurrence of docs/kda.md (section 'Token recurrence') and the packing contract of
docs/packing.md (one state slot per document label), with its own gate activation and L2 norm. It
shares no code with `kda_plugin/` or `model/`: the ops tests (tests/ops, tests/kernels) and the
whole-model oracle (tests/model/oracle.py) all use this one copy.
"""

from __future__ import annotations

import numpy as np


def l2norm_f64(x):
  """`x / sqrt(sum(x^2) + 1e-6)` over the last axis, in float64 (the op's epsilon)."""
  x = np.asarray(x, np.float64)
  return x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)


def gate_f64(g_raw, a_log, dt_bias, lower_bound=None):
  """The activated gate of raw `g_raw [..., H, K]`: `-exp(A_log) * softplus(g_raw + dt_bias)`, or the
  bounded `lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias))` when `lower_bound` is set."""
  g_raw = np.asarray(g_raw, np.float64)
  h, kd = g_raw.shape[-2:]
  x = g_raw + np.asarray(dt_bias, np.float64).reshape(h, kd)
  rate = np.exp(np.asarray(a_log, np.float64))[:, None]
  if lower_bound is None:
    return -rate * np.logaddexp(0.0, x)
  return lower_bound / (1.0 + np.exp(-rate * x))


def kda_recurrence_f64(q, k, v, g, beta, segment_ids=None, initial_state=None, scale=None):
  """The KDA token recurrence per state slot, token by token (decay, predict, write, read).

  Args:
    q, k, g: `[B, T, H, K]` (g: log-decay, already activated); v: `[B, T, H, V]`; beta: `[B, T, H]`.
    segment_ids: int `[B, T]` or `[T]` (0 = padding: output 0, no state change; label n uses slot
      n-1), or None (one document per row, slot 0).
    initial_state: `[B, N, H, K, V]` (N = 1 without segment_ids), or None (zeros).
    scale: query scale, default `K ** -0.5`.

  Returns:
    `(o float64 [B, T, H, V], final states float64 [B, N, H, K, V])`.
  """
  q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  seg = np.ones((b, t), np.int64) if segment_ids is None else np.broadcast_to(np.asarray(segment_ids), (b, t))
  if initial_state is None:
    n = max(int(seg.max(initial=0)), 1)
    states = np.zeros((b, n, h, kd, vd))
  else:
    states = np.array(initial_state, np.float64)
  scale = kd ** -0.5 if scale is None else float(scale)
  o = np.zeros((b, t, h, vd))
  for r in range(b):
    for i in range(t):
      lab = int(seg[r, i])
      if lab == 0:
        continue
      s = states[r, lab - 1] * np.exp(g[r, i])[..., None]
      pred = np.einsum("hkv,hk->hv", s, k[r, i])
      s = s + k[r, i][..., None] * (beta[r, i][:, None] * (v[r, i] - pred))[:, None, :]
      o[r, i] = np.einsum("hkv,hk->hv", s, scale * q[r, i])
      states[r, lab - 1] = s
  return o, states
