"""In-kernel math of one 64-row chunk holding any number of documents (Pallas TPU and GPU).

Everything here operates on values already loaded from refs (2-D arrays, float32) and is written for
both Mosaic and Triton: predicates are built at full rank from `broadcasted_iota`, rows are selected
with masked reductions instead of dynamic slicing, and every exponent is masked to -inf *before*
`exp` so that no factor can overflow. Math: docs/kda.md section 'Chunked form (WY/UT)' and
docs/packing.md section 'Segment-native chunk algorithm' (the masked equations).

Notation (one head, one chunk of C rows): `G` is the inclusive cumulative gate of each row's own
document inside the chunk (`cumsum_rows_split` with the document mask): it restarts at every document's
first row, so no gate difference of one document ever reads another document's decay (g = 0 on padding
rows); `same[r, i]` says rows r and i hold the same document. Gate rows are raised to at least
`MIN_LOG_DECAY` first (`clamp_gate`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kda_plugin.ops._chunk_common import (  # noqa: F401  (re-exported as cm.* names)
    GENTLE_LOG_DECAY, L2NORM_EPS, NEG_INF, SUB, activate_gate, factored_diagonal, factored_shift)
from kda_plugin.ops._chunk_common import SUB_SHIFT as _SUB_SHIFT
_HI = lax.Precision.HIGHEST
# bf16 operands name their precision: under a caller's `jax.default_matmul_precision("highest")` an
# unnamed one becomes fp32 contract precision, which Mosaic refuses for bf16 operands ("Bad lhs type")
_BF16_PASS = (lax.Precision.DEFAULT, lax.Precision.DEFAULT)
# Per-row log decays below this are raised to it (`clamp_gate`): exp(-20) ~ 2.1e-9 is below half a
# float32 ulp (2**-24 ~ 6e-8) of the state it multiplies, so the result is the exact one to float32
# rounding, and a chunk's cumulative gate stays within 64 * 20 in magnitude (bounded cancellation in
# its differences; docs/kda.md section 'Precision').
MIN_LOG_DECAY = -20.0



class Dots(NamedTuple):
  """The matmul precision of one call: float32 at HIGHEST (six bf16 MXU passes), or bf16 operands
  with float32 accumulation (one pass; `bf16=True`). The operands are cast explicitly, so interpret
  mode on a CPU rounds them exactly as the MXU does and the numerics tests see the device's error."""

  bf16: bool = False

  def _mm3(self, a, b, dims):
    """bf16x3 (float32 operands split into a bf16 head and a bf16 remainder): a_hi b_hi +
    a_hi b_lo + a_lo b_hi as ONE product, the three pairs stacked along the contraction (one MXU
    accumulation, one result pop per tile); float32 at HIGHEST when `bf16` is off."""
    if not self.bf16:
      return self._mm(a, b, dims)
    bf = jnp.bfloat16
    split = lambda x: (x.astype(bf), (x - x.astype(bf).astype(jnp.float32)).astype(bf))
    (ah, al), (bh, bl) = split(a), split(b)
    ca, cb = dims[0][0], dims[1][0]
    lhs = jnp.concatenate([ah, ah, al], axis=ca)
    rhs = jnp.concatenate([bh, bl, bh], axis=cb)
    return lax.dot_general(lhs, rhs, (dims, ((), ())), precision=_BF16_PASS,
                           preferred_element_type=jnp.float32)

  def nn3(self, a, b):
    """a @ b, bf16x3 when bf16."""
    return self._mm3(a, b, ((1,), (0,)))

  def tn3(self, a, b):
    """a.T @ b, bf16x3 when bf16."""
    return self._mm3(a, b, ((0,), (0,)))

  def _mm(self, a, b, dims):
    dn = (dims, ((), ()))
    if self.bf16:
      return lax.dot_general(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), dn,
                             precision=_BF16_PASS, preferred_element_type=jnp.float32)
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


def l2norm_rows(x):
  """x / sqrt(sum x^2 + 1e-6) per row (eps inside the square root, as gates.l2norm)."""
  return x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2NORM_EPS)


def cumsum_rows(g):
  """Inclusive cumulative sum down the rows, as a lower-triangular matmul (no scan in the kernel)."""
  c = g.shape[0]
  tril = (iota((c, c), 1) <= iota((c, c), 0)).astype(jnp.float32)
  return dot(tril, g)


