"""In-kernel math of one 64-row chunk holding any number of documents (Pallas TPU and GPU).

Everything here operates on values already loaded from refs (2-D arrays, float32) and is written for
both Mosaic and Triton: predicates are built at full rank from `broadcasted_iota`, rows are selected
with masked reductions instead of dynamic slicing, and every exponent is masked to -inf *before*
`exp` so that no factor can overflow. Math: docs/kda.md section 'Chunked form (WY/UT)' and
docs/packing.md section 'Segment-native chunk algorithm' (the masked equations).

Notation (one head, one chunk of C rows): `G` is the inclusive cumulative gate over the whole chunk
(g = 0 on padding rows), `same[r, i]` says rows r and i hold the same document.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

SUB = 16  # rows per sub-block: the diagonal sub-blocks of the score matrices are built elementwise
_SUB_SHIFT = 4  # log2(SUB): block index by shift (vector integer division is not lowered everywhere)
NEG_INF = float("-inf")
L2NORM_EPS = 1e-6
_HI = lax.Precision.HIGHEST



class KernelRefs(NamedTuple):
  """The operand refs both Pallas kernels receive, in `inference.py`'s operand order."""

  q: object
  k: object
  v: object
  g: object
  beta: object
  seg_col: object
  seg_row: object
  a_exp: object  # exp(A_log) per head, with the in-kernel gate only
  dt_bias: object  # with the in-kernel gate only
  h0: object  # per-slot initial states, when given
  o: object
  final: object  # per-slot final states, when requested
  rest: tuple  # the kernel's own scratch refs


def unpack_refs(refs, *, gate: bool, has_h0: bool, want_final: bool) -> KernelRefs:
  """Splits a kernel's positional refs (inputs, outputs, scratch) by the options that add operands."""
  it = iter(refs)
  q, k, v, g, beta, seg_col, seg_row = (next(it) for _ in range(7))
  a_exp, dt_bias = (next(it), next(it)) if gate else (None, None)
  h0 = next(it) if has_h0 else None
  if want_final and not has_h0:
    next(it)  # the zeros aliased to the final states: never read
  o = next(it)
  final = next(it) if want_final else None
  return KernelRefs(q, k, v, g, beta, seg_col, seg_row, a_exp, dt_bias, h0, o, final, tuple(it))

class Dots(NamedTuple):
  """The matmul precision of one call: float32 at HIGHEST (six bf16 MXU passes), or bf16 operands
  with float32 accumulation (one pass; `bf16=True`). The operands are cast explicitly, so interpret
  mode on a CPU rounds them exactly as the MXU does and the numerics tests see the device's error."""

  bf16: bool = False

  def _mm(self, a, b, dims):
    dn = (dims, ((), ()))
    if self.bf16:
      return lax.dot_general(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), dn,
                             preferred_element_type=jnp.float32)
    return lax.dot_general(a, b, dn, precision=(_HI, _HI), preferred_element_type=jnp.float32)

  def nn(self, a, b):
    """a @ b."""
    return self._mm(a, b, ((1,), (0,)))

  def nt(self, a, b):
    """a @ b.T."""
    return self._mm(a, b, ((1,), (1,)))

  def tn(self, a, b):
    """a.T @ b."""
    return self._mm(a, b, ((0,), (0,)))


F32 = Dots(bf16=False)


def iota(shape, dim):
  return lax.broadcasted_iota(jnp.int32, shape, dim)


def dot(a, b):
  """a @ b in float32."""
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=(_HI, _HI),
                         preferred_element_type=jnp.float32)


