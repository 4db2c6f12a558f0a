"""KDA in the chunked WY/UT form (chunk 64), with packed documents solved natively.

Math: docs/kda.md section 'Chunked form (WY/UT)' (the chunk equations) and docs/packing.md section 'Segment-native chunk algorithm'
(the masked form for chunks that hold several documents); Kimi Linear tech report (arXiv 2510.26692)
section 6. Per head and chunk, with `G` the inclusive cumulative gate of the chunk (g = 0 on padding):

    Akk[r,i] = same[r,i] [r > i]  sum_d k_r k_i exp(G_r - G_i)
    Aqk[r,i] = same[r,i] [r >= i] sum_d q~_r k_i exp(G_r - G_i)
    L = I + Diag(beta) Akk          (block-diagonal over documents, unit lower triangular)
    R = beta * (V - (K * exp(G - G_a)) S_in)        (the pre-solve residual, one row per token)
    Vnew = L^-1 R                   (the per-token deltas of the delta rule; = U - W S_in)
    O = (q~ * exp(G - G_a)) S_in + Aqk Vnew
    S_out = exp(G_e - G_a) S_in + (K * exp(G_e - G))^T Vnew   (over the rows of the document ending at e)

where `S_in` is the state of the row's document when it enters the chunk and `G_a` the cumulative gate
just before that document's first row in the chunk (0 for the document carried in).

Schedule (CPU-minded): one `lax.scan` step per chunk does all of that chunk's work for every batch
row and head, so the working set stays in cache and no full-sequence intermediate is written; the
inputs are only reshaped (free for B = 1 and T a multiple of 64). The carry is the state of the
document open at the chunk edge; per-slot bookkeeping writes one slot only where a carried document
closes, and keeps the deltas of the (at most N) chunks where documents end. Per-slot initial states
(documents that start inside a chunk) and per-slot final states are handled before / after the scan
with one gathered chunk per slot: a few `C x K x V` products each.

Numerics: the cumulative gate restarts at each document's first row, inside a chunk too, and every
exponent is a direct sum of the gates of the rows it spans (all <= 0), never a difference of two
cumulative sums: neither another document's decay nor a steep row outside the span enters its
rounding, and a span over a row whose decay underflows gives exactly 0, as float32 does in the token
recurrence. The score matrices are built from exponential factors that cannot overflow: one
factorisation per chunk around the midpoint of its documents' decay when no document decays by more
than `FACTOR_LIMIT` nats in any channel (checked per chunk at run time; each factor's exponent is then
at most FACTOR_LIMIT / 2 in size, so a score's relative rounding stays below ~FACTOR_LIMIT * 2^-24),
else 16-row sub-blocks whose off-diagonal blocks are factored at their boundary into three direct
sums (factors <= 1) and whose diagonal blocks are factored around the sub-block's midpoint when no
sub-block decays by more than SUB_FACTOR_LIMIT nats (checked at run time; or by FACTOR_LIMIT, known
for a bounded gate: `diag_mode="factor"`), else built elementwise from direct sums (any decay).
Outputs and gradients stay finite under any decay.
"""

from __future__ import annotations

import functools
import importlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kda_plugin.ops import _chunk_math as cm
from kda_plugin.ops._chunk_common import CHUNK, SUB
from kda_plugin.ops._platform import target_platform
from kda_plugin.ops._contract import check_gate_args, check_kda_inputs, default_scale, is_concrete
from kda_plugin.ops.gates import activate_gate, l2norm

# Largest |decay| (nats, per channel) of one 16-row sub-block for which the diagonal sub-block may be
# factored around its midpoint: each factor is then at most exp(FACTOR_LIMIT / 2) and every product,
# masked entries included, at most exp(FACTOR_LIMIT) < float32 max (exp(88.7)).
FACTOR_LIMIT = 88.0
# Largest |decay| of a 16-row sub-block for which a chunk too steep for one factorisation still takes
# factored diagonal sub-blocks (`score_level` 1) rather than elementwise ones: half of FACTOR_LIMIT,
# so each factor's exponent is at most 22 and a score's relative rounding below ~44 * 2^-24 (the
# training op's gradients stay within tests/kernels/test_chunked_tpu.py's 5e-6 of float64; at 88 they
# did not). It covers a model's gates at initialisation (sub-blocks of at most ~42 nats).
SUB_FACTOR_LIMIT = 44.0
DIAG_MODES = ("auto", "factor", "exact")
_HI = lax.Precision.HIGHEST


def _mm(spec, a, b, precision=_HI):
  return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=jnp.float32)


def _safe_exp(mask, x):
  """exp(x) where mask, else 0, with a finite gradient everywhere (the double-where pattern)."""
  return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def _between(tb):
  """`D[x, y] = sum_{y < z < x} Tb[z]` for sub-blocks x > y (0 elsewhere): `[..., NB, K] -> [..., NB, NB, K]`."""
  nb = tb.shape[-2]
  x = jnp.arange(nb)[:, None, None]
  y = jnp.arange(nb)[None, :, None]
  z = jnp.arange(nb)[None, None, :]
  sel = ((y < z) & (z < x)).astype(tb.dtype)
  return jnp.einsum("xyz,...zk->...xyk", sel, tb, precision=_HI)


def _decay_to_row(g, e):
  """exp(sum_{i < z <= e} g_z) for rows i <= e of a chunk (0 for i > e): the decay from after row i to
  row e.

  Args:
    g: `[..., C, K]` the chunk's per-row log decay (<= 0).
    e: int array broadcastable to `g.shape[:-2]`: the target row in [0, C).

  Returns:
    `[..., C, K]`. Each exponent is a suffix sum of the gates of rows i+1..e themselves (a sum of
    non-positive terms, never a difference of cumulative sums), so neither a steep row before i nor
    another document's decay enters its rounding; a row whose decay underflows makes it exactly 0.
  """
  c = g.shape[-2]
  e = jnp.asarray(e)[..., None, None]
  row = jnp.arange(c)[:, None]
  return _safe_exp(row <= e, _suffix_after(jnp.where(row <= e, g, 0.0)))


def _suffix_after(x):
  """`sum_{z > i} x[z]` along axis -2 (exclusive, from the end), a direct sum for every row."""
  incl = jnp.cumsum(x[..., ::-1, :], axis=-2)[..., ::-1, :]
  return jnp.concatenate([incl[..., 1:, :], jnp.zeros_like(incl[..., :1, :])], axis=-2)


def _prefix_before(x):
  """`sum_{z < i} x[z]` along axis -2 (exclusive), a direct sum for every row."""
  incl = jnp.cumsum(x, axis=-2)
  return jnp.concatenate([jnp.zeros_like(incl[..., :1, :]), incl[..., :-1, :]], axis=-2)