def clamp_gate(g):
  """`max(g, MIN_LOG_DECAY)`: see `MIN_LOG_DECAY`."""
  return jnp.maximum(g, MIN_LOG_DECAY)


def same_document(seg_col, seg_row):
  """`[C, C]` bool: rows r and i hold the same document (padding rows, label 0, belong to none)."""
  return (seg_col == seg_row) & (seg_col != 0)


def split_bf16x3(x):
  """float32 `x` as three bf16 pieces `(hi, mid, lo)`, each the rounding of what the previous ones
  left: together they carry x's 24 mantissa bits, so a product of them with an operand exact in bf16
  (a 0/1 mask) sums exact terms in float32."""
  bf = jnp.bfloat16
  hi = x.astype(bf)
  rest = x - hi.astype(jnp.float32)
  mid = rest.astype(bf)
  return hi, mid, (rest - mid.astype(jnp.float32)).astype(bf)


def cumsum_rows_split(g, same=None):
  """`cumsum_rows` of float32 `g [C, D]` as ONE bf16 MXU product, as exact as the float32 one.
  With `same` (`same_document`'s `[C, C]` mask) each row sums only its own document's rows: the
  cumulative gate restarts at every document's first row.

  g = hi + mid + lo with three bf16 pieces (each the rounding of what the previous ones left, so
  together they carry g's 24 mantissa bits), and the 0/1 lower triangle is exact in bf16, so
  [tril | tril | tril] @ [hi; mid; lo] sums exact products in float32: three MXU passes in one
  accumulation instead of HIGHEST's six, and one result pop per tile (tools/tpu_cost.py: the result
  pops of the step's first matmuls set the start of its chain).
  """
  c = g.shape[0]
  bf = jnp.bfloat16
  hi, mid, lo = split_bf16x3(g)
  if same is not None:
    # the document mask varies per column block, so the three pieces take three products (Mosaic
    # lowers no lane concatenation of 64-wide masks)
    tril = ((iota((c, c), 1) <= iota((c, c), 0)) & same).astype(bf)
    mm = lambda x: lax.dot_general(tril, x, (((1,), (0,)), ((), ())), precision=_BF16_PASS,
                                   preferred_element_type=jnp.float32)
    return mm(hi) + (mm(mid) + mm(lo))
  tril3 = (jnp.bitwise_and(iota((c, 3 * c), 1), c - 1) <= iota((c, 3 * c), 0)).astype(bf)
  return lax.dot_general(tril3, jnp.concatenate([hi, mid, lo], axis=0), (((1,), (0,)), ((), ())),
                         precision=_BF16_PASS, preferred_element_type=jnp.float32)


def _diag_scores(qb, kb, gb, segb, row0, c):
  """Elementwise scores of one diagonal row block: rows row0..row0+R-1 against the same columns.

  Returns `(akk, aqk)` `[R, C]`; entry (r, i) = sum_d {k,q}_r[d] k_i[d] exp(G_r[d] - G_i[d]) for
  columns i in the block with i <= r of the same document (segb: the rows' float32 labels `[R, 1]`),
  exact (one exponent per entry, masked before exp), 0 elsewhere.
  """
  r_, d = gb.shape
  rows = iota((r_, d), 0) + row0
  cols = iota((r_, c), 1)

  def body(j, carry):
    akk, aqk = carry
    i = row0 + j
    keep = (rows >= i) & (segb == row_at(segb, j))
    e = jnp.exp(jnp.where(keep, gb - row_at(gb, j), NEG_INF)) * row_at(kb, j)
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


def _nt_by_columns(dots, a, b):
  """`a [2C, D] @ b [C, D]^T` as `(b a^T)^T`: the MXU streams the C rows of b through the 2C
  columns of a, half the LHS pushes of streaming a's 2C rows through C (64 of 128) columns; the
  same products and sums, transposed once on the XLU."""
  return dots.nt(b, a).T