def dot_nt(a, b):
  """a @ b.T in float32."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=(_HI, _HI),
                         preferred_element_type=jnp.float32)


def dot_tn(a, b):
  """a.T @ b in float32."""
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=(_HI, _HI),
                         preferred_element_type=jnp.float32)


def row_at(x, idx):
  """Row `idx` of `x [R, D]` as `[1, D]` (zeros when no row matches, e.g. idx = -1)."""
  return jnp.sum(jnp.where(iota(x.shape, 0) == idx, x, 0.0), axis=0, keepdims=True)


def row_to_col(x):
  """`[1, n] -> [n, 1]` without a transpose op: a masked lane reduction against the identity."""
  n = x.shape[1]
  eye = iota((n, n), 0) == iota((n, n), 1)
  return jnp.sum(jnp.where(eye, jnp.broadcast_to(x, (n, n)), 0.0), axis=1, keepdims=True)


def col_to_row(x):
  """`[n, 1] -> [1, n]` without a transpose op: a masked sublane reduction against the identity."""
  n = x.shape[0]
  eye = iota((n, n), 0) == iota((n, n), 1)
  return jnp.sum(jnp.where(eye, jnp.broadcast_to(x, (n, n)), 0.0), axis=0, keepdims=True)


def activate_gate(raw, a_exp, dt_bias, lower_bound):
  """Gate activation of gates.py, in float32: softplus family, or bounded when `lower_bound` is set.

  raw `[C, K]`; a_exp = exp(A_log[h]) and dt_bias as `[1, K]` rows.
  softplus(x) = max(x, 0) + log1p(exp(-|x|)) (the overflow-free form of log(1 + e^x)).
  """
  x = raw + dt_bias
  if lower_bound is None:
    return -a_exp * (jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x))))
  return lower_bound * (1.0 / (1.0 + jnp.exp(-(a_exp * x))))


def l2norm_rows(x):
  """x / sqrt(sum x^2 + 1e-6) per row (eps inside the square root, as gates.l2norm)."""
  return x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2NORM_EPS)


def cumsum_rows(g):
  """Inclusive cumulative sum down the rows, as a lower-triangular matmul (no scan in the kernel)."""
  c = g.shape[0]
  tril = (iota((c, c), 1) <= iota((c, c), 0)).astype(jnp.float32)
  return dot(tril, g)


def _diag_scores(qb, kb, gb, row0, c):
  """Elementwise scores of one diagonal row block: rows row0..row0+R-1 against the same columns.

  Returns `(akk, aqk)` `[R, C]`; entry (r, i) = sum_d {k,q}_r[d] k_i[d] exp(G_r[d] - G_i[d]) for
  columns i in the block with i <= r, exact (one exponent per entry, masked before exp).
  """
  r_, d = gb.shape
  rows = iota((r_, d), 0) + row0
  cols = iota((r_, c), 1)

  def body(j, carry):
    akk, aqk = carry
    i = row0 + j
    e = jnp.exp(jnp.where(rows >= i, gb - row_at(gb, j), NEG_INF)) * row_at(kb, j)
    akk = jnp.where(cols == i, jnp.sum(e * kb, axis=1, keepdims=True), akk)
    aqk = jnp.where(cols == i, jnp.sum(e * qb, axis=1, keepdims=True), aqk)
    return akk, aqk

  zero = jnp.zeros((r_, c), jnp.float32)
  return lax.fori_loop(0, r_, body, (zero, zero))


def block_row(x, j):
  """`[C, D] -> [C, D]` whose row r is row `SUB * (r // SUB) + j` of `x` (row j of r's own block).

  A masked reduction over the `[C / SUB, SUB, D]` view, broadcast back over each block: one select
  and one add per element, exact (a single non-zero term), no gather and no value slicing.
  """
  c, d = x.shape
  x3 = x.reshape(c // SUB, SUB, d)
  pick = lax.broadcasted_iota(jnp.int32, x3.shape, 1) == j
  sel = jnp.sum(jnp.where(pick, x3, 0.0), axis=1, keepdims=True)
  return jnp.broadcast_to(sel, x3.shape).reshape(c, d)


def _diag_scores_all_blocks(q, k, G):
  """Elementwise scores of all diagonal 16x16 blocks at once, `(akk, aqk)` `[C, C]` (Triton path).

  Iteration j (SUB iterations) fills, for every row r, the column i(r) = SUB * (r // SUB) + j of
  r's own block: one exponent per (row, channel), masked to -inf before `exp` where i(r) > r, so
  every exponent is G_r - G_i <= 0 (exact, no factor that can overflow). Entries outside the
  diagonal blocks are 0.
  """
  c, d = G.shape
  rows = iota((c, d), 0)
  first = jnp.left_shift(jnp.right_shift(rows, _SUB_SHIFT), _SUB_SHIFT)  # first row of r's block
  cols = iota((c, c), 1)
  col_first = jnp.left_shift(jnp.right_shift(iota((c, c), 0), _SUB_SHIFT), _SUB_SHIFT)

  def body(j, carry):
    akk, aqk = carry
    e = jnp.exp(jnp.where(first + j <= rows, G - block_row(G, j), NEG_INF)) * block_row(k, j)
    hit = cols == col_first + j
    akk = jnp.where(hit, jnp.sum(e * k, axis=1, keepdims=True), akk)
    aqk = jnp.where(hit, jnp.sum(e * q, axis=1, keepdims=True), aqk)
    return akk, aqk

  zero = jnp.zeros((c, c), jnp.float32)
  return lax.fori_loop(0, SUB, body, (zero, zero))


def _below_diag_scores(q, k, G, dots=F32):
  """Scores of every entry below the diagonal 16x16 blocks, `(akk, aqk)` `[C, C]`, in ONE matmul.

  Column block `blk` against all rows below it, factored around the block's last row `p`:
  exp(G_r - G_p) exp(G_p - G_i) with i <= p < r, so both factors are <= 1 and neither can
  overflow (an underflowed factor only hides a product that is smaller still). The C/16 - 1 column
  blocks are stacked along the contraction (their key rows are disjoint, so the sum over the
  stacked channels is the sum over blocks) and the k and q rows along M: one `[2C, (C/16-1) K] x
  [C, (C/16-1) K]^T` product, one MXU round trip instead of 2 (C/16 - 1) (tools/tpu_cost.py: the
  step's chain is a sum of MXU round trips). Only masks and aligned concatenations: Mosaic and Triton.
  """
  c = G.shape[0]
  rows = iota(G.shape, 0)
  # exp(G_p - G_i) for every row i against the last row p of its own block: one exponent per
  # (row, channel), shared by all column blocks (each one uses only its own rows)
  k_inside = k * jnp.exp(block_row(G, SUB - 1) - G)
  k_parts, q_parts, key_parts = [], [], []
  for blk in range(c // SUB - 1):
    p = blk * SUB + SUB - 1
    below = jnp.exp(jnp.where(rows > p, G - row_at(G, p), NEG_INF))
    k_parts.append(k * below)
    q_parts.append(q * below)
    key_parts.append(jnp.where((rows >= blk * SUB) & (rows <= p), k_inside, 0.0))
  lhs = jnp.concatenate([jnp.concatenate(k_parts, axis=1), jnp.concatenate(q_parts, axis=1)], axis=0)
  both = dots.nt(lhs, jnp.concatenate(key_parts, axis=1))
  return both[:c], both[c:]


def intra_chunk_scores(q, k, G, *, blocked: bool, dots=F32):
  """`Akk` and `Aqk` of the chunk before segment/causal masking (entries with r >= i are valid).

  Args: q, k, G float32 `[C, K]` (C a multiple of 16). Returns `(akk, aqk)` float32 `[C, C]`.
  Entries strictly below the diagonal 16x16 blocks come from matmuls (`_below_diag_scores`); the
  diagonal blocks are exact elementwise sums with one masked exponent per entry. blocked=True
  (Mosaic) builds each diagonal block from its own 16-row slice; blocked=False (Triton, no value
  slicing) builds all diagonal blocks together in 16 masked iterations (`_diag_scores_all_blocks`).
  Math: docs/kda.md section 'Chunked form (WY/UT)' and docs/packing.md section 'Segment-native chunk algorithm'.
  """
  c = G.shape[0]
  if not blocked:
    akk, aqk = _diag_scores_all_blocks(q, k, G)
  else:
    nb = c // SUB
    diag = [_diag_scores(q[i * SUB:(i + 1) * SUB], k[i * SUB:(i + 1) * SUB],
                         G[i * SUB:(i + 1) * SUB], i * SUB, c) for i in range(nb)]
    akk = jnp.concatenate([a for a, _ in diag], axis=0)
    aqk = jnp.concatenate([a for _, a in diag], axis=0)
  below_kk, below_qk = _below_diag_scores(q, k, G, dots)
  return akk + below_kk, aqk + below_qk


def unit_lower_inverse(a):
  """(I + a)^-1 for a strictly lower-triangular float32 `a [C, C]` (C a power of two), `[C, C]`.

  Recursive block inversion, all blocks of one size at once with iota masks (no slicing): with X
  the inverse of the diagonal b x b blocks, the inverse of each 2b x 2b diagonal block
  [[T1, 0], [L, T2]] is [[X1, 0], [-X2 L X1, X2]], i.e. X <- X - X (L X) with L = `a` masked to the
  lower-left b x b quadrant of each 2b-block. The 1 -> 2 step needs no matmul (X = I - L), then
  two C x C matmuls per doubling: 2 (log2 C - 1) matmuls in total, serial depth the same
  (10 for C = 64). This is forward substitution regrouped (no power series: the truncated Neumann
  product (I - A)(I + A^2)(I + A^4)... forms powers of A whose entries reach C(15, 7) ~ 6e3 and
  cancel, losing ~3 digits in float32 for nearly parallel keys); its rounding matches it.
  """
  return unit_lower_inverses([a])[0]


def unit_lower_inverses(mats, dots=F32):
  """`unit_lower_inverse` of several independent matrices, level by level: each doubling issues its
  matmul for every matrix before the next one, so their MXU latencies overlap (a step's heads:
  one dependent chain of 10 matmuls instead of 10 per head; tools/tpu_cost.py follows the chain)."""
  c = mats[0].shape[0]
  if c & (c - 1) or any(a.shape != (c, c) for a in mats):
    raise ValueError("unit_lower_inverse: a must be [C, C] with C a power of two, got "
                     f"{[a.shape for a in mats]}")
  r = iota((c, c), 0)
  col = iota((c, c), 1)
  eye = (r == col).astype(jnp.float32)
  pair = (jnp.right_shift(r, 1) == jnp.right_shift(col, 1)) & (r > col)
  xs = [eye - jnp.where(pair, a, 0.0) for a in mats]
  shift = 1
  while (1 << shift) < c:
    quad = ((jnp.right_shift(r, shift + 1) == jnp.right_shift(col, shift + 1))
            & (jnp.right_shift(r, shift) != jnp.right_shift(col, shift)))
    ys = [dots.nn(jnp.where(quad, a, 0.0), x) for a, x in zip(mats, xs)]
    xs = [x - dots.nn(x, y) for x, y in zip(xs, ys)]
    shift += 1
  return xs


def chunk_prep(q, k, g, beta, seg_col, seg_row, *, blocked: bool, cumulative: bool = False,
               dots=F32):
  """The chunk-wide matrices that do not depend on the incoming states.

  Args:
    q: float32 `[C, K]`, already normalised and scaled. k: float32 `[C, K]`.
    g: float32 `[C, K]` activated gate, 0 on padding rows (with `cumulative`, already its
      inclusive cumulative sum G: the TPU kernel sums all of a step's heads in one matmul).
    beta: `[C, 1]`, 0 on padding rows.
    seg_col `[C, 1]`, seg_row `[1, C]`: int32 labels of the chunk's rows.

  Returns:
    G `[C, K]` (cumulative gate), tinv `[C, C]` = (I + Diag(beta) Akk)^-1, aqk `[C, C]` (masked to
    same document and r >= i).
  """
  G = g if cumulative else cumsum_rows(g)
  tinv, aqk = chunk_prep_heads([q], [k], [G], [beta], seg_col, seg_row, blocked=blocked, dots=dots)[0]
  return G, tinv, aqk


def chunk_prep_heads(qs, ks, Gs, betas, seg_col, seg_row, *, blocked: bool, dots=F32,
                     inverse_dots=F32):
  """`chunk_prep` of several heads of one chunk (lists of `[C, K]` q, k, cumulative G and `[C, 1]`
  beta), stage by stage across the heads so that their independent matmuls are issued together
  and their MXU latencies overlap. Returns `[(tinv, aqk)]` per head."""
  c = qs[0].shape[0]
  r = iota((c, c), 0)
  col = iota((c, c), 1)
  same = (seg_col == seg_row) & (seg_col != 0)
  scores = [intra_chunk_scores(q, k, G, blocked=blocked, dots=dots) for q, k, G in zip(qs, ks, Gs)]
  akks = [beta * jnp.where(same & (r > col), akk, 0.0) for beta, (akk, _) in zip(betas, scores)]
  aqks = [jnp.where(same & (r >= col), aqk, 0.0) for _, aqk in scores]
  return list(zip(unit_lower_inverses(akks, inverse_dots), aqks))


def piece_with_state(G, q, k, beta, tinv, u, mask, first, last, s_in, dots=F32):
  """One document piece (rows `mask`, first row `first`, last row `last`) with incoming state s_in.

  Returns (vnew `[C, V]` restricted to the piece, o_add `[C, V]` = (q~ exp(G - G_a)) S_in,
  s_base `[K, V]` = Diag(exp(G_e - G_a)) S_in), with a = first - 1 (G_a = 0 when first = 0).
  """
  ga = row_at(G, first - 1)
  e = jnp.exp(jnp.where(mask, G - ga, NEG_INF))
  w = dots.nn(tinv, beta * k * e)
  vnew = jnp.where(mask, u - dots.nn(w, s_in), 0.0)
  o_add = dots.nn(q * e, s_in)
  s_base = row_to_col(jnp.exp(row_at(G, last) - ga)) * s_in
  return vnew, o_add, s_base


def piece_state_update(G, k, mask, last, vnew, dots=F32):
  """sum_{i in piece} (k_i exp(G_e - G_i)) vnew_i^T, `[K, V]`: the piece's writes seen at row e."""
  e = jnp.exp(jnp.where(mask, row_at(G, last) - G, NEG_INF))
  return dots.tn(k * e, vnew)