@jax.custom_jvp
def _exp_pair(x):
  """`(exp(x), exp(-x))` from one exp and a reciprocal (cheaper than a second exp on CPU); callers keep
  |x| <= FACTOR_LIMIT / 2 so both are normal floats.

  The derivative is declared as that of two exps: differentiating the reciprocal instead would form
  -exp(-x)**2 (up to exp(FACTOR_LIMIT)) times the incoming cotangent before the bounded product with
  exp(x), which overflows to inf and NaN for ordinary training gradients.
  """
  e = jnp.exp(x)
  return e, 1.0 / e


@_exp_pair.defjvp
def _exp_pair_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  e, r = _exp_pair(x)
  return (e, r), (e * dx, -r * dx)


class _Gates(NamedTuple):
  """The gate sums of a chunk that its scores and decay factors are built from (head-major, float32).

  Every field is a direct sum of the gates of the rows it spans (all terms <= 0, so its rounding is
  relative to itself), never a difference of two cumulative sums: a steep row or another document's
  decay cannot cancel into an exponent that does not span it.
  """

  g: jax.Array      # [..., NB, SUB, K] per-row log decay (0 on padding)
  gb: jax.Array     # [..., NB, SUB, K] sum over the sub-block's rows up to and including row r
  ce: jax.Array     # [..., NB, SUB, K] sum over the sub-block's rows after row r (<= 0)
  tb: jax.Array     # [..., NB, K] total decay of each sub-block
  gc: jax.Array     # [..., C, K] sum over the rows of r's document from its first row in the chunk to r


def _scores_chunk(q, k, gt):
  """Raw `Aqk, Akk [..., C, C]` from one factorisation per chunk (needs every `gc >= -FACTOR_LIMIT`),
  and the decay factors `exp(gc_r)`, `exp(gc_{C-1} - gc_r)` `[..., C, K]` (see `_scores`).

  exp(gc_r - gc_i) = exp(gc_r - m) exp(m - gc_i) with m = min_r gc_r / 2 per channel: every factor is
  at most exp(FACTOR_LIMIT / 2), every product (masked entries included, e.g. rows of two documents,
  whose `gc` restart at each document's first row) at most exp(FACTOR_LIMIT). For two rows of one
  document, the product is that document's decay from i to r, each factor's exponent rounded
  relative to at most FACTOR_LIMIT / 2 nats of that document's own decay. The decay factors reuse the same two exponentials
  (exp is the costliest elementwise op of a chunk on CPU). m is a constant of the factorisation
  (the products do not depend on it), hence `stop_gradient`.
  """
  gc = gt.gc
  m = lax.stop_gradient(0.5 * jnp.min(gc, axis=-2, keepdims=True))
  row_f, col_f = _exp_pair(gc - m)
  col = k * col_f
  # NT products (contracting the last axis of both): no element-level transpose is materialised.
  c = q.shape[-2]
  a = _mm("...rk,...ik->...ri", jnp.concatenate([q * row_f, k * row_f], axis=-2), col)
  return a[..., :c, :], a[..., c:, :], row_f * jnp.exp(m), col_f * row_f[..., -1:, :]


def _scores_blocked(q, k, gt, *, exact):
  """Raw `Aqk, Akk [..., C, C]` built from 16-row sub-blocks (row block x, column block y <= x).

  Off-diagonal blocks (y < x) factor exp(G_r - G_i) at the boundary between them into
  exp(gb_r) exp(D[x, y]) exp(ce_i): three direct sums, each factor <= 1 for any decay. Diagonal blocks
  are factored around their midpoint Tb / 2 (needs |Tb| <= FACTOR_LIMIT) or, with `exact`, built
  elementwise from direct sums `sum_{i < z <= r} g_z` (`_diag_exact`). This is the fallback for chunks
  that decay too fast for `_scores_chunk`, so it is written for few operations (compile time) rather
  than for speed: one product over all block pairs. The decay factors of `_scores` are returned too,
  each from its own direct sum (no factorisation).
  """
  gb, tb, ce = gt.gb, gt.tb, gt.ce
  nb, sub, kd = gb.shape[-3:]
  c = nb * sub
  qb = q.reshape(q.shape[:-2] + (nb, sub, kd))
  kb = k.reshape(k.shape[:-2] + (nb, sub, kd))
  between = _between(tb)                                               # [..., NB(x), NB(y), K]
  x = jnp.arange(nb)[:, None, None, None]
  y = jnp.arange(nb)[None, :, None, None]
  if exact:
    row_f = jnp.exp(gb)                                                # <= 1
    scale = jnp.exp(between)                                           # <= 1
    diag_cols = jnp.zeros_like(kb)
  else:
    m = 0.5 * tb[..., None, :]
    row_f = jnp.exp(gb - m)
    scale = jnp.exp(m[..., :, None, 0, :] + between)                  # exp(m_x + D[x, y]) <= 1
    diag_cols = kb * jnp.exp(m - gb)
  col_off = (kb * jnp.exp(ce))[..., None, :, :, :] * scale[..., :, :, None, :]
  cols = jnp.where(x == y, diag_cols[..., None, :, :, :], jnp.where(y < x, col_off, 0.0))
  rows = jnp.concatenate([qb * row_f, kb * row_f], axis=-2)           # [..., NB, 2SUB, K]
  a = _mm("...xrk,...xyik->...xryi", rows, cols)                      # [..., NB, 2SUB, NB, SUB]
  if exact:
    on_diag = jnp.eye(nb, dtype=bool)[:, None, :, None]                # [NB(x), 1, NB(y), 1]
    a = a + jnp.where(on_diag, _diag_exact(qb, kb, gt.g)[..., :, :, None, :], 0.0)
  lead = a.shape[:-4]
  return (a[..., :, :sub, :, :].reshape(lead + (c, c)), a[..., :, sub:, :, :].reshape(lead + (c, c)),
          jnp.exp(gt.gc), _decay_to_end(tb, ce))


@jax.checkpoint
def _diag_exact(qb, kb, g):
  # [..., NB, SUB(r), SUB(i), K] exponents sum_{i < z <= r} g_z, summed down the rows for every column
  # at once (as many adds as a difference of cumulative gates would take, but no cancellation: a steep
  # row z <= i cannot enter the exponent of the pair (r, i)); e <= 0, so exp needs no mask. XLA fuses
  # this into the reduction, and the backward pass recomputes it rather than storing 16x the size of
  # the inputs.
  sub = g.shape[-2]
  later = (jnp.arange(sub)[:, None] > jnp.arange(sub)[None, :])[:, :, None]
  terms = jnp.where(later, g[..., :, None, :], 0.0)                   # g_r where r > i
  acc = [terms[..., 0, :, :]]
  for r in range(1, sub):
    acc.append(acc[-1] + terms[..., r, :, :])
  causal = (jnp.arange(sub)[:, None] >= jnp.arange(sub)[None, :])[:, :, None]
  e = jnp.where(causal, jnp.exp(jnp.stack(acc, axis=-3)), 0.0)
  ki = kb[..., None, :, :]
  aq = jnp.sum(qb[..., :, None, :] * ki * e, axis=-1)
  ak = jnp.sum(kb[..., :, None, :] * ki * e, axis=-1)
  return jnp.concatenate([aq, ak], axis=-2)                           # [..., NB, 2SUB, SUB]


