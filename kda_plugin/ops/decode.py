"""Fused single-token KDA step for decode (one new token per sequence).

Implementations (`implementation=`):
- `pallas_tpu`: the Mosaic kernel (`kda_plugin.ops.decode_pallas_tpu`): one read and one write of
  the state, the HBM floor.
- `xla`: `_step` below, two passes over the state (XLA cannot fuse a reduction over the state with
  the update that consumes it).
- `auto` (default): by the target platform (`kda_plugin.ops.inference.target_platform`): tpu ->
  pallas_tpu, anything else -> xla. Nothing falls back silently: `pallas_tpu` off a TPU (without
  `interpret`) or beyond its VMEM plan raises and names the limit.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax import lax

from kda_plugin.ops._contract import check_kda_inputs, default_scale
from kda_plugin.ops import decode_pallas_tpu
from kda_plugin.ops.inference import target_platform

IMPLEMENTATIONS = ("auto", "pallas_tpu", "xla")


def resolve_implementation(implementation: str) -> str:
  """Maps `implementation` ("auto" included) to `pallas_tpu` or `xla`; ValueError for unknown names."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown implementation {implementation!r} for the decode step; expected one of "
                     f"{IMPLEMENTATIONS}")
  if implementation != "auto":
    return implementation
  return "pallas_tpu" if target_platform() == "tpu" else "xla"


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


def _step_tpu(state, q, k, v, g, beta, *, scale, interpret):
  """`_step` by the Mosaic kernel, on the caller's arrays as they are (it converts them itself)."""
  platform = target_platform()
  if not interpret and platform != "tpu":
    raise RuntimeError(f"implementation 'pallas_tpu' of the decode step needs a TPU, but the target "
                       f"platform is {platform!r}; pass interpret=True to simulate the kernel, or use "
                       "implementation='xla'")
  return decode_pallas_tpu.decode_step_tpu(state, q, k, v, g, beta.astype(jnp.float32), scale=scale,
                                           interpret=interpret)


def kda_decode_step(q, k, v, g, beta, state, *, scale=None, implementation="auto", interpret=False):
  """Advances each sequence's KDA state by one token and reads it.

  Same math as one step of `kda_reference` (docs/kda.md section 'Token recurrence').

  Args:
    q, k, g: `[B, H, K]` (or `[B, 1, H, K]`); g is the activated log-space decay (<= 0).
    v: `[B, H, V]` (or `[B, 1, H, V]`).
    beta: `[B, H]` (or `[B, 1, H]`) in [0, 1].
    state: float32 `[B, H, K, V]`, the state after the previous token.
    scale: query scale, default K**-0.5.
    implementation: "auto" (default), "pallas_tpu" or "xla" (module docstring).
    interpret: run `pallas_tpu` in Pallas interpret mode (any platform; for tests).

  Returns:
    `(o, new_state)`: o `[B, H, V]` (or `[B, 1, H, V]`, following q) in q's dtype; new_state float32
    `[B, H, K, V]`. With `pallas_tpu` the new state is written over the state's buffer: donate the
    state (`jax.jit(..., donate_argnums=...)`) or carry it in a loop, else XLA copies it first.

  Raises:
    ValueError, TypeError: bad shapes or dtypes, beta outside [0, 1], g > 0 (when concrete), a
      state that is not `[B, H, K, V]`, an unknown implementation, or a shape beyond the
      `pallas_tpu` kernel's VMEM plan.
    RuntimeError: `pallas_tpu` requested for a platform other than a TPU, without `interpret`.
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
  if resolve_implementation(implementation) == "pallas_tpu":
    o, new_state = _step_tpu(f32(state), qt[:, 0], kt[:, 0], vt[:, 0], gt[:, 0], bt[:, 0], scale=scale,
                             interpret=interpret)
  else:
    o, new_state = _step(f32(state), f32(qt[:, 0]) * scale, f32(kt[:, 0]), f32(vt[:, 0]), f32(gt[:, 0]),
                         f32(bt[:, 0]))
  o = o.astype(q.dtype)
  return (o[:, None] if with_time else o), new_state
