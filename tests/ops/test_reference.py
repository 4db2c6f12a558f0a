"""`kda_reference` against the float64 NumPy token recurrence of tests/oracles.py (independent of the project).

The oracle follows docs/kda.md section 'Token recurrence' literally, token by token: decay the rows of the
state by exp(g), predict S^T k, write k (beta (v - prediction))^T, read S^T (scale q); padding rows
leave every state untouched and output 0; label n uses slot n - 1; absent labels keep their state.
"""

import numpy as np
import pytest

from kda_plugin.ops.reference import kda_reference
from tests.oracles import kda_recurrence_f64


def numpy_kda(q, k, v, g, beta, seg, h0, scale):
  """float64 oracle (the shared recurrence of tests/oracles.py). seg [B, T] (0 = padding); h0
  [B, N, H, K, V]. Returns (o [B,T,H,V], final)."""
  return kda_recurrence_f64(q, k, v, g, beta, seg, h0, scale)


def _inputs(rng, b, t, h, kd, vd, n):
  q = rng.normal(size=(b, t, h, kd))
  k = rng.normal(size=(b, t, h, kd))
  q /= np.linalg.norm(q, axis=-1, keepdims=True)
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.normal(size=(b, t, h, vd))
  g = -rng.uniform(0.0, 1.0, size=(b, t, h, kd))
  beta = rng.uniform(0.0, 1.0, size=(b, t, h))
  h0 = rng.normal(size=(b, n, h, kd, vd))
  f32 = lambda x: x.astype(np.float32)
  return f32(q), f32(k), f32(v), f32(g), f32(beta), f32(h0)


def _rel(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize("with_h0", [False, True])
def test_packed_matches_numpy(with_h0):
  rng = np.random.default_rng(0)
  b, t, h, kd, vd, n = 2, 40, 2, 8, 5, 4
  q, k, v, g, beta, h0 = _inputs(rng, b, t, h, kd, vd, n)
  seg = np.zeros((b, t), np.int32)
  seg[0, :7], seg[0, 7:8], seg[0, 8:30], seg[0, 33:] = 2, 1, 4, 3   # gap of padding, length-1 run
  seg[1, 3:25] = 1                                                 # leading/trailing padding, slots 2-4 empty
  init = h0 if with_h0 else None
  o, final = kda_reference(q, k, v, g, beta, segment_ids=seg, initial_state=init,
                           output_final_state=True)
  want_o, want_f = numpy_kda(q, k, v, g, beta, seg, h0 if with_h0 else np.zeros_like(h0), kd ** -0.5)
  assert _rel(o, want_o) <= 1e-6
  assert _rel(final, want_f) <= 1e-6
  assert np.all(np.asarray(o)[seg == 0] == 0)
  # Slots whose label never occurs keep their initial state exactly.
  np.testing.assert_array_equal(np.asarray(final)[1, 1:], (h0 if with_h0 else 0 * h0)[1, 1:])


@pytest.mark.parametrize("with_h0", [False, True])
def test_unpacked_matches_numpy(with_h0):
  rng = np.random.default_rng(1)
  b, t, h, kd, vd = 2, 33, 3, 6, 7
  q, k, v, g, beta, h0 = _inputs(rng, b, t, h, kd, vd, 1)
  scale = 0.37
  o, final = kda_reference(q, k, v, g, beta, scale=scale, initial_state=h0[:, 0] if with_h0 else None,
                           output_final_state=True)
  want_o, want_f = numpy_kda(q, k, v, g, beta, np.ones((b, t), np.int32),
                             h0 if with_h0 else np.zeros_like(h0), scale)
  assert final.shape == (b, h, kd, vd)
  assert _rel(o, want_o) <= 1e-6
  assert _rel(final, want_f[:, 0]) <= 1e-6


def test_no_final_state_and_dtype():
  rng = np.random.default_rng(2)
  q, k, v, g, beta, _ = _inputs(rng, 1, 5, 1, 4, 4, 1)
  o, final = kda_reference(q.astype(np.float16).astype(np.float32), k, v, g, beta)
  assert final is None and o.dtype == np.float32
