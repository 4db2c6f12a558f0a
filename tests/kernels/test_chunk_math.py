"""The in-kernel chunk math (`_chunk_math`) against NumPy float64 written here.

`unit_lower_inverse` is checked alone against `np.linalg.inv`, and the chunk matrices of
`chunk_prep` (scores of both builders, masks, inverse) against the definitions of
../shared/docs/kda.md section 2 and segment_native_chunk.md computed entry by entry in float64.
The functions are plain jnp code, so they run here outside any kernel (float32, HIGHEST matmuls).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_plugin.ops import _chunk_math as cm

C = 64


def _inv64(a):
  return np.linalg.inv(np.eye(a.shape[0]) + np.asarray(a, np.float64))


_inverse = jax.jit(cm.unit_lower_inverse)


def _kda_akk(rng, *, corr, decay, beta_one):
  """beta * Akk of one chunk (one document) in float64, keys drawn around a common direction
  (corr -> 1: nearly parallel keys) with per-token decay up to `decay` nats."""
  kd = 16
  base = rng.standard_normal(kd)
  k = corr * base + (1.0 - corr) * 3.0 * rng.standard_normal((C, kd))
  k /= np.linalg.norm(k, axis=1, keepdims=True)
  G = np.cumsum(-rng.uniform(0.0, decay, (C, kd)), axis=0)
  diff = np.minimum(G[:, None, :] - G[None, :, :], 0.0)
  akk = np.tril(np.einsum("rd,id,rid->ri", k, k, np.exp(diff)), -1)
  beta = np.ones(C) if beta_one else rng.uniform(0.0, 1.0, C)
  return beta[:, None] * akk


@pytest.mark.parametrize("kind", ["uniform", "parallel_keys", "steep", "kda_random"])
def test_unit_lower_inverse_matches_float64(kind):
  """Strictly-lower [64, 64] with |a| <= 1. `parallel_keys` (beta = 1, almost no decay, nearly
  equal keys) is the cancellation case: a power-series form loses ~3 digits there (errors ~5e-4)."""
  rng = np.random.default_rng({"uniform": 1, "parallel_keys": 2, "steep": 3, "kda_random": 4}[kind])
  r, c = np.indices((C, C))
  for _ in range(5):
    if kind == "uniform":
      a = np.tril(rng.uniform(-1.0, 1.0, (C, C)), -1)
    elif kind == "parallel_keys":
      a = _kda_akk(rng, corr=0.97, decay=0.05, beta_one=True)
    elif kind == "steep":  # entries fall by e^-3 per row of distance, signs mixed
      a = np.tril(np.exp(-3.0 * np.maximum(r - c - 1, 0)) * rng.uniform(-1.0, 1.0, (C, C)), -1)
    else:
      a = _kda_akk(rng, corr=0.0, decay=0.6, beta_one=False)
    a = a.astype(np.float32)
    assert np.abs(a).max() <= 1.0
    want = _inv64(a)
    got = np.asarray(_inverse(jnp.asarray(a)), np.float64)
    assert np.all(got[r < c] == 0.0), "the inverse must stay exactly lower-triangular"
    # float32 forward substitution reaches ~1e-6 of the largest entry here (|inv| up to ~7e3 for
    # "uniform", 1 for the others)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= 2e-6, f"{kind}: relative max error {err:.2e}"


def test_unit_lower_inverse_refuses_non_power_of_two():
  with pytest.raises(ValueError, match="power of two"):
    cm.unit_lower_inverse(jnp.zeros((48, 48), jnp.float32))
