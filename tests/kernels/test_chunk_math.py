"""The in-kernel chunk math (`_chunk_math`) against NumPy float64 written here.

`unit_lower_inverse` is checked alone against `np.linalg.inv` (also as the XLA training op batches it), and the chunk matrices of
`chunk_prep` (scores of both builders, masks, inverse) against the definitions of
docs/kda.md section 'Chunked form (WY/UT)' and docs/packing.md section 'Segment-native chunk algorithm',
computed entry by entry in float64.
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


def _chunked_op_inverse(form):
  """The XLA chunked op's batched inverse (kda_plugin/ops/chunked.py) in `form`, of I + a, on a batch."""
  from kda_plugin.ops.chunked import _unit_lower_inverse

  def inverse(a):
    lmat = jnp.eye(a.shape[0], dtype=a.dtype) + a
    return _unit_lower_inverse(jnp.stack([lmat, lmat]).reshape(2, 1, *a.shape), form)[1, 0]
  return jax.jit(inverse)


@pytest.mark.parametrize("vpu_block_shift", [1, 4, "loop", "doubling"],
                         ids=["mxu_doubling", "vpu_16_blocks", "chunked_op_loop", "chunked_op_doubling"])
@pytest.mark.parametrize("kind", ["uniform", "parallel_keys", "steep", "kda_random"])
def test_unit_lower_inverse_matches_float64(kind, vpu_block_shift):
  """Strictly-lower [64, 64] with |a| <= 1. `parallel_keys` (beta = 1, almost no decay, nearly
  equal keys) is the cancellation case: a power-series form loses ~3 digits there (errors ~5e-4).
  vpu_16_blocks: the 16-row diagonal blocks by forward substitution first (the TPU kernel's form).
  chunked_op_*: the XLA chunked op's batched forms (`kda_chunked`; loop on a CPU, doubling on a TPU)."""
  if isinstance(vpu_block_shift, str):
    inverse = _chunked_op_inverse(vpu_block_shift)
  else:
    inverse = _inverse if vpu_block_shift == 1 else jax.jit(
        lambda a: cm.unit_lower_inverses([a], vpu_block_shift=vpu_block_shift)[0])
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
    got = np.asarray(inverse(jnp.asarray(a)), np.float64)
    assert np.all(got[r < c] == 0.0), "the inverse must stay exactly lower-triangular"
    # float32 forward substitution reaches ~1e-6 of the largest entry here (|inv| up to ~7e3 for
    # "uniform", 1 for the others)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= 2e-6, f"{kind}: relative max error {err:.2e}"


@pytest.mark.parametrize("form", ["loop", "doubling"])
@pytest.mark.parametrize("kind", ["uniform", "parallel_keys", "kda_random"])
def test_unit_lower_inverse_derivative_is_the_inverse_s(kind, form):
  """The XLA chunked op's inverse is differentiated as the inverse (a custom JVP): reverse mode gives
  d sum(W * X) / dL = tril(-X^T W X^T, -1) in float64 (only L's strictly lower entries are read), and
  forward mode -X tril(dL, -1) X."""
  from kda_plugin.ops.chunked import _unit_lower_inverse
  rng = np.random.default_rng({"uniform": 5, "parallel_keys": 6, "kda_random": 7}[kind])
  if kind == "uniform":
    a = np.tril(rng.uniform(-1.0, 1.0, (C, C)), -1)
  elif kind == "parallel_keys":
    a = _kda_akk(rng, corr=0.97, decay=0.05, beta_one=True)
  else:
    a = _kda_akk(rng, corr=0.0, decay=0.6, beta_one=False)
  lmat = (np.eye(C) + a).astype(np.float32)
  w = rng.standard_normal((C, C))
  x = _inv64(lmat.astype(np.float64) - np.eye(C))
  want = np.tril(-x.T @ w @ x.T, -1)
  fn = lambda m: _unit_lower_inverse(m.reshape(1, C, C), form)[0]
  got = np.asarray(jax.jit(jax.grad(lambda m: jnp.sum(fn(m) * jnp.asarray(w, jnp.float32))))(lmat), np.float64)
  assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()
  dl = np.tril(rng.standard_normal((C, C)), -1).astype(np.float32)
  _, tangent = jax.jit(lambda m, d: jax.jvp(fn, (m,), (d,)))(lmat, dl)
  want_t = -x @ dl.astype(np.float64) @ x
  assert np.abs(np.asarray(tangent, np.float64) - want_t).max() <= 2e-6 * np.abs(want_t).max()
  if form == "doubling":  # the 10 products of the forward, then 2 for the backward (autodiff: 30 in all)
    grad_ir = str(jax.make_jaxpr(jax.grad(lambda m: jnp.sum(fn(m))))(lmat))
    assert grad_ir.count("dot_general") == 12, grad_ir.count("dot_general")