def _below_diag_scores(q, k, G, segf, dots=F32):
  """Scores of every entry below the diagonal 16x16 blocks, `(akk, aqk)` `[C, C]`, in ONE matmul.

  Column block `blk` against all rows below it, factored around the block's last row `p`:
  exp(G_r - G_p) exp(G_p - G_i) with i <= p < r. Both factors are masked to rows of p's document
  (segf: float32 labels `[C, 1]`) before exp: within one document G is non-increasing, so both are
  <= 1 and neither can overflow (an underflowed factor only hides a product that is smaller still);
  a kept entry (r, i of one document) has p in that document too. The C/16 - 1 column
  blocks are stacked along the contraction (their key rows are disjoint, so the sum over the
  stacked channels is the sum over blocks) and the k and q rows side by side: one product
  (`_nt_by_columns`), one MXU round trip instead of 2 (C/16 - 1) (tools/tpu_cost.py: the step's
  chain is a sum of MXU round trips). Only masks, aligned concatenations and one transpose.
  """
  c = G.shape[0]
  rows = iota(G.shape, 0)
  seg_d = jnp.broadcast_to(segf, G.shape)
  # exp(G_p - G_i) for every row i against the last row p of its own block: one exponent per
  # (row, channel), shared by all column blocks (each one uses only its own rows)
  k_inside = k * jnp.exp(jnp.where(block_row(seg_d, SUB - 1) == seg_d, block_row(G, SUB - 1) - G,
                                   NEG_INF))
  k_parts, q_parts, key_parts = [], [], []
  for blk in range(c // SUB - 1):
    p = blk * SUB + SUB - 1
    below = jnp.exp(jnp.where((rows > p) & (seg_d == row_at(segf, p)), G - row_at(G, p), NEG_INF))
    k_parts.append(k * below)
    q_parts.append(q * below)
    key_parts.append(jnp.where((rows >= blk * SUB) & (rows <= p), k_inside, 0.0))
  lhs = jnp.concatenate([jnp.concatenate(k_parts, axis=1), jnp.concatenate(q_parts, axis=1)], axis=0)
  both = _nt_by_columns(dots, lhs, jnp.concatenate(key_parts, axis=1))
  return both[:c], both[c:]


def _diag_scores_factored(q, k, G, segf, lower_bound, dots):
  """All diagonal 16x16 blocks of `(akk, aqk)` `[C, C]` in one matmul (`_nt_by_columns`).

  exp(G_r - G_i) = exp(G_r - ref) exp(ref - G_i) with ref = G_first - d (`factored_shift`), G_first
  the first row of the rows' own block, or ref = -d for rows whose document starts inside the block
  (G restarts at 0 there, segf: float32 labels `[C, 1]`): r and i of one document and block share
  their ref, and both factors lie in [exp(-d), exp(d)] (finite, no mask before exp); each kept term's
  rounding is relative to the term, as in `_below_diag_scores`. The reference is a row at or before
  every row of its block, so no kept entry's rounding reads a later row's gate. Products across
  blocks are garbage and set to 0 here (`where` never propagates them).
  """
  c = G.shape[0]
  starts_inside = jnp.broadcast_to(block_row(jnp.broadcast_to(segf, G.shape), 0) != segf, G.shape)
  ref = jnp.where(starts_inside, 0.0, block_row(G, 0)) - factored_shift(lower_bound)
  row_f = jnp.exp(G - ref)
  k_col = k * jnp.exp(ref - G)
  both = _nt_by_columns(dots, jnp.concatenate([k * row_f, q * row_f], axis=0), k_col)
  r = iota((c, c), 0)
  same_block = jnp.right_shift(r, _SUB_SHIFT) == jnp.right_shift(iota((c, c), 1), _SUB_SHIFT)
  return jnp.where(same_block, both[:c], 0.0), jnp.where(same_block, both[c:], 0.0)


def intra_chunk_scores(q, k, G, segf, *, blocked: bool, dots=F32, lower_bound=None):
  """`Akk` and `Aqk` of the chunk before segment/causal masking (entries with r >= i of one document
  are valid; the others may hold garbage, never read through `where`).

  Args: q, k, G float32 `[C, K]` (C a multiple of 16; G restarted per document), segf float32 `[C, 1]`
  row labels. Returns `(akk, aqk)` float32 `[C, C]`.
  Entries strictly below the diagonal 16x16 blocks come from matmuls (`_below_diag_scores`); the
  diagonal blocks are exact elementwise sums with one masked exponent per entry. blocked=True
  (Mosaic) builds each diagonal block from its own 16-row slice; blocked=False (Triton, no value
  slicing) builds all diagonal blocks together in 16 masked iterations (`_diag_scores_all_blocks`).
  With `lower_bound` (the bounded gate, see `factored_diagonal`) the diagonal blocks are one factored
  matmul instead (`_diag_scores_factored`; tools/tpu_cost.py: the elementwise blocks were most of the
  TPU kernel's VPU work).
  Math: docs/kda.md section 'Chunked form (WY/UT)' and docs/packing.md section 'Segment-native chunk algorithm'.
  """
  c = G.shape[0]
  if factored_diagonal(lower_bound):
    akk, aqk = _diag_scores_factored(q, k, G, segf, lower_bound, dots)
  elif not blocked:
    akk, aqk = _diag_scores_all_blocks(q, k, G)
  else:
    nb = c // SUB
    diag = [_diag_scores(q[i * SUB:(i + 1) * SUB], k[i * SUB:(i + 1) * SUB],
                         G[i * SUB:(i + 1) * SUB], segf[i * SUB:(i + 1) * SUB], i * SUB, c)
            for i in range(nb)]
    akk = jnp.concatenate([a for a, _ in diag], axis=0)
    aqk = jnp.concatenate([a for _, a in diag], axis=0)
  below_kk, below_qk = _below_diag_scores(q, k, G, segf, dots)
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


def _diag_block_inverses(mats, block_shift):
  """Inverses of the diagonal `2**block_shift`-row blocks of (I + a) for strictly lower `a [C, C]`,
  by forward substitution on the VPU, every block and matrix at once, in float32.

  Row r of X = (I + A)^-1 within its block: X_r = e_r - sum_{j < r} A[r, j] X_j. Iteration j
  subtracts A[r, b(r) + j] X_{b(r) + j} from every row r of each block b(r) (A is strictly lower,
  so rows at or above j get 0): X_{b + j} is final when iteration j reads it. The result is
  block diagonal (entries outside the blocks stay 0).
  """
  c = mats[0].shape[0]
  n = 1 << block_shift
  r = iota((c, c), 0)
  col = iota((c, c), 1)
  same = jnp.right_shift(r, block_shift) == jnp.right_shift(col, block_shift)
  col_first = jnp.left_shift(jnp.right_shift(r, block_shift), block_shift)
  eye = (r == col).astype(jnp.float32)
  blocks = [jnp.where(same & (r > col), a, 0.0) for a in mats]

  def body(j, xs):
    hit = col == col_first + j
    out = []
    for a, x in zip(blocks, xs):
      a_j = jnp.sum(jnp.where(hit, a, 0.0), axis=1, keepdims=True)        # A[r, b(r) + j]
      x3 = x.reshape(c // n, n, c)
      x_j = jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, x3.shape, 1) == j, x3, 0.0),
                    axis=1, keepdims=True)
      out.append(x - a_j * jnp.broadcast_to(x_j, x3.shape).reshape(c, c))
    return tuple(out)

  return list(lax.fori_loop(0, n, body, tuple(eye for _ in blocks)))