def _cumsum_rows(x):
  """Inclusive cumulative sum along axis -2 by unrolled adds, in sequential order: XLA CPU lowers
  `jnp.cumsum` to a reduce-window that costs about twice as much on these short (16-row) axes."""
  out = [x[..., 0, :]]
  for i in range(1, x.shape[-2]):
    out.append(out[-1] + x[..., i, :])
  return jnp.stack(out, axis=-2)


def _suffix_rows(x):
  """`sum_{z > i} x[z]` along axis -2 by unrolled adds (exclusive, from the end; see `_cumsum_rows`)."""
  n = x.shape[-2]
  out = [jnp.zeros_like(x[..., 0, :])]
  for i in range(n - 1, 0, -1):
    out.append(out[-1] + x[..., i, :])
  return jnp.stack(out[::-1], axis=-2)


def _chunk_cumsum(gb, tb):
  """Inclusive cumulative gate over the chunk, `[..., NB, SUB, K] -> [..., C, K]`: the sub-block sums
  plus the totals of the earlier sub-blocks (all terms share a sign, so no cancellation)."""
  nb, sub, kd = gb.shape[-3:]
  return (gb + _prefix_before(tb)[..., None, :]).reshape(gb.shape[:-3] + (nb * sub, kd))


def _scores(q, k, gt, diag_mode):
  """Score construction, chosen per chunk at run time from the chunk's decay (see `diag_mode` of
  `kda_chunk_core`): one factorisation per chunk when no document of it decays by more than
  FACTOR_LIMIT nats in any channel, else sub-blocks, their diagonal blocks factored when no sub-block
  decays by more than SUB_FACTOR_LIMIT nats and built elementwise otherwise (`score_level`).

  Returns raw `Aqk, Akk [..., C, C]` and `exp(gc_r)`, `exp(gc_{C-1} - gc_r)` `[..., C, K]` (the decay
  from the first row of r's document in the chunk to r, and, for the rows of the chunk's last
  document, from after row r to the chunk end).
  """
  if diag_mode == "exact":
    return _scores_blocked(q, k, gt, exact=True)
  if diag_mode == "factor":
    return lax.cond(score_level(gt) == 0, _scores_chunk, functools.partial(_scores_blocked, exact=False),
                    q, k, gt)
  return lax.switch(score_level(gt), (_scores_chunk, functools.partial(_scores_blocked, exact=False),
                                      functools.partial(_scores_blocked, exact=True)), q, k, gt)


def score_level(gt) -> jax.Array:
  """Which score construction a chunk's decay allows (`_scores`, diag_mode "auto"), the first that fits
  every batch row and head at once: 0, one factorisation per chunk (no document of the chunk decays by
  more than FACTOR_LIMIT nats in any channel); 1, 16-row sub-blocks with factored diagonal blocks (no
  sub-block decays by more than SUB_FACTOR_LIMIT); 2, sub-blocks with elementwise diagonal blocks (any
  decay: the costliest, each diagonal block `[SUB, SUB, K]` of exponents).

  A model's gates are mostly level 0 or 1: at the fla initialisation (A in [1, 16], dt in [1e-3, 0.1])
  a quarter of the 0.4B model's chunk-heads decay by more than FACTOR_LIMIT over 64 rows, none over 16
  (docs/performance.md), so a chunk step over every row and head rarely fits level 0.
  """
  whole = jnp.all(jnp.min(gt.gc, axis=-2) >= -FACTOR_LIMIT)
  blocks = jnp.all(gt.tb >= -SUB_FACTOR_LIMIT)
  return jnp.where(whole, 0, jnp.where(blocks, 1, 2)).astype(jnp.int32)


INVERSE_FORMS = ("loop", "doubling")


def inverse_form() -> str:
  """How `_unit_lower_inverse` inverts, chosen by the platform traced for: "doubling" on a TPU or GPU
  (no sequential loop: a TPU runs the loop's 15 small dependent steps one after another), "loop" on
  a CPU (the cheaper one there). Both are forward substitution regrouped, exact to float32 rounding
  (tests/kernels/test_chunk_math.py); the GPU's choice is not measured."""
  return "doubling" if target_platform() in ("tpu", "gpu") else "loop"


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _unit_lower_inverse(lmat, form):
  """Inverse `X` of unit lower-triangular `[..., C, C]` (`_unit_lower_inverse_by`), differentiated as
  the inverse, not through the algorithm: `dX = -X tril(dL, -1) X` (only the strictly lower entries of
  `lmat` are read). Its transpose, the backward pass, is two `C x C` products,
  `tril(-X^T dX X^T, -1)`, where autodiff through the doubling form took about twice its 10."""
  return _unit_lower_inverse_by(lmat, form)


@_unit_lower_inverse.defjvp
def _unit_lower_inverse_jvp(form, primals, tangents):
  (lmat,), (dl,) = primals, tangents
  x = _unit_lower_inverse(lmat, form)
  c = lmat.shape[-1]
  dl = jnp.where(jnp.arange(c)[:, None] > jnp.arange(c)[None, :], dl, 0.0)
  return x, -_mm("...ij,...jk->...ik", x, _mm("...ij,...jk->...ik", dl, x))


def _unit_lower_inverse_by(lmat, form):
  """Inverse of unit lower-triangular `[..., C, C]` (C = 16 * 2^j), by `form` (`inverse_form()`):

  - "loop": forward substitution inside the 16-row diagonal blocks (a 15-step loop, all blocks at
    once), then blockwise doubling `X21 = -X22 L21 X11` (the order of LAPACK trtri);
  - "doubling": the kernels' recursive block inversion from 2-row blocks
    (`_chunk_math.unit_lower_inverse`: 2 (log2 C - 1) masked C x C matmuls) over the leading axes.

  Not a power series: the Neumann product (I - N)(I + N^2)(I + N^4)(I + N^8) is loop-free too, but
  loses ~3 digits for nearly parallel keys (tests/kernels/test_chunk_math.py).
  """
  c = lmat.shape[-1]
  if form == "doubling":
    strict = lmat - jnp.eye(c, dtype=lmat.dtype)
    return jax.vmap(cm.unit_lower_inverse)(strict.reshape((-1, c, c))).reshape(lmat.shape)
  nb = c // SUB
  lead = lmat.shape[:-2]
  blocks = jnp.stack([lmat[..., i * SUB:(i + 1) * SUB, i * SUB:(i + 1) * SUB] for i in range(nb)], -3)
  strict = jnp.where(jnp.arange(SUB)[:, None] > jnp.arange(SUB)[None, :], blocks, 0.0)
  eye = jnp.eye(SUB, dtype=lmat.dtype)

  def row_step(r, x):  # row r of the inverse from the rows above it (rows >= r are still e_j)
    l_r = lax.dynamic_index_in_dim(strict, r, axis=-2, keepdims=False)       # [..., NB, SUB]
    row = lax.dynamic_index_in_dim(eye, r, axis=0, keepdims=False) - _mm("...j,...jc->...c", l_r, x)
    return lax.dynamic_update_index_in_dim(x, row, r, axis=-2)

  x = lax.fori_loop(1, SUB, row_step, jnp.broadcast_to(eye, blocks.shape))
  size = SUB
  while size < c:
    m = c // (2 * size)
    x = x.reshape(lead + (m, 2, size, size))
    x11, x22 = x[..., 0, :, :], x[..., 1, :, :]
    l21 = jnp.stack([lmat[..., (2 * j + 1) * size:(2 * j + 2) * size, 2 * j * size:(2 * j + 1) * size]
                     for j in range(m)], axis=-3)
    x21 = -_mm("...ij,...jk->...ik", x22, _mm("...ij,...jk->...ik", l21, x11))
    top = jnp.concatenate([x11, jnp.zeros_like(x11)], axis=-1)
    bot = jnp.concatenate([x21, x22], axis=-1)
    x = jnp.concatenate([top, bot], axis=-2)
    size *= 2
  return x.reshape(lead + (c, c))