def test_unit_lower_inverse_refuses_non_power_of_two():
  with pytest.raises(ValueError, match="power of two"):
    cm.unit_lower_inverse(jnp.zeros((48, 48), jnp.float32))


def _chunk_oracle(q, k, g, beta, seg):
  """G, (I + Diag(beta) Akk)^-1 and Aqk of one chunk, float64, entry by entry (masked equations).
  G is each row's own document's inclusive cumulative gate (it restarts at every document's first
  row; 0 on padding rows)."""
  q, k, g, beta = (np.asarray(x, np.float64) for x in (q, k, g, beta))
  G = np.zeros_like(g)
  for r in range(C):
    if seg[r] != 0:
      G[r] = g[r] + (G[r - 1] if r > 0 and seg[r - 1] == seg[r] else 0.0)
  akk = np.zeros((C, C))
  aqk = np.zeros((C, C))
  for r in range(C):
    for i in range(r + 1):
      if seg[r] == 0 or seg[r] != seg[i]:
        continue
      dec = np.exp(G[r] - G[i])
      aqk[r, i] = np.sum(q[r] * k[i] * dec)
      if i < r:
        akk[r, i] = np.sum(k[r] * k[i] * dec)
  tinv = np.linalg.inv(np.eye(C) + beta[:, None] * akk)
  return G, tinv, aqk


def _seven_document_chunk(rng, kd):
  """One chunk holding seven documents (runs of length 1, padding, a boundary inside every 16-row
  block), with queries and unit-norm keys of width `kd`: `(seg [C] int32, q [C, kd], k [C, kd])`."""
  seg = np.zeros(C, np.int32)
  for label, a, b in [(3, 0, 5), (1, 5, 6), (4, 6, 7), (2, 7, 30), (6, 33, 50), (5, 50, 51),
                      (7, 51, 64)]:
    seg[a:b] = label
  q = rng.standard_normal((C, kd)) * 0.3
  k = rng.standard_normal((C, kd))
  k /= np.linalg.norm(k, axis=1, keepdims=True)
  return seg, q, k


@pytest.mark.parametrize("steep", [False, True], ids=["moderate", "steep"])
@pytest.mark.parametrize("blocked", [True, False], ids=["mosaic_blocked", "triton_unblocked"])
def test_chunk_prep_matches_float64(blocked, steep):
  """Both score builders give the same chunk matrices as the float64 definition, on a chunk with
  seven documents (runs of length 1, padding, a boundary inside every 16-row block) and, for
  `steep`, ~-20 nats per token (|G| ~ 1300 at row 63: any unbounded factor would overflow)."""
  rng = np.random.default_rng(7 if steep else 8)
  kd = 32
  seg, q, k = _seven_document_chunk(rng, kd)
  g = -rng.uniform(18.0, 22.0, (C, kd)) if steep else -rng.uniform(0.0, 0.6, (C, kd))
  g[seg == 0] = 0.0
  beta = rng.uniform(0.0, 1.0, C)
  beta[seg == 0] = 0.0
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  prep = jax.jit(lambda *a: cm.chunk_prep(*a, blocked=blocked))
  G, tinv, aqk = prep(f32(q), f32(k), f32(g), f32(beta[:, None]), jnp.asarray(seg[:, None]),
                      jnp.asarray(seg[None, :]))
  want_G, want_tinv, want_aqk = _chunk_oracle(q.astype(np.float32), k.astype(np.float32),
                                              g.astype(np.float32), beta.astype(np.float32), seg)
  for name, got in (("G", G), ("tinv", tinv), ("aqk", aqk)):
    assert np.all(np.isfinite(np.asarray(got))), name
  np.testing.assert_allclose(np.asarray(G), want_G, rtol=2e-6, atol=1e-5)
  np.testing.assert_allclose(np.asarray(tinv), want_tinv, rtol=0, atol=2e-6)
  np.testing.assert_allclose(np.asarray(aqk), want_aqk, rtol=0, atol=2e-6)


