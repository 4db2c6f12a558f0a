"""In-kernel math of the GPU (Pallas Triton) KDA kernels: one 64-row chunk as whole-tile operations.

Written for the Triton lowering: every value is a full `[C, D]` tile (no value slicing), predicates come
from `broadcasted_iota`, rows are picked by masked reductions (exact: one non-zero term), and every
exponent is masked to -inf *before* `exp`, so no factor can overflow whatever the decay. Matmuls run on
the tensor cores in TF32 (one pass) or TF32x3 (three passes, close to float32) through `Dots`.

Math: docs/kda.md section 'Chunked form (WY/UT)' and docs/packing.md section 'Segment-native chunk algorithm' (the masked chunk
equations). The cumulative gate `G` restarts at each document's first row, inside the chunk too, and
skips rows whose decay underflows (`document_gates`): `G_r - G_i` of two rows of one run is then a
difference of sums of that document's own non-cut gates only, and pairs across a run boundary get decay 0
by masking the exponent to -inf before `exp`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kda_plugin.ops._chunk_common import (  # noqa: F401  (CHUNK, activate_gate, factored_diagonal: gm.* names)
    CHUNK, L2NORM_EPS, NEG_INF, SUB, activate_gate, factored_diagonal, factored_shift)
from kda_plugin.ops._chunk_common import SUB_SHIFT as _SUB_SHIFT

_HI = lax.Precision.HIGHEST
_NN = ((1,), (0,))  # a @ b
_NT = ((1,), (1,))  # a @ b.T
_TN = ((0,), (0,))  # a.T @ b


def _tf32(x, *, rounded: bool):
  """x with its mantissa cut to TF32's 10 bits: round-to-nearest (cvt.rna) or truncation (what an
  mma.tf32 reading raw float32 registers sees)."""
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  if rounded:
    bits = bits + jnp.uint32(0x1000)
  return lax.bitcast_convert_type(bits & jnp.uint32(0xFFFFE000), jnp.float32)


@dataclasses.dataclass(frozen=True)
class Dots:
  """Tensor-core matmuls with float32 accumulation.

  passes=1: TF32 (inputs cut to 10 mantissa bits, relative error ~5e-4 per operand), used for
  bfloat16 inputs. passes=3: TF32x3 (`hi*hi + hi*lo + lo*hi` with hi, lo TF32 parts, relative error
  ~1e-6), used for float32 inputs, whose 1e-4 tolerance one TF32 pass misses
  (tests/kernels/test_gpu_kernel_precision.py shows both). `emulate` (interpret mode on a CPU, whose
  XLA has no TF32 algorithms) rounds the operands the way the GPU does and multiplies in float32, so
  interpret-mode numerics carry the device's TF32 rounding.
  """

  passes: int
  emulate: bool

  def __call__(self, a, b, dims=_NN):
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    dn = (dims, ((), ()))
    if not self.emulate:
      preset = (lax.DotAlgorithmPreset.TF32_TF32_F32 if self.passes == 1
                else lax.DotAlgorithmPreset.TF32_TF32_F32_X3)
      return lax.dot_general(a, b, dn, precision=preset, preferred_element_type=jnp.float32)
    mm = lambda x, y: lax.dot_general(x, y, dn, precision=(_HI, _HI),
                                      preferred_element_type=jnp.float32)
    if self.passes == 1:
      return mm(_tf32(a, rounded=False), _tf32(b, rounded=False))
    a_hi, b_hi = _tf32(a, rounded=True), _tf32(b, rounded=True)
    a_lo, b_lo = _tf32(a - a_hi, rounded=True), _tf32(b - b_hi, rounded=True)
    return mm(a_hi, b_lo) + mm(a_lo, b_hi) + mm(a_hi, b_hi)

  def nt(self, a, b):
    return self(a, b, _NT)

  def tn(self, a, b):
    return self(a, b, _TN)


def iota(shape, dim):
  return lax.broadcasted_iota(jnp.int32, shape, dim)


def row_at(x, idx):
  """Row `idx` (a traced scalar or `[1, 1]`) of `x [R, D]` as `[1, D]`; zeros when no row matches."""
  return jnp.sum(jnp.where(iota(x.shape, 0) == idx, x, 0.0), axis=0, keepdims=True)


def l2norm_scale(x):
  """`[R, 1]` factors 1 / sqrt(sum x^2 + 1e-6) of the rows of x (epsilon inside the root, as
  `gates.l2norm`)."""
  return lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2NORM_EPS)


# A row whose log decay is at most CUT_LOG multiplies the state by exp(g) <= exp(-104) < 2**-150, which
# float32 rounds to 0 (as the token recurrence does): every decay across such a row is exactly 0 in
# float32, so the cumulative gate may restart after it (a "cut") without changing any float32 result.
CUT_LOG = -104.0


def _next_flagged(flag, after):
  """The first row > after (a `[1, 1]` tile) where flag `[C, 1]` is set, or C, as a `[1, 1]` tile.

  Row indices stay [1, 1] tiles (keepdims reductions): a reduction to a scalar trips jax's sharding
  check under an explicit abstract mesh (ahead-of-time export); the trip counts come in as scalars."""
  c = flag.shape[0]
  rows = iota((c, 1), 0)
  return jnp.min(jnp.where(flag & (rows > after), rows, c), axis=0, keepdims=True)


class DocumentGates(NamedTuple):
  """The gate sums of one chunk's key channels: G restarts at every document's first row, and a run
  also ends at each cut.

  All `[C, K]` float32. Two rows i <= r of one document have decay exp(G[r] - G[i]) when
  run[r] == run[i] and exactly 0 (float32's value) when not: a run ends at a document's first row or at
  a cut row (`CUT_LOG`), which adds nothing to G. G is a cumulative sum of the non-cut gates of r's
  own document only, so no other document's decay and no underflowing row enters its rounding; the
  rounding of G[r] - G[i] is about |G| * 2^-24, |G| being that document's non-cut decay since its
  first row in the chunk.
  """

  G: jax.Array       # sum of the non-cut gates of r's document from its first row in the chunk to r
  run: jax.Array     # run label (exact small integers): cuts plus document starts at rows <= r
  entered: jax.Array  # 1 where no cut lies between r's document's first row in the chunk and r, else 0


def document_gates(g, starts, n_starts):
  """`DocumentGates` of `g [C, K]` (log decay, 0 on padding); starts: int32 `[C, 1]` flags of a
  document's first row at chunk row > 0, n_starts their count (a scalar).

  One fresh cumulative sum per document start in the chunk (the loop runs once per start, usually
  zero or one times): each document's G is a direct sum of its own gates, never a difference.
  """
  c = g.shape[0]
  rows = iota((c, 1), 0)
  is_start = starts != 0
  cut = g <= CUT_LOG
  g = jnp.where(cut, 0.0, g)
  cuts = jnp.cumsum(cut.astype(jnp.float32), axis=0)
  run = cuts + jnp.cumsum(is_start.astype(jnp.float32), axis=0)

  def start_body(_, carry):
    prev, G, cuts_before = carry
    s = _next_flagged(is_start, prev)
    after = rows >= s
    G = jnp.where(after, jnp.cumsum(jnp.where(after, g, 0.0), axis=0), G)
    return s, G, jnp.where(after, row_at(cuts, s - 1), cuts_before)

  init = (jnp.full((1, 1), -1, jnp.int32), jnp.cumsum(g, axis=0), jnp.zeros_like(g))
  _, G, cuts_before = lax.fori_loop(0, n_starts, start_body, init)
  return DocumentGates(G, run, (cuts == cuts_before).astype(jnp.float32))


def at_document_ends(x, ends, n_ends):
  """`x [C, D]` at the last row of each row's document in the chunk, `[C, D]`; ends: int32 `[C, 1]`
  flags of a document's last row in the chunk (the chunk's last row included), n_ends their count.
  One masked row pick per document end (usually one)."""
  c = x.shape[0]
  rows = iota((c, 1), 0)
  is_end = ends != 0

  def end_body(_, carry):
    prev, xe = carry
    e = _next_flagged(is_end, prev)
    return e, jnp.where((rows > prev) & (rows <= e), row_at(x, e), xe)

  _, xe = lax.fori_loop(0, n_ends, end_body, (jnp.full((1, 1), -1, jnp.int32), jnp.zeros_like(x)))
  return xe


def _own_block_row(x, j):
  """`[C, D]` whose row r is row `SUB * (r // SUB) + j` of x: row j of r's own 16-row block (a masked
  reduction over the `[C / SUB, SUB, D]` view, broadcast back; exact)."""
  c, d = x.shape
  x3 = x.reshape(c // SUB, SUB, d)
  pick = lax.broadcasted_iota(jnp.int32, x3.shape, 1) == j
  return jnp.broadcast_to(jnp.sum(jnp.where(pick, x3, 0.0), axis=1, keepdims=True), x3.shape).reshape(c, d)


def chunk_scores(q, k, G, dots: Dots, *, lower_bound=None, run=None):
  """`(Akk, Aqk)` `[C, C]`: sum_d {k, q}_r[d] k_i[d] exp(G_r[d] - G_i[d]) for i <= r in one run
  (0 for a pair of two runs), before masking.

  G, run: `[C, K]` float32 as `DocumentGates` (run None: the whole chunk is one run, G one cumulative
  sum). Every exponent that pairs rows of two runs is masked to -inf before `exp`: with G restarting
  at each run, such an exponent could be large and positive, and an inf factor times a 0 in a matmul
  would put NaN into a kept entry.
  lower_bound: the bounded gate's static bound when every per-row log decay lies in [lower_bound, 0]
  (then `factored_diagonal` may hold, and no row is a cut), else None.
  Entries inside the diagonal 16x16 blocks, two ways:
  - factored (`factored_diagonal(lower_bound)`): exp(G_r - G_i) = exp(G_r - C) exp(C - G_i) with
    C = G_first - d (`factored_shift`), G_first the block's first row, for the rows of the block
    first row's run; C = -d for the rows of a document that starts inside the block (its G restarts
    there, so it lies in [-15 |lower_bound|, 0]). Both factors lie in [exp(-d), exp(d)], finite without
    masking; one tensor-core matmul per score for all four blocks (2 C K exponents instead of
    16 C K). The products across blocks, and across documents, are discarded by the caller's `where`
    (which never reads them: they may overflow). The reference is a row at or before every row of its
    block, so no entry's rounding depends on a later row's gate (fla's bounded-gate path documents that
    leak for a middle-row reference and uses a shifted first row too). The factors' TF32 rounding is
    relative to each term, as for the blocks below the diagonal.
  - elementwise (any gate): one masked exponent per (row, channel) in 16 iterations that fill column
    `16 * (r // 16) + j` of every row at once (the exponent is shared by Akk and Aqk).
  Entries below them: for row block R, the exponent is split around the block's first row n = 16 R
  (i < n <= r; a pair of one run has n in that run too), so that both factors exp(G_r - G_n) and
  exp(G_n - G_i) are <= 1, and each product is one tensor-core matmul per block (3 for C = 64).
  Entries above the diagonal are finite and masked by the caller.
  """
  c, d = G.shape
  rows = iota((c, d), 0)
  block_first = jnp.left_shift(jnp.right_shift(rows, _SUB_SHIFT), _SUB_SHIFT)
  cols = iota((c, c), 1)
  col_block_first = jnp.left_shift(jnp.right_shift(iota((c, c), 0), _SUB_SHIFT), _SUB_SHIFT)

  if run is None:
    run = jnp.zeros_like(G)
  if lower_bound is not None and factored_diagonal(lower_bound):
    shift = factored_shift(lower_bound)
    ref = jnp.where(run == _own_block_row(run, 0), _own_block_row(G, 0) - shift, -shift)
    row_f = jnp.exp(G - ref)
    k_col = k * jnp.exp(ref - G)
    same_block = jnp.right_shift(cols, _SUB_SHIFT) == jnp.right_shift(iota((c, c), 0), _SUB_SHIFT)
    acc = (jnp.where(same_block, dots.nt(k * row_f, k_col), 0.0),
           jnp.where(same_block, dots.nt(q * row_f, k_col), 0.0))
  else:
    def diag_body(j, acc):
      akk, aqk = acc
      mine = (rows >= block_first + j) & (run == _own_block_row(run, j))
      f = jnp.exp(jnp.where(mine, G - _own_block_row(G, j), NEG_INF))
      f = f * _own_block_row(k, j)
      hit = cols == col_block_first + j
      return (jnp.where(hit, jnp.sum(f * k, axis=1, keepdims=True), akk),
              jnp.where(hit, jnp.sum(f * q, axis=1, keepdims=True), aqk))

    zero = jnp.zeros((c, c), jnp.float32)
    acc = lax.fori_loop(0, SUB, diag_body, (zero, zero))
  row_block = jnp.right_shift(rows, _SUB_SHIFT)

  def below_body(blk, acc):
    akk, aqk = acc
    n = blk * SUB
    gn, rn = row_at(G, n), row_at(run, n)
    row_f = jnp.exp(jnp.where((row_block == blk) & (run == rn), G - gn, NEG_INF))
    k_col = k * jnp.exp(jnp.where((rows < n) & (run == rn), gn - G, NEG_INF))
    return akk + dots.nt(k * row_f, k_col), aqk + dots.nt(q * row_f, k_col)

  # A loop, not unrolled: one block's operands live at a time (unrolled, the independent matmuls are
  # scheduled together and spill).
  return lax.fori_loop(1, c // SUB, below_body, acc)


def unit_lower_inverse(a, dots: Dots):
  """(I + a)^-1 for strictly lower-triangular `a [C, C]` (C a power of two), by block doubling.

  With X the inverse of the diagonal b x b blocks, each 2b x 2b diagonal block [[T1, 0], [L, T2]]
  has inverse [[X1, 0], [-X2 L X1, X2]]: X <- X - X (L X) with L = `a` restricted to the lower-left
  quadrants. Starting from the exact 2 x 2 blocks (X = I - L), log2(C) - 1 doublings of two matmuls
  each (10 for C = 64). A block-diagonal `a` (documents) gives a block-diagonal inverse.
  """
  c = a.shape[0]
  r, col = iota((c, c), 0), iota((c, c), 1)
  x = (r == col).astype(jnp.float32) - jnp.where(
      (jnp.right_shift(r, 1) == jnp.right_shift(col, 1)) & (r > col), a, 0.0)

  def double(shift, x):
    quad = ((jnp.right_shift(r, shift + 1) == jnp.right_shift(col, shift + 1))
            & (jnp.right_shift(r, shift) != jnp.right_shift(col, shift)))
    return x - dots(x, dots(jnp.where(quad, a, 0.0), x))

  return lax.fori_loop(1, c.bit_length() - 1, double, x)


def unit_lower_inverse_rows(a):
  """(I + a)^-1 for strictly lower-triangular `a [C, C]` by forward substitution in float32, one row
  per iteration: X[i] = e_i - sum_{j < i} a[i, j] X[j] (a masked multiply-reduce, no matmul).

  The float32 path's inverse: on the tensor cores it would need TF32x3 for its 1e-4 tolerance, and
  TF32x3 doubling does not fit the registers without spills (tests/aot/test_gpu_kernel_compile.py);
  C iterations of [C, C] vector work cost a few microseconds per chunk-wave instead.
  """
  c = a.shape[0]
  r, col = iota((c, c), 0), iota((c, c), 1)
  lane = iota((1, c), 1)
  a_t = a.T  # column i of a_t holds row i of a down the rows, ready to scale the rows of X

  def row(i, x):
    coef = jnp.sum(jnp.where(col == i, a_t, 0.0), axis=1, keepdims=True)  # [C, 1]: a[i, j] at row j
    new = jnp.where(lane == i, 1.0, 0.0) - jnp.sum(coef * x, axis=0, keepdims=True)  # [1, C]
    return jnp.where(r == i, new, x)

  return lax.fori_loop(1, c, row, (r == col).astype(jnp.float32))