class _ChunkPrep(NamedTuple):
  """Elementwise per-chunk quantities (`[..., H, C, D]` head-major, float32, padding rows zero)."""

  qh: jax.Array     # q * scale
  kh: jax.Array
  vh: jax.Array
  bh: jax.Array     # [..., H, C, 1] beta
  g: jax.Array      # [..., H, C, K] log decay (0 on padding)
  egl: jax.Array    # [..., H, C, K] decay from the first row of r's document in the chunk to r (inclusive)
  same: jax.Array   # [..., C, C] rows r and i belong to the same document (not padding)
  dte: jax.Array    # [..., H, C, K] decay from after row r to the chunk end (rows of its last document)


def _chunk_prep(q, k, v, g, beta, seg, *, scale, prep=None, diag_mode="auto"):
  """Upcasts, masks padding (NaN-safe), applies `prep`, builds the cumulative gates of a chunk and its
  raw scores. Returns `(_ChunkPrep, Aqk, Akk)` (scores unmasked, see `_scores`).

  Args: q, k, g `[..., C, H, K]`, v `[..., C, H, V]`, beta `[..., C, H]` (any float dtype);
  seg int32 `[..., C]`; scale: the query scale; prep: see `kda_chunk_core`.
  """
  valid = seg > 0
  q, k, g = (x.astype(jnp.float32) for x in (q, k, g))
  if prep is not None:
    q, k, g = prep(q, k, g)
  hm = lambda x: jnp.swapaxes(x, -3, -2)                                          # -> [..., H, C, D]
  clean = lambda x: jnp.where(valid[..., None, None], x.astype(jnp.float32), 0.0)
  g = clean(g)
  qh, kh, vh, gh = hm(clean(q) * scale), hm(clean(k)), hm(clean(v)), hm(g)
  bh = jnp.swapaxes(jnp.where(valid[..., None], beta.astype(jnp.float32), 0.0), -1, -2)[..., None]
  same = (seg[..., :, None] == seg[..., None, :]) & valid[..., :, None]
  gates = chunk_gates(g, seg)
  aqk, akk, egl, dte = _scores(qh, kh, gates, diag_mode)
  aqk = _exact_diagonal(aqk, qh, kh)
  return _ChunkPrep(qh, kh, vh, bh, gh, egl, same, dte), aqk, akk


def _exact_diagonal(aqk, qh, kh):
  """`Aqk` with its diagonal set to `q~_r . k_r` (the exponent there is exactly 0).

  The factored score paths form it as `exp(x) exp(-x)`: its derivative in the gate is two O(|q k|)
  terms that cancel only to float32 rounding, which leaves ~1e-8 in `dg` where a steep gate's true
  `dg` is itself ~1e-8 (found by a new user's check against the reference: 19 % of max |dg|).
  Args: aqk `[..., H, C, C]`; qh (scaled), kh `[..., H, C, K]`.
  """
  c = aqk.shape[-1]
  return jnp.where(jnp.eye(c, dtype=bool), jnp.sum(qh * kh, axis=-1)[..., :, None], aqk)


def chunk_gates(g, seg) -> _Gates:
  """The gate sums of a chunk (`_Gates`, head-major) from its per-row log decay.

  Args: g float32 `[..., C, H, K]` (<= 0, zero on padding rows); seg int32 `[..., C]` (0 = padding).
  """
  c, _, kd = g.shape[-3:]
  nb = c // SUB
  valid = seg > 0
  same = (seg[..., :, None] == seg[..., None, :]) & valid[..., :, None]
  causal = jnp.arange(c)[:, None] >= jnp.arange(c)[None, :]
  gh = jnp.swapaxes(g, -3, -2)
  g_blocks = gh.reshape(gh.shape[:-2] + (nb, SUB, kd))
  gb = _cumsum_rows(g_blocks)
  tb = gb[..., -1, :]
  # The cumulative gate restarts at each document's first row, inside the chunk too: with a document
  # start after row 0 it is the masked (same document, causal) sum, else the chunk's cumulative sum.
  # Either way a direct sum of the document's own gates, so no other document's decay enters it.
  starts_inside = jnp.any(seg[..., 1:] != seg[..., :-1])
  gc = lax.cond(starts_inside,
                lambda: jnp.swapaxes(_mm("...ri,...ihk->...rhk", (same & causal).astype(jnp.float32), g),
                                     -3, -2),
                lambda: _chunk_cumsum(gb, tb))
  return _Gates(g_blocks, gb, _suffix_rows(g_blocks), tb, gc)


def _mask_and_inverse(cp, aqk, akk, inverse):
  """Masked `Aqk [..., H, C, C]` and `L^-1 = (I + Diag(beta) Akk)^-1` of a chunk."""
  c = cp.qh.shape[-2]
  causal = jnp.arange(c)[:, None] >= jnp.arange(c)[None, :]
  strict = jnp.arange(c)[:, None] > jnp.arange(c)[None, :]
  same_h = cp.same[..., None, :, :]
  aqk = jnp.where(same_h & causal, aqk, 0.0)
  akk = jnp.where(same_h & strict, akk, 0.0)
  return aqk, _unit_lower_inverse(jnp.eye(c, dtype=jnp.float32) + cp.bh * akk, inverse)


def chunk_matrices(q, k, v, g, beta, seg, *, scale, prep=None, diag_mode="auto", inverse="loop"):
  """A chunk's state-independent quantities, as the chunk scan computes them: `(cp, Aqk, L^-1)`.

  Args: as `_chunk_prep` (q, k, g `[..., C, H, K]`, v `[..., C, H, V]`, beta `[..., C, H]`, seg int32
  `[..., C]`); inverse: `INVERSE_FORMS`.

  Returns: `_ChunkPrep`, the masked `Aqk` and `(I + Diag(beta) Akk)^-1` `[..., H, C, C]` float32.
  """
  cp, aqk, akk = _chunk_prep(q, k, v, g, beta, seg, scale=scale, prep=prep, diag_mode=diag_mode)
  aqk, linv = _mask_and_inverse(cp, aqk, akk, inverse)
  return cp, aqk, linv


