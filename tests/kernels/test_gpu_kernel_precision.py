"""Why the GPU kernels run float32 inputs with TF32x3 matmuls and bfloat16 inputs with one TF32 pass.

Interpret mode emulates the tensor cores' TF32 operand rounding (`_gpu_chunk_math.Dots(emulate=True)`),
so these errors are the device's, up to the order of float32 accumulation. Against the float64 token
recurrence: a single TF32 pass on float32 inputs misses the 1e-4 float32 tolerance; TF32x3 meets it
with a wide margin. (bfloat16 inputs meet their 5e-3 relative tolerance with one pass:
test_inference_numerics.py, case b3_packed_bounded_bf16.)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kda_plugin.ops import _gpu_chunk_math as gm
from kda_plugin.ops.pallas_gpu import kda_inference_gpu
from tests.kernels._cases import PACKED, Case, make_inputs, oracle

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def _max_error(passes):
  case = Case("packed_h0", PACKED, num_segments=10, gate="softplus", l2norm=True)
  x = make_inputs(case, seed=1)
  ref_o, ref_s = oracle(x["q"], x["k"], x["v"], x["g"], x["beta"], case.seg, x["h0"], 16 ** -0.5,
                        a_log=x["a_log"], dt_bias=x["dt_bias"], l2norm=True)
  gate = (jnp.asarray(x["a_log"], jnp.float32), jnp.asarray(x["dt_bias"], jnp.float32).reshape(2, 16))
  seg = jnp.broadcast_to(jnp.asarray(case.seg), (1, case.seg.shape[0]))
  o, s = kda_inference_gpu(*(jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")), seg,
                           jnp.asarray(x["h0"]), gate, num_segments=10, scale=16 ** -0.5,
                           lower_bound=None, use_l2norm=True, want_final=True, interpret=True,
                           dots=gm.Dots(passes=passes, emulate=True))
  return max(np.abs(np.asarray(o) - ref_o).max(), np.abs(np.asarray(s) - ref_s).max())


def test_float32_needs_tf32x3():
  one_pass, three_pass = _max_error(1), _max_error(3)
  assert one_pass > 1e-4, f"one TF32 pass already meets the float32 tolerance ({one_pass:.1e})"
  assert three_pass <= 1e-5, three_pass


def _scores_inputs(lower_bound, seed=0):
  """One 64-row chunk of K = 32 channels: unnormalised q, k (entries ~N(0, 1)) and the cumulative
  bounded gate, some channels at the steepest decay `lower_bound` on every row (the largest factors
  the factored diagonal blocks meet: exp(8 |lower_bound|))."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((gm.CHUNK, 32)).astype(np.float32)
  k = rng.standard_normal((gm.CHUNK, 32)).astype(np.float32)
  g = lower_bound * rng.uniform(0.0, 1.0, (gm.CHUNK, 32))
  g[:, :4] = lower_bound
  return q, k, np.cumsum(g, axis=0).astype(np.float32)


def _scores_float64(q, k, G):
  """Akk, Aqk in float64 from the definition, lower triangle (i <= r) only."""
  decay = np.exp(G.astype(np.float64)[:, None, :] - G.astype(np.float64)[None, :, :])  # [r, i, d]
  akk = np.einsum("rd,id,rid->ri", k, k, decay)
  aqk = np.einsum("rd,id,rid->ri", q, k, decay)
  low = np.tril(np.ones((gm.CHUNK, gm.CHUNK), bool))
  return np.where(low, akk, 0.0), np.where(low, aqk, 0.0), low


@pytest.mark.parametrize("passes,tol", [(3, 1e-6), (1, 3e-3)])
def test_factored_diagonal_blocks_match_float64(passes, tol):
  """The tensor-core diagonal blocks of the bounded gate (exp(G_r - G_i) split around a shifted
  reference at the blocks' first rows) equal the float64 scores at the steepest decay the gate allows, and agree with the
  masked elementwise blocks: TF32x3 to float32 accuracy, one TF32 pass to TF32 accuracy (the
  largest entries are ~|k|^2 K ~ 100, so the bounds are relative to that scale)."""
  lb = -5.0
  assert gm.factored_diagonal(lb)
  q, k, G = _scores_inputs(lb)
  want_kk, want_qk, low = _scores_float64(q, k, G)
  dots = gm.Dots(passes=passes, emulate=True)
  got = {f: gm.chunk_scores(jnp.asarray(q), jnp.asarray(k), jnp.asarray(G), dots,
                            lower_bound=lb if f else None) for f in (True, False)}
  for f, (akk, aqk) in got.items():
    for a, want in ((akk, want_kk), (aqk, want_qk)):
      a = np.where(low, np.asarray(a, np.float64), 0.0)
      assert np.all(np.isfinite(a)), f"factored={f}: non-finite scores"
      err = np.abs(a - want).max() / np.abs(want).max()
      assert err <= tol, f"factored={f} passes={passes}: relative error {err:.1e} > {tol}"


def test_factored_diagonal_only_for_a_bounded_gate():
  assert not gm.factored_diagonal(None)  # softplus gate or a raw log decay: no bound on exp's argument
  assert gm.factored_diagonal(-5.0)  # the steepest bounded gate kda_inference accepts
  assert gm.factored_diagonal(-8.0)  # 7.5 x 8 = 60 = MAX_FACTORED_EXPONENT
  assert not gm.factored_diagonal(-9.0)  # 7.5 x 9 = 67.5 > MAX_FACTORED_EXPONENT


@pytest.mark.parametrize("passes", [1, 3])
def test_factored_diagonal_scores_do_not_read_later_gates(passes):
  """Changing the gates of rows >= 40 (inside the diagonal block of rows 32..47) leaves every causal
  score (i <= r) of rows r < 40 bit for bit unchanged: the blocks' reference is their first row, so no rounding depends
  on a later token's gate (a middle-row reference, row 40, would leak it at rounding level)."""
  lb = -5.0
  q, k, G = _scores_inputs(lb)
  g = np.diff(G, axis=0, prepend=0.0)
  g[40:] = lb * np.random.default_rng(7).uniform(0.0, 1.0, g[40:].shape)
  G2 = np.cumsum(g, axis=0).astype(np.float32)
  G2[:40] = G[:40]
  dots = gm.Dots(passes=passes, emulate=True)
  before = gm.chunk_scores(jnp.asarray(q), jnp.asarray(k), jnp.asarray(G), dots, lower_bound=lb)
  after = gm.chunk_scores(jnp.asarray(q), jnp.asarray(k), jnp.asarray(G2), dots, lower_bound=lb)
  low = np.tril(np.ones((gm.CHUNK, gm.CHUNK), bool))[:40]
  for a, b in zip(before, after):
    np.testing.assert_array_equal(np.asarray(a)[:40][low], np.asarray(b)[:40][low])
    assert not np.array_equal(np.asarray(a)[40:], np.asarray(b)[40:])