def test_factored_diagonal_chunk_prep_matches_float64():
  """The bounded gate's factored diagonal blocks and the VPU 16-block inverse (the TPU kernel's
  bfloat16 / float32 form with `lower_bound`) against the float64 definition, at the steepest decay
  the bound allows (every per-row log decay in [-5, 0], so |G| reaches ~320 over the chunk: only the
  factors within one 16-row block are ever formed), seven documents in the chunk."""
  rng = np.random.default_rng(9)
  kd = 32
  seg, q, k = _seven_document_chunk(rng, kd)
  g = -rng.uniform(0.0, 5.0, (C, kd))
  g[::5] = -5.0
  g[1::5] = 0.0
  g[seg == 0] = 0.0
  beta = rng.uniform(0.0, 1.0, C)
  beta[seg == 0] = 0.0
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  assert cm.factored_diagonal(-5.0) and not cm.factored_diagonal(None)
  prep = jax.jit(lambda *a: cm.chunk_prep(*a, blocked=True, lower_bound=-5.0, vpu_block_shift=4))
  G, tinv, aqk = prep(f32(q), f32(k), f32(g), f32(beta[:, None]), jnp.asarray(seg[:, None]),
                      jnp.asarray(seg[None, :]))
  want_G, want_tinv, want_aqk = _chunk_oracle(q.astype(np.float32), k.astype(np.float32),
                                              g.astype(np.float32), beta.astype(np.float32), seg)
  for name, got in (("G", G), ("tinv", tinv), ("aqk", aqk)):
    assert np.all(np.isfinite(np.asarray(got))), name
  np.testing.assert_allclose(np.asarray(tinv), want_tinv, rtol=0, atol=2e-6)
  np.testing.assert_allclose(np.asarray(aqk), want_aqk, rtol=0, atol=2e-6)


def test_cumsum_rows_split_is_float32_exact():
  """One bf16 product of three bf16 pieces of g gives the float32 cumulative sum (the TPU kernel's
  cumulative gate): within float32 rounding of the float64 sum, over gates of both families."""
  rng = np.random.default_rng(10)
  for g in (-rng.uniform(0.0, 5.0, (C, 256)), -rng.uniform(18.0, 22.0, (C, 128)),
            -np.exp(rng.uniform(-12.0, 2.0, (C, 128)))):
    g = g.astype(np.float32)
    got = np.asarray(jax.jit(cm.cumsum_rows_split)(jnp.asarray(g)), np.float64)
    want = np.cumsum(g.astype(np.float64), axis=0)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-5)


def test_block_row_picks_row_j_of_each_block():
  x = np.arange(C * 8, dtype=np.float32).reshape(C, 8)
  for j in (0, 5, 15):
    got = np.asarray(jax.jit(cm.block_row)(jnp.asarray(x), j))
    want = x[(np.arange(C) // 16) * 16 + j]
    np.testing.assert_array_equal(got, want)


def _count_ops(fn, *args):
  """(exp elements, {dot shape: count}) in fn's jaxpr, loop bodies times their trip counts."""
  from jax.extend import core as jcore  # noqa: PLC0415
  exps, dots = 0, {}

  def walk(jaxpr, mult):
    nonlocal exps
    for eqn in jaxpr.eqns:
      assert eqn.primitive.name != "while", "a loop without a static trip count"
      if eqn.primitive.name == "exp":
        exps += mult * eqn.outvars[0].aval.size
      if eqn.primitive.name == "dot_general":
        key = tuple(tuple(v.aval.shape) for v in eqn.invars)
        dots[key] = dots.get(key, 0) + mult
      inner = mult * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
      for p in eqn.params.values():
        for j in (p if isinstance(p, (list, tuple)) else [p]):
          if isinstance(j, (jcore.ClosedJaxpr, jcore.Jaxpr)):
            walk(getattr(j, "jaxpr", j), inner)

  walk(jax.make_jaxpr(fn)(*args).jaxpr, 1)
  return exps, dots


@pytest.mark.parametrize("blocked", [True, False], ids=["mosaic_blocked", "triton_unblocked"])
def test_chunk_prep_op_budget(blocked):
  """Per-chunk work of chunk_prep (C = 64, K = 128): 20 C*K exps (16 for the diagonal blocks, 4 for
  the blocks below), ONE score matmul [C,3K]x[2C,3K]^T (transposed once after: the C key rows
  stream through the 2C score columns) for every entry below the diagonal blocks of Akk and Aqk, the per-document cumulative gate's three products and 10 [C,C] matmuls for the
  inverse."""
  kd = 128
  x = jnp.zeros((C, kd), jnp.float32)
  exps, dots = _count_ops(lambda *a: cm.chunk_prep(*a, blocked=blocked), x, x, x,
                          jnp.zeros((C, 1)), jnp.zeros((C, 1), jnp.int32),
                          jnp.zeros((1, C), jnp.int32))
  assert exps == 20 * C * kd
  # the cumulative gate per document: three [C, C] x [C, K] products (bf16 pieces of g)
  assert dots == {((C, C), (C, kd)): 3, ((C, 3 * kd), (2 * C, 3 * kd)): 1, ((C, C), (C, C)): 10}