def _decay_to_end(tb, ce):
  """exp(sum_{z > i} g_z) over the chunk for every row i, `[..., C, K]`: the row's own sub-block suffix
  `ce` plus the totals of the later sub-blocks (direct sums)."""
  return jnp.exp(ce + _suffix_after(tb)[..., None, :]).reshape(ce.shape[:-3] + (-1, ce.shape[-1]))


def _slot_spans(seg, n_slots):
  """First and last position of each label 1..N in each row: `[B, N]` int32, and presence."""
  tp = seg.shape[1]
  pos = jnp.arange(tp, dtype=jnp.int32)
  last = jax.vmap(lambda s: jax.ops.segment_max(pos, s, num_segments=n_slots + 1))(seg)[:, 1:]
  first = jax.vmap(lambda s: jax.ops.segment_min(pos, s, num_segments=n_slots + 1))(seg)[:, 1:]
  present = (last >= 0) & (last < tp)
  return jnp.where(present, first, 0), jnp.where(present, last, -1), present


def carry_schedule(segc):
  """Which document is carried across each chunk edge, and where it closes.

  Args:
    segc: int32 `[NC, B, C]` labels by chunk (0 = padding).

  Returns:
    `(cont_lab, last_is_cont, cont_closes)`, `[NC, B]` each: the label of the document continued
    from the previous chunk (0 when the chunk's first row starts a document or is padding), whether
    that document is still open at the chunk's last row, and whether it closes inside the chunk.
  """
  b = segc.shape[1]
  zeros = jnp.zeros((1, b), jnp.int32)
  prev_last = jnp.concatenate([zeros, segc[:-1, :, -1]], axis=0)
  next_first = jnp.concatenate([segc[1:, :, 0], zeros], axis=0)
  first_lab, last_lab = segc[:, :, 0], segc[:, :, -1]
  cont_lab = jnp.where((first_lab == prev_last) & (first_lab > 0), first_lab, 0)
  last_is_cont = (cont_lab > 0) & (last_lab == cont_lab)
  cont_closes = (cont_lab > 0) & ~(last_is_cont & (next_first == cont_lab))
  return cont_lab, last_is_cont, cont_closes


def chunk_with_state(cp, aqk, linv, s, sx, cl, lic, corr, out_precision):
  """One chunk's state-dependent work: the carried state `s` applied to the rows of the document it
  continues, the per-token deltas, the output and the state leaving the chunk.

  Args:
    cp: the chunk's `_ChunkPrep` (leading `[B]`); aqk, linv: its masked `Aqk` and
      `(I + Diag(beta) Akk)^-1` `[B, H, C, C]` (`_mask_and_inverse`).
    s: float32 `[B, H, K, V]` the state of the document open at the chunk's first edge (any finite
      value where no document continues: it then multiplies only zeros).
    sx: int32 `[B, C]` the chunk's labels; cl, lic: `[B]` its row of `carry_schedule`.
    corr: None, or `[B, H, 2C, V]` the initial-state terms of documents that start inside the chunk
      (`kgb S_in` rows, then `qd S_in` rows).
    out_precision: the precision of the `Aqk Vnew` product.

  Returns:
    `(s_next [B, H, K, V], o [B, H, C, V] float32, vnew [B, H, C, V], dec [B, H, K, 1])`: s_next
    without the initial state of a document that starts inside the chunk and is open at its end
    (the caller adds `dec` times it).
  """
  c = cp.qh.shape[-2]
  cont = ((sx == cl[:, None]) & (cl[:, None] > 0))[:, None, :, None]
  last = ((sx == sx[:, -1:]) & (sx[:, -1:] > 0))[:, None, :, None]
  qk = jnp.concatenate([jnp.where(cont, cp.bh * cp.kh * cp.egl, 0.0),
                        jnp.where(cont, cp.qh * cp.egl, 0.0)], axis=-2)            # [B, H, 2C, K]
  xw = _mm("bhrk,bhkv->bhrv", qk, s)                                             # kgb S, qd S
  r = cp.bh * cp.vh - xw[..., :c, :]
  o = xw[..., c:, :]
  if corr is not None:
    r = r - corr[..., :c, :]
    o = o + corr[..., c:, :]
  vnew = _mm("bhri,bhiv->bhrv", linv, r)                                         # per-token deltas
  o = o + _mm("bhri,bhiv->bhrv", aqk, vnew, out_precision)
  # The state leaving the chunk decays the carried state if the carried document is still open at
  # its end, else starts from the deltas of the document that is (the selects act on [B, H, K, 1]
  # factors, not on the [B, H, K, V] states).
  dec = cp.egl[..., c - 1, :, None]                                              # [B, H, K, 1]
  kept = lic[:, None, None, None]
  kd_last = jnp.where(last, cp.kh * cp.dte, 0.0)
  s_next = jnp.where(kept, dec, 0.0) * s + _mm("bhik,bhiv->bhkv", kd_last, vnew)
  return s_next, o, vnew, dec