def unit_lower_inverses(mats, dots=F32, vpu_block_shift=1):
  """`unit_lower_inverse` of several independent matrices, level by level: each doubling issues its
  matmul for every matrix before the next one, so their MXU latencies overlap (a step's heads:
  one dependent chain of 10 matmuls instead of 10 per head; tools/tpu_cost.py follows the chain).

  vpu_block_shift: the diagonal blocks of 2**vpu_block_shift rows are inverted first by forward
  substitution on the VPU in float32 (`_diag_block_inverses`; 1: the exact 2 x 2 blocks, X = I - L),
  and only the remaining doublings use the MXU: 2 (log2 C - vpu_block_shift) matmuls in the chain.
  """
  c = mats[0].shape[0]
  if c & (c - 1) or any(a.shape != (c, c) for a in mats):
    raise ValueError("unit_lower_inverse: a must be [C, C] with C a power of two, got "
                     f"{[a.shape for a in mats]}")
  r = iota((c, c), 0)
  col = iota((c, c), 1)
  if vpu_block_shift > 1:
    xs = _diag_block_inverses(mats, vpu_block_shift)
    shift = vpu_block_shift
  else:
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
               dots=F32, lower_bound=None, vpu_block_shift=1):
  """The chunk-wide matrices that do not depend on the incoming states.

  Args:
    q: float32 `[C, K]`, already normalised and scaled. k: float32 `[C, K]`.
    g: float32 `[C, K]` activated gate, 0 on padding rows (with `cumulative`, already its
      inclusive cumulative sum G per document: the TPU kernel sums all of a step's heads in one
      matmul).
    beta: `[C, 1]`, 0 on padding rows.
    seg_col `[C, 1]`, seg_row `[1, C]`: int32 labels of the chunk's rows.

  Returns:
    G `[C, K]` (cumulative gate, restarted per document), tinv `[C, C]` = (I + Diag(beta) Akk)^-1, aqk `[C, C]` (masked to
    same document and r >= i).
  """
  G = g if cumulative else cumsum_rows_split(g, same_document(seg_col, seg_row))
  tinv, aqk = chunk_prep_heads([q], [k], [G], [beta], seg_col, seg_row, blocked=blocked, dots=dots,
                               lower_bound=lower_bound, vpu_block_shift=vpu_block_shift)[0]
  return G, tinv, aqk


def chunk_prep_heads(qs, ks, Gs, betas, seg_col, seg_row, *, blocked: bool, dots=F32,
                     inverse_dots=F32, lower_bound=None, vpu_block_shift=1):
  """`chunk_prep` of several heads of one chunk (lists of `[C, K]` q, k, cumulative G and `[C, 1]`
  beta), stage by stage across the heads so that their independent matmuls are issued together
  and their MXU latencies overlap. `lower_bound`: the bounded gate's bound when every row's log
  decay is known to lie in [lower_bound, 0] (see `intra_chunk_scores`). Returns `[(tinv, aqk)]`."""
  c = qs[0].shape[0]
  r = iota((c, c), 0)
  col = iota((c, c), 1)
  same = same_document(seg_col, seg_row)
  segf = seg_col.astype(jnp.float32)
  scores = [intra_chunk_scores(q, k, G, segf, blocked=blocked, dots=dots, lower_bound=lower_bound)
            for q, k, G in zip(qs, ks, Gs)]
  akks = [beta * jnp.where(same & (r > col), akk, 0.0) for beta, (akk, _) in zip(betas, scores)]
  aqks = [jnp.where(same & (r >= col), aqk, 0.0) for _, aqk in scores]
  return list(zip(unit_lower_inverses(akks, inverse_dots, vpu_block_shift), aqks))


def piece_with_state_heads(Gs, qs, ks, betas, tinvs, us, mask, first, last, s_ins, dots=F32):
  """Document pieces (rows `mask`, first row `first`, last row `last`) of several heads of one chunk
  with incoming states `s_ins` (lists per head). Per head: vnew `[C, V]` restricted to the piece,
  o_add `[C, V]` = (q~ exp(G)) S_in, s_base `[K, V]` = Diag(exp(G_e)) S_in: G restarts at the
  document's first row, so G_r is the decay since the state entered (the chunk start for a
  continuing document, the document's first row otherwise). Stage by stage across the heads: every head's W and
  o_add matmuls, then every head's W S_in, so that independent matmuls are issued together.
  o_add = (q~ e) S_in is bf16x3 with bfloat16 inputs (`Dots.nn3`): with one pass the output of the
  nearly-parallel-keys case sits at the edge of its tolerance (figures: docs/performance.md).
  With a zero S_in the results are exactly the stateless piece's (vnew = U on the piece, o_add and
  s_base zero). Returns `[(vnew, o_add, s_base)]` per head."""
  del first
  eg = [(0.0, jnp.exp(jnp.where(mask, G, NEG_INF))) for G in Gs]
  ws = [dots.nn(tinv, beta * k * e) for tinv, beta, k, (_, e) in zip(tinvs, betas, ks, eg)]
  o_adds = [dots.nn3(q * e, s_in) for q, (_, e), s_in in zip(qs, eg, s_ins)]
  vnews = [jnp.where(mask, u - dots.nn(w, s_in), 0.0) for u, w, s_in in zip(us, ws, s_ins)]
  s_bases = [row_to_col(jnp.exp(row_at(G, last) - ga)) * s_in for G, (ga, _), s_in in zip(Gs, eg, s_ins)]
  return list(zip(vnews, o_adds, s_bases))


def piece_state_update(G, k, mask, last, vnew, dots=F32):
  """sum_{i in piece} (k_i exp(G_e - G_i)) vnew_i^T, `[K, V]`: the piece's writes seen at row e.

  bf16x3 with bfloat16 inputs (`Dots.tn3`): the state accumulates these writes over the whole
  document, and with one bf16 pass the nearly-parallel-keys case misses its tolerance
  (tests/kernels/test_inference_numerics.py; figures: docs/performance.md)."""
  e = jnp.exp(jnp.where(mask, row_at(G, last) - G, NEG_INF))
  return dots.tn3(k * e, vnew)