def kda_chunk_core(q, k, v, g, beta, seg, h0, *, scale, n_slots, want_final, diag_mode="auto",
                   prep=None, chunk=CHUNK, group=1, out_dtype=None, inverse=None):
  """The segment-native chunked KDA algorithm on validated, activated inputs.

  Shared by `kda_chunked` (training, differentiated by JAX) and `kda_inference_xla` (forward).
  One `lax.scan` step per chunk does all of that chunk's work for every batch row and head (the
  working set stays in cache); the carry is the state of the document open at the chunk edge plus,
  when final states are wanted, one slot buffer written only where a carried document closes.

  Args:
    q, k, g: `[B, T, H, K]` (g <= 0, activated); v: `[B, T, H, V]`; beta: `[B, T, H]`; any float
      dtype (upcast to float32 once). seg: int32 `[B, T]` labels (0 = padding).
    h0: float32 `[B, N, H, K, V]` or None (zeros).
    scale: Python float multiplying q. n_slots: N. want_final: also return `[B, N, H, K, V]` states.
    diag_mode: how a chunk that decays by more than FACTOR_LIMIT nats (per channel) builds its scores:
      "auto" elementwise diagonal sub-blocks (safe for any decay); "factor" midpoint-factored
      sub-blocks (only valid when every 16-row sub-block decays by at most FACTOR_LIMIT, e.g. a
      bounded gate); "exact" always the elementwise sub-blocks (no run-time choice).
    prep: optional `(q, k, g) -> (q, k, g)` applied per chunk to the float32 inputs before anything
      else (the in-kernel gate activation and q/k L2 norm of `kda_inference_xla`, fused this way
      into the chunk's elementwise work instead of extra passes over the whole sequence).
    chunk: rows per chunk, a multiple of 16.
    group: chunks per scan step. The state-independent work of the `group` chunks (gates, scores,
      inverses) is done together, then the state is carried through them one by one: fewer, larger
      operations per step with the working set still in cache (the XLA forward uses 2). The sequence
      is padded with padding chunks to a multiple of `group` chunks. A run-time choice inside
      `_chunk_prep` (score path, documents starting inside a chunk) is then made for the group: the
      general path whenever one of its chunks needs it (exact for all of them).
    out_dtype: dtype of o (default q's); float32 forms `Aqk Vnew` at HIGHEST precision, another
      dtype at DEFAULT.
    inverse: the unit-lower inverse's form, "loop" or "doubling" (`_unit_lower_inverse`); None:
      `inverse_form()` of the platform traced for.

  Returns:
    `(o [B, T, H, V] in out_dtype, final [B, N, H, K, V] float32 or None)`.
  """
  if diag_mode not in DIAG_MODES:
    raise ValueError(f"diag_mode must be one of {DIAG_MODES}, got {diag_mode!r}")
  inverse = inverse_form() if inverse is None else inverse
  if inverse not in INVERSE_FORMS:
    raise ValueError(f"inverse must be one of {INVERSE_FORMS} or None, got {inverse!r}")
  if chunk % SUB or chunk < SUB:
    raise ValueError(f"chunk must be a positive multiple of {SUB}, got {chunk}")
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  c = chunk
  tp = -(-t // (c * group)) * (c * group)
  nc = tp // c
  pad = tp - t
  seg = jnp.pad(seg.astype(jnp.int32), ((0, 0), (0, pad)))

  def layout(x):  # padded, [NC, B, C, ...] (a free reshape when B = 1 and T is a multiple of C)
    x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)) if pad else x
    return jnp.moveaxis(x.reshape((b, nc, c) + x.shape[2:]), 1, 0)

  qc, kc, vc, gc, bc = layout(q), layout(k), layout(v), layout(g), layout(beta)
  segc = jnp.moveaxis(seg.reshape(b, nc, c), 1, 0)                               # [NC, B, C]

  cont_lab, last_is_cont, cont_closes = carry_schedule(segc)
  slot = lambda lab: jnp.clip(lab - 1, 0, n_slots - 1)
  bidx = jnp.arange(b)
  labels = jnp.arange(1, n_slots + 1, dtype=jnp.int32)
  first, lastpos, present = _slot_spans(seg, n_slots)
  chunk_prep = functools.partial(_chunk_prep, scale=scale, prep=prep, diag_mode=diag_mode)
  gat = lambda x, ci: x[ci, bidx[:, None]]                                       # [NC, B, ...] -> [B, N, ...]
  rows_of = lambda seg_n: seg_n == labels[None, :, None]                         # [B, N, C]
  prepared = []

  def prep_all():
    """Every chunk prepared once (`_ChunkPrep` with leading `[NC, B]`), built on first use."""
    if not prepared:
      prepared.append(chunk_prep(qc, kc, vc, gc, bc, segc)[0])
    return prepared[0]

  def prep_at(ci):
    """The prepared chunk `ci [B, N]` of every slot, `_ChunkPrep` with leading `[B, N]`."""
    if nc > n_slots:
      return chunk_prep(gat(qc, ci), gat(kc, ci), gat(vc, ci), gat(gc, ci), gat(bc, ci), gat(segc, ci))[0]
    # No more chunks than slots (a short row over a large slot pool: the serving engine's mixed steps
    # carry one-token decode segments of every slot): preparing each chunk once and gathering costs
    # NC chunk preparations instead of N (equal up to float32 rounding: the gate path a prepared
    # batch takes depends on whether any of its chunks holds a document start).
    return jax.tree.map(lambda x: gat(x, ci), prep_all())

  # Documents that start inside a chunk enter it with their own initial state: their rows' part of
  # `kgb S_in` and `qd S_in` is computed here (per row for short rows, else one gathered chunk per
  # slot) and scattered into the scan inputs (the carried state only ever multiplies the rows of the
  # carried document).
  corr = None
  init = h0 if h0 is not None else jnp.zeros((b, n_slots, h, kd, vd), jnp.float32)
  if h0 is not None:
    c_s = jnp.clip(first // c, 0, nc - 1)
    if tp <= 4 * n_slots:
      # Rows at most four times the slots (decode-sized rows over a slot pool): each row takes its own
      # slot's state, T row-products instead of N gathered 2C-row chunk products.
      pa = prep_all()
      lab = jnp.clip(segc - 1, 0, n_slots - 1)                                   # [NC, B, C]
      enters = (segc > 0) & (jnp.arange(nc)[:, None, None] == c_s[bidx[:, None], lab])
      hrow = h0[bidx[None, :, None], lab]                                        # [NC, B, C, H, K, V]
      mask = enters[:, :, None, :, None]
      kq = (jnp.where(mask, pa.bh * pa.kh * pa.egl, 0.0), jnp.where(mask, pa.qh * pa.egl, 0.0))
      corr = jnp.concatenate([_mm("nbhck,nbchkv->nbhcv", x, hrow) for x in kq], axis=-2)
    else:
      seg_s = gat(segc, c_s)
      ps = prep_at(c_s)
      rows = (rows_of(seg_s) & present[..., None])[:, :, None, :, None]
      both = jnp.concatenate([jnp.where(rows, ps.bh * ps.kh * ps.egl, 0.0),
                              jnp.where(rows, ps.qh * ps.egl, 0.0)], axis=-2)    # [B, N, H, 2C, K]
      x = _mm("bnhrk,bnhkv->bnhrv", both, h0)
      corr = jnp.zeros((nc, b, h, 2 * c, vd), jnp.float32).at[c_s, bidx[:, None]].add(x)

  def step(carry, xs):
    cp_all, aqk_all, linv_all = chunk_matrices(*xs[:6], scale=scale, prep=prep, diag_mode=diag_mode,
                                               inverse=inverse)
    outs = []
    for j in range(group):  # the state recurrence, one chunk after the other
      at = lambda x: x[j]
      carry, o = chunk_step(carry, jax.tree.map(at, xs), jax.tree.map(at, cp_all), aqk_all[j],
                            linv_all[j])
      outs.append(o)
    return carry, jnp.stack(outs)

  def chunk_step(carry, xs, cp, aqk, linv):
    s, buf = carry
    sx, cl, lic, cc = xs[5:9]
    s_next, o, vnew, dec = chunk_with_state(cp, aqk, linv, s, sx, cl, lic,
                                            None if corr is None else xs[9], out_precision)
    kept = lic[:, None, None, None]
    if h0 is not None:
      s_next = s_next + jnp.where(kept, 0.0, dec) * h0[bidx, slot(sx[:, -1])]
    if buf is not None:
      def save(bufs):
        sbuf, vbuf = bufs
        sc = slot(cl)
        sbuf = sbuf.at[bidx, sc].set(jnp.where(cc[:, None, None, None], s, sbuf[bidx, sc]))
        vbuf = vbuf.at[bidx, xs[-1]].set(vnew)  # kept only for chunks where a document ends
        return sbuf, vbuf
      # Most chunks neither close a carried document nor end one: they skip the read-modify-write of
      # a [B, H, K, V] slot (as costly as a third of the chunk's matmuls on CPU).
      buf = lax.cond(jnp.any(cc) | jnp.any(xs[-1] < n_slots), save, lambda bufs: bufs, buf)
    return (s_next, buf), jnp.swapaxes(o, 1, 2).astype(out_dtype)               # [B, C, H, V]

  out_dtype = q.dtype if out_dtype is None else jnp.dtype(out_dtype)
  out_precision = _HI if out_dtype == jnp.float32 else lax.Precision.DEFAULT
  xs = (qc, kc, vc, gc, bc, segc, cont_lab, last_is_cont, cont_closes)
  if corr is not None:
    xs = xs + (corr,)
  s0 = jnp.zeros((b, h, kd, vd), jnp.float32)
  buf0 = None
  if want_final:
    # The deltas of a chunk where some document ends are kept in a compact buffer: entry j of row b
    # is the j-th such chunk (at most N), entry N a sink for every other chunk.
    c_e = jnp.clip(lastpos // c, 0, nc - 1)
    needed = jnp.zeros((b, nc), jnp.int32).at[bidx[:, None], c_e].add(present.astype(jnp.int32)) > 0
    keep_idx = jnp.where(needed, jnp.cumsum(needed, axis=1) - 1, n_slots).astype(jnp.int32)
    xs = xs + (keep_idx.T,)
    buf0 = (jnp.zeros((b, n_slots, h, kd, vd), jnp.float32),
            jnp.zeros((b, n_slots + 1, h, c, vd), jnp.float32))
  grouped = jax.tree.map(lambda x: x.reshape((nc // group, group) + x.shape[1:]), xs)
  # Differentiated (training), the scan step is rematerialised: the backward pass keeps only each
  # step's inputs (the chunk's rows and the state entering it, `[B, H, K, V]`) and recomputes the
  # chunk's gates, scores, inverse and sub-block tensors from them, one chunk at a time. Without it
  # autodiff stacks every chunk's intermediates (the loop inverse's 15 forward-substitution steps, the
  # `[NB, NB, SUB, K]` sub-block columns of both score paths) for the whole sequence. The recomputed
  # values are the same operations on the same inputs, so the gradients are unchanged.
  (_, buf), o = lax.scan(jax.checkpoint(step, prevent_cse=False), (s0, buf0), grouped)
  o = jnp.moveaxis(o.reshape((nc,) + o.shape[2:]), 0, 1).reshape(b, tp, h, vd)[:, :t]
  if not want_final:
    return o, None

  # Final states, one gathered chunk per slot: the chunk holding the document's last row e, from the
  # state that entered it (the carry saved by the scan, or the initial state) and the saved deltas:
  # S_e = exp(G_e - G_a) S_in + sum_{i in doc} (k_i exp(G_e - G_i)) Vnew_i^T.
  sbuf, vbuf = buf
  e_row = jnp.clip(lastpos - c_e * c, 0, c - 1)
  seg_e = gat(segc, c_e)
  pe = prep_at(c_e)
  e_b = jnp.broadcast_to(e_row[:, :, None], (b, n_slots, h))
  kd_n = jnp.where(rows_of(seg_e)[:, :, None, :, None], pe.kh * _decay_to_row(pe.g, e_b), 0.0)
  dec_n = jnp.take_along_axis(pe.egl, e_b[..., None, None], axis=-2)[..., 0, :]   # [B, N, H, K]
  s_base = jnp.where((first < c_e * c)[:, :, None, None, None], sbuf, init)
  vnew_n = vbuf[bidx[:, None], jnp.take_along_axis(keep_idx, c_e, axis=1)]      # [B, N, H, C, V]
  final = dec_n[..., None] * s_base + _mm("bnhik,bnhiv->bnhkv", kd_n, vnew_n)
  return o, jnp.where(present[:, :, None, None, None], final, init)


def chunk_prep(gate, lower_bound, use_l2norm: bool):
  """The in-op input stage of `kda_chunk_core` (its `prep`), or None when there is nothing to do:
  float32 chunks `(q, k, g)` `[..., C, H, K]` -> L2-normalised q and k (`use_l2norm`) and the activated
  gate (`gate` = (a_log, dt_bias) given, with `lower_bound`), run inside each (rematerialised) scan step."""
  if not use_l2norm and gate is None:
    return None

  def prep(qc, kc, gc):
    if use_l2norm:
      qc, kc = l2norm(qc), l2norm(kc)
    if gate is not None:
      gc = activate_gate(gc, gate[0], gate[1], lower_bound)
    return qc, kc, gc
  return prep


@functools.partial(jax.jit, static_argnames=("scale", "n_slots", "want_final", "diag_mode", "lower_bound",
                                             "use_l2norm", "inverse"))
def _chunked_jit(q, k, v, g, beta, seg, h0, gate, *, scale, n_slots, want_final, diag_mode, lower_bound=None,
                 use_l2norm=False, inverse):
  # With the in-op L2 norm the op computes with the float32 normalised q (as `l2norm` of the
  # unfused route returns it), so o is formed in float32 whatever q's dtype; the caller casts it.
  return kda_chunk_core(q, k, v, g, beta, seg, h0, scale=scale, n_slots=n_slots, want_final=want_final,
                        diag_mode=diag_mode, prep=chunk_prep(gate, lower_bound, use_l2norm),
                        out_dtype=jnp.float32 if use_l2norm else None, inverse=inverse)


# kda_chunked's implementations besides this module's XLA chunk scan: name -> module, imported only
# when chosen (as `kda_inference`'s table): the TPU one runs the Mosaic kernel's wrapper.
TRAIN_IMPLEMENTATION_MODULES = {"pallas_tpu": "kda_plugin.ops.chunked_tpu"}
TRAIN_IMPLEMENTATIONS = ("xla", *TRAIN_IMPLEMENTATION_MODULES)


def kda_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                segment_ids=None, max_num_segments=None, a_log=None, dt_bias=None, lower_bound=None,
                use_qk_l2norm=False, num_heads=None, implementation="xla", interpret=False):
  """KDA in the chunked WY/UT form (chunk 64), differentiable with JAX autodiff (the training path).

  Equal to `kda_reference` (the token recurrence, docs/kda.md section 'Token recurrence') up to float32
  rounding; packed documents are solved in place by the masked chunk equations of
  docs/packing.md section 'Segment-native chunk algorithm' (no re-alignment, no per-token loop). State and
  accumulation are float32 whatever the input dtype; outputs and gradients stay finite under any
  decay (exponents are masked before `exp`).

  Boundaries and steep gates: the cumulative gate restarts at every document's first row, inside a
  chunk too, and every decay exponent is a direct sum of the gates it spans, so a document's output
  and final state do not depend on the decay of the documents packed before it (beyond float32
  rounding of its own terms), and a gate steep enough to underflow (log decay <= -104) beside mild
  ones costs no precision (no exponent is a difference of large sums), at any head dim. The one
  factorisation left (`_scores_chunk`, chunks whose documents decay by at most FACTOR_LIMIT nats)
  rounds each score relative to at most FACTOR_LIMIT * 2^-24 (~5e-6).

  Args:
    q, k: `[B, T, H, K]` float32 or bfloat16 (any T; padded to a multiple of 64 internally).
    v: `[B, T, H, V]`.
    g: `[B, T, H, K]` log-space decay (<= 0, nats per token), already activated.
    beta: `[B, T, H]` in [0, 1].
    scale: query scale (a Python float), default K**-0.5.
    initial_state: float32 `[B, N, H, K, V]` with `segment_ids`, else `[B, H, K, V]`; zeros if None.
    output_final_state: also return the final state(s).
    segment_ids: int32 `[B, T]` or `[T]`; 0 = padding, label n uses state slot n-1.
    max_num_segments: N (static); inferred from initial_state or concrete segment_ids when None.
    a_log: `[H]` per-head log decay rate; turns on the in-op gate: `g` is then the raw gate input
      (`f_b_proj(f_a_proj(x))`), activated in float32 per chunk by `gates.activate_gate`.
    dt_bias: `[H*K]` or `[H, K]` gate bias (with a_log only), zeros if None.
    lower_bound: static float in [-5, 0) selecting the bounded gate (with a_log only).
    use_qk_l2norm: L2-normalise q and k per head inside the op (`gates.l2norm`, float32).
    num_heads: H, static; given exactly when q, k, v, g come lane-dense `[B, T, H*D]` (o leaves in
      that layout too).
    implementation: "xla" (this module: forward and backward by JAX autodiff of the chunk scan) or
      "pallas_tpu" (`chunked_tpu`: the Mosaic kernel's forward, which also returns the state
      entering every chunk, and a backward kernel from those states; a TPU, or `interpret`; no
      initial_state and no output_final_state).
    interpret: with "pallas_tpu", simulate the kernel on CPU: True runs Pallas' generic interpreter
      (which `jax.checkpoint` can differentiate, as the model's remat does), or pass a
      `pltpu.InterpretParams` for the TPU interpreter (whose effects remat refuses).

  The in-op gate and L2 norm are applied per chunk inside the rematerialised scan step, so training
  keeps only q, k, v and the raw gate in their own dtype (bfloat16 in a bfloat16 model) for the
  backward pass, not float32 copies of the normalised q, k and the activated gate; the values are
  those of applying `activate_gate` and `l2norm` first (the same float32 operations per row).

  Returns:
    `(o, final_state)`: o `[B, T, H, V]` (`[B, T, H*V]` with num_heads) in q's dtype (exactly 0 on
    padding); final_state float32 in initial_state's layout (a label never present keeps its
    initial state), or None. Differentiable in reverse mode (`jax.grad`, `jax.vjp`) by both
    implementations; forward mode (`jax.jvp`) by "xla" only ("pallas_tpu" is a custom VJP).

  Raises:
    ValueError, TypeError: see `kda_plugin.ops._contract.check_kda_inputs` and `check_gate_args`
      (dt_bias or lower_bound without a_log, lower_bound outside [-5, 0), a_log / dt_bias sizes);
      an unknown implementation; "pallas_tpu" with initial_state or output_final_state, or beyond
      the kernel's limits (`inference_tpu.check`).
    RuntimeError: "pallas_tpu" on a platform that is not a TPU, without interpret.
  """
  if implementation not in TRAIN_IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {TRAIN_IMPLEMENTATIONS}, got {implementation!r}")
  if interpret is not False and implementation != "pallas_tpu":
    raise ValueError(f"interpret simulates the 'pallas_tpu' kernel; implementation={implementation!r} "
                     "has none (drop interpret)")
  g_is_raw = a_log is not None
  p = check_kda_inputs(q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids,
                       max_num_segments=max_num_segments, scale=scale, g_is_raw=g_is_raw,
                       num_heads=num_heads)
  lb = check_gate_args(g_is_raw, a_log, dt_bias, lower_bound, p.num_heads, p.key_dim)
  if implementation != "xla":
    impl = importlib.import_module(TRAIN_IMPLEMENTATION_MODULES[implementation])
    return impl.run_validated(p, q, k, v, g, beta, segment_ids, initial_state, output_final_state, scale,
                              a_log, dt_bias, lb, use_qk_l2norm, num_heads, interpret)
  if num_heads is not None:  # the chunk scan works head-major
    o, final = kda_chunked(*(x.reshape(x.shape[:2] + (num_heads, -1)) for x in (q, k, v, g)), beta,
                           scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, segment_ids=segment_ids,
                           max_num_segments=max_num_segments, a_log=a_log, dt_bias=dt_bias,
                           lower_bound=lower_bound, use_qk_l2norm=use_qk_l2norm)
    return o.reshape(o.shape[:2] + (-1,)), final
  gate = None
  if g_is_raw:
    dt = jnp.zeros((p.num_heads * p.key_dim,), jnp.float32) if dt_bias is None else dt_bias
    gate = (jnp.asarray(a_log, jnp.float32), jnp.asarray(dt, jnp.float32))
  core = lambda seg, h0, sc, n: _chunked_jit(q, k, v, g, beta, seg, h0, gate, scale=sc, n_slots=n,
                                             want_final=bool(output_final_state), diag_mode="auto",
                                             lower_bound=lb, use_l2norm=bool(use_qk_l2norm),
                                             inverse=inverse_form())
  return run_with_slots(p, q, initial_state, scale, output_final_state, core)


def run_with_slots(p, q, initial_state, scale, output_final_state, core):
  """Shared wrapper of every entry to the chunk core: lays out segments and slots, calls `core`,
  restores the contract (q's dtype, the final-state layout of `initial_state`).

  `core(seg [B, T] int32, h0 [B, N, H, K, V] float32 | None, scale: float, n_slots: int)` returns
  `(o, final [B, N, H, K, V])`; without segment_ids everything runs as one slot labelled 1.
  """
  if scale is not None and not is_concrete(scale):
    raise ValueError("scale must be a static Python float, not a traced value")
  scale = float(default_scale(scale, p.key_dim))
  packed = p.segment_ids is not None
  n = p.num_segments if packed else 1
  seg = p.segment_ids if packed else jnp.ones((p.batch, p.seq_len), jnp.int32)
  h0 = None
  if initial_state is not None:
    h0 = jnp.asarray(initial_state, jnp.float32)
    if not packed:
      h0 = h0[:, None]
  o, final = core(seg, h0, scale, n)
  o = o.astype(jnp.asarray(q).dtype)
  if not output_final_state:
    return o, None
  return o, (final if packed else final[:, 0])
