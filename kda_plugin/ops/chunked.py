"""KDA in the chunked WY/UT form (chunk 64), with packed documents solved natively.

Math: ../shared/docs/kda.md section 2 (the chunk equations) and ../shared/docs/segment_native_chunk.md
(the masked form for chunks that hold several documents); Kimi Linear tech report (arXiv 2510.26692)
section 6. Per head and chunk, with `G` the inclusive cumulative gate of the chunk (g = 0 on padding):

    Akk[r,i] = same[r,i] [r > i]  sum_d k_r k_i exp(G_r - G_i)
    Aqk[r,i] = same[r,i] [r >= i] sum_d q~_r k_i exp(G_r - G_i)
    L = I + Diag(beta) Akk          (block-diagonal over documents, unit lower triangular)
    R = beta * (V - (K * exp(G - G_a)) S_in)        (the pre-solve residual, one row per token)
    Vnew = L^-1 R                   (the per-token deltas of the delta rule)
    O = (q~ * exp(G - G_a)) S_in + Aqk Vnew = (q~ * exp(G - G_a)) S_in + (Aqk L^-1) R
    S_out = exp(G_e - G_a) S_in + (L^-T (K * exp(G_e - G)))^T R   (for a document ending at row e)

where `S_in` is the state of the row's document when it enters the chunk and `G_a` the cumulative gate
just before that document's first row in the chunk. Folding `L^-1` into `P = Aqk L^-1` and
`Kd' = L^-T Kd` (both computed for all chunks at once) leaves three `C x K x V` products per chunk in
the sequential scan: `[beta K_g; Q_d] S`, `P R` and `Kd'^T R`.

Numerics: every exponential is of a non-positive exponent except in the optional midpoint
factorisation of the diagonal 16-row sub-blocks, which is used only where every sub-block's decay is
at most `FACTOR_LIMIT` nats per channel (a runtime `lax.cond`, or statically for bounded gates);
otherwise those sub-blocks are built elementwise with the exponent masked before `exp` (double
`where`), so outputs and gradients stay finite under any decay. Cumulative gates are kept per 16-row
sub-block so that no exponent is a difference of two large, nearly equal sums.

Packing: the scan carries only the state of the document open at the chunk edge; a document that
closes inside a chunk has the carried state saved once into its slot, and every per-slot final state
(and the contribution of per-slot initial states to documents that start inside a chunk) is computed
after (before) the scan by gathering that one chunk. Cost per slot: a few `C x K x V` products.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kda_plugin.ops._contract import check_kda_inputs, default_scale

CHUNK = 64
SUB = 16
# Largest |decay| (nats, per channel) of one 16-row sub-block for which the diagonal sub-block may be
# factored around its midpoint: each factor is then at most exp(FACTOR_LIMIT / 2) and every product,
# masked entries included, at most exp(FACTOR_LIMIT) < float32 max (exp(88.7)).
FACTOR_LIMIT = 88.0
DIAG_MODES = ("auto", "factor", "exact")
_HI = lax.Precision.HIGHEST


def _mm(spec, a, b, precision=_HI):
  return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=jnp.float32)


def _safe_exp(mask, x):
  """exp(x) where mask, else 0, with a finite gradient everywhere (the double-where pattern)."""
  return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


class _Plan(NamedTuple):
  """Per-chunk segment bookkeeping (`[NC, B]` unless noted)."""

  segc: jax.Array          # [NC, B, C] labels
  same: jax.Array          # [NC, B, C, C] rows r and i hold the same document (not padding)
  cont_row: jax.Array      # [NC, B, C] row belongs to the document carried in from chunk c-1
  last_row: jax.Array      # [NC, B, C] row belongs to the document open at row C-1
  last_is_cont: jax.Array  # the document at row C-1 is the carried one
  cont_closes: jax.Array   # a carried document exists and ends in this chunk
  slot_cont: jax.Array     # its state slot
  slot_last: jax.Array     # slot of the document at row C-1


def _plan(segc, n_slots):
  nc, b, c = segc.shape
  valid = segc > 0
  same = (segc[..., :, None] == segc[..., None, :]) & valid[..., :, None]
  zeros = jnp.zeros((1, b), segc.dtype)
  prev_last = jnp.concatenate([zeros, segc[:-1, :, -1]], axis=0)
  next_first = jnp.concatenate([segc[1:, :, 0], zeros], axis=0)
  first = segc[:, :, 0]
  cont_label = jnp.where((first == prev_last) & (first > 0), first, 0)
  last_label = segc[:, :, -1]
  cont_row = (segc == cont_label[..., None]) & (cont_label[..., None] > 0)
  last_row = (segc == last_label[..., None]) & (last_label[..., None] > 0)
  last_is_cont = (cont_label > 0) & (last_label == cont_label)
  cont_closes = (cont_label > 0) & ~(last_is_cont & (next_first == cont_label))
  slot = lambda lab: jnp.clip(lab - 1, 0, n_slots - 1)
  return _Plan(segc, same, cont_row, last_row, last_is_cont, cont_closes, slot(cont_label),
               slot(last_label))


def _between(tb):
  """`D[x, y] = sum_{y < z < x} Tb[z]` for sub-blocks x > y (0 elsewhere): `[..., NB, K] -> [..., NB, NB, K]`."""
  nb = tb.shape[-2]
  x = jnp.arange(nb)[:, None, None]
  y = jnp.arange(nb)[None, :, None]
  z = jnp.arange(nb)[None, None, :]
  sel = ((y < z) & (z < x)).astype(tb.dtype)
  return jnp.einsum("xyz,...zk->...xyk", sel, tb, precision=_HI)


def _decay_to_row(gb, ce, tb, e):
  """exp(G_e - G_i) for rows i <= e of a chunk (0 for i > e), from per-sub-block cumulative gates.

  Args:
    gb: `[..., NB, SUB, K]` inclusive cumulative gate inside each sub-block.
    ce: `[..., NB, SUB, K]` decay from after row i to the end of its sub-block (`Tb - gb`, <= 0).
    tb: `[..., NB, K]` total decay of each sub-block.
    e: int array broadcastable to `gb.shape[:-3]`: the target row in [0, C).

  Returns:
    `[..., C, K]`. Every exponent is a sum of non-positive terms, never a difference of large sums.
  """
  nb, sub, kd = gb.shape[-3:]
  e = jnp.asarray(e)[..., None, None, None]
  be, re = e // sub, e % sub
  blk = jnp.arange(nb)[:, None, None]
  row = blk * sub + jnp.arange(sub)[None, :, None]
  gb_e = jnp.take_along_axis(jnp.take_along_axis(gb, jnp.broadcast_to(be, gb.shape[:-3] + (1, sub, kd)), -3),
                             jnp.broadcast_to(re, gb.shape[:-3] + (1, 1, kd)), -2)  # [..., 1, 1, K]
  between = _between(tb)                                               # [..., NB(x), NB(y), K]
  d_e = jnp.take_along_axis(between, jnp.broadcast_to(be, between.shape[:-3] + (1, nb, kd)), -3)
  d_e = jnp.swapaxes(d_e, -3, -2)                                      # [..., NB(y), 1, K]
  same_blk = blk == be
  expo = jnp.where(same_blk, gb_e - gb, gb_e + d_e + ce)
  out = _safe_exp(row <= e, expo)
  return out.reshape(out.shape[:-3] + (nb * sub, kd))


def _scores_factor(qs, k, gb, ce, tb):
  """Raw `Aqk, Akk [..., C, C]` with every sub-block product factored (fast; needs |Tb| <= FACTOR_LIMIT).

  Diagonal sub-blocks factor exp(G_r - G_i) around the sub-block midpoint m = Tb / 2; an
  off-diagonal block (row sub-block x > column sub-block y) uses the same row factor
  exp(G_r - m_x) and the column factor exp(m_x + D[x, y] + ce_i) <= 1. Entries above the diagonal
  are garbage (finite) and must be masked by the caller.
  """
  nb, sub, kd = gb.shape[-3:]
  m = 0.5 * tb[..., None, :]                                           # [..., NB, 1, K]
  row_f = jnp.exp(gb - m)
  col_diag = k * jnp.exp(m - gb)
  col_off = k * jnp.exp(ce)
  scale_xy = jnp.exp(m[..., :, None, 0, :] + _between(tb))            # [..., NB(x), NB(y), K]
  x = jnp.arange(nb)[:, None, None, None]
  y = jnp.arange(nb)[None, :, None, None]
  cols = jnp.where(x == y, col_diag[..., None, :, :, :],
                   jnp.where(y < x, col_off[..., None, :, :, :] * scale_xy[..., :, :, None, :], 0.0))
  rows = jnp.concatenate([qs * row_f, k * row_f], axis=-2)            # [..., NB, 2 SUB, K]
  a = _mm("...xrk,...xyik->...xryi", rows, cols)                      # [..., NB, 2SUB, NB, SUB]
  return _split_scores(a)


def _scores_exact(qs, k, gb, ce, tb):
  """Raw `Aqk, Akk [..., C, C]` with diagonal sub-blocks built elementwise (safe for any decay)."""
  nb, sub, kd = gb.shape[-3:]
  x = jnp.arange(nb)[:, None, None, None]
  y = jnp.arange(nb)[None, :, None, None]
  col_off = k * jnp.exp(ce)
  scale_xy = jnp.exp(_between(tb))
  cols = jnp.where(y < x, col_off[..., None, :, :, :] * scale_xy[..., :, :, None, :], 0.0)
  row_f = jnp.exp(gb)
  rows = jnp.concatenate([qs * row_f, k * row_f], axis=-2)
  a = _mm("...xrk,...xyik->...xryi", rows, cols)
  causal = jnp.arange(sub)[:, None] >= jnp.arange(sub)[None, :]      # [SUB(r), SUB(i)]
  diag = _diag_exact(qs, k, gb, causal[:, :, None])
  on_diag = jnp.eye(nb, dtype=bool)[:, None, :, None]                # [NB(x), 1, NB(y), 1]
  a = a + jnp.where(on_diag, diag[..., :, :, None, :], 0.0)
  return _split_scores(a)


@jax.checkpoint
def _diag_exact(qs, k, gb, causal):
  # [..., NB, SUB(r), SUB(i), K] exponents masked before exp; fused into the reduction by XLA and
  # recomputed in the backward pass rather than stored (16x the size of the inputs).
  e = _safe_exp(causal, gb[..., :, None, :] - gb[..., None, :, :])
  ki = k[..., None, :, :]
  aq = jnp.sum(qs[..., :, None, :] * ki * e, axis=-1)
  ak = jnp.sum(k[..., :, None, :] * ki * e, axis=-1)
  return jnp.concatenate([aq, ak], axis=-2)                           # [..., NB, 2SUB, SUB]


def _split_scores(a):
  """`[..., NB, 2SUB, NB, SUB]` (q rows then k rows per row sub-block) -> `Aqk, Akk [..., C, C]`."""
  nb, two_sub = a.shape[-4], a.shape[-3]
  sub = two_sub // 2
  c = nb * sub
  lead = a.shape[:-4]
  aqk = a[..., :, :sub, :, :].reshape(lead + (c, c))
  akk = a[..., :, sub:, :, :].reshape(lead + (c, c))
  return aqk, akk


def _unit_lower_inverse(lmat):
  """Inverse of unit lower-triangular `[..., C, C]` (C = 16 * 2^j): forward substitution inside the
  16-row diagonal blocks, then blockwise doubling `X21 = -X22 L21 X11` (as in LAPACK trtri)."""
  c = lmat.shape[-1]
  nb = c // SUB
  lead = lmat.shape[:-2]
  blocks = jnp.stack([lmat[..., i * SUB:(i + 1) * SUB, i * SUB:(i + 1) * SUB] for i in range(nb)], -3)
  eye = jnp.eye(SUB, dtype=lmat.dtype)
  rows = [jnp.broadcast_to(eye[0], blocks.shape[:-2] + (SUB,))]
  for r in range(1, SUB):
    prev = jnp.stack(rows, axis=-2)                                    # [..., NB, r, SUB]
    rows.append(eye[r] - _mm("...j,...jc->...c", blocks[..., r, :r], prev))
  x = jnp.stack(rows, axis=-2)                                         # [..., NB, SUB, SUB]
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


def _to_chunks(x, c):
  """`[B, Tp, H, D] -> [NC, B, H, C, D]`."""
  b, tp, h = x.shape[:3]
  x = x.reshape((b, tp // c, c, h) + x.shape[3:])
  return jnp.moveaxis(x, (1, 2), (0, 3))


def _gather_chunks(x, c_idx):
  """`x [NC, B, ...]` at chunk `c_idx [B, N]` of each row -> `[B, N, ...]`."""
  return x[c_idx, jnp.arange(x.shape[1])[:, None]]


def _slot_spans(seg, n_slots):
  """First and last position of each label 1..N in each row: `[B, N]` int32 (present = last >= 0)."""
  tp = seg.shape[1]
  pos = jnp.arange(tp, dtype=jnp.int32)
  last = jax.vmap(lambda s: jax.ops.segment_max(pos, s, num_segments=n_slots + 1))(seg)[:, 1:]
  first = jax.vmap(lambda s: jax.ops.segment_min(pos, s, num_segments=n_slots + 1))(seg)[:, 1:]
  present = (last >= 0) & (last < tp)
  return jnp.where(present, first, 0), jnp.where(present, last, -1), present


def kda_chunk_core(q, k, v, g, beta, seg, h0, *, scale, n_slots, want_final, diag_mode="auto",
                   chunk=CHUNK):
  """The segment-native chunked KDA algorithm on validated, float32, activated inputs.

  Shared by `kda_chunked` (training, differentiated by JAX) and `kda_inference_xla` (forward).

  Args:
    q, k, g: float32 `[B, T, H, K]` (g <= 0, activated); v: float32 `[B, T, H, V]`; beta: float32
      `[B, T, H]`; seg: int32 `[B, T]` labels (0 = padding); h0: float32 `[B, N, H, K, V]` or None.
    scale: Python float multiplying q. n_slots: N. want_final: also return `[B, N, H, K, V]` states.
    diag_mode: "factor" (every 16-row sub-block decays by at most FACTOR_LIMIT nats, e.g. a bounded
      gate), "exact" (elementwise diagonal sub-blocks), or "auto" (decided at run time).
    chunk: rows per chunk, a multiple of 16.

  Returns:
    `(o [B, T, H, V] float32, final [B, N, H, K, V] float32 or None)`.
  """
  if diag_mode not in DIAG_MODES:
    raise ValueError(f"diag_mode must be one of {DIAG_MODES}, got {diag_mode!r}")
  if chunk % SUB or chunk < SUB:
    raise ValueError(f"chunk must be a positive multiple of {SUB}, got {chunk}")
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  c, nb = chunk, chunk // SUB
  tp = -(-t // c) * c
  nc = tp // c
  pad = tp - t
  seg = jnp.pad(seg.astype(jnp.int32), ((0, 0), (0, pad)))
  valid = (seg > 0)[:, :, None]

  def prep(x):  # pad, zero padding rows (NaN-safe), chunk: [B, T, H, D] -> [NC, B, H, C, D]
    x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
    return _to_chunks(jnp.where(valid[..., None], x, 0.0), c)

  qc, kc, vc, gc = prep(q * scale), prep(k), prep(v), prep(g)
  bc = prep(beta[..., None])[..., 0]                                   # [NC, B, H, C]
  segc = jnp.moveaxis(seg.reshape(b, nc, c), 1, 0)                     # [NC, B, C]
  plan = _plan(segc, n_slots)

  # Cumulative gates: within 16-row sub-blocks (precise), and within each document's run in the chunk.
  gb = jnp.cumsum(gc.reshape(gc.shape[:-2] + (nb, SUB, kd)), axis=-2)  # [NC, B, H, NB, SUB, K]
  tb = gb[..., -1, :]
  ce = tb[..., None, :] - gb
  run_mask = (plan.same & (jnp.arange(c)[:, None] >= jnp.arange(c)[None, :])).astype(jnp.float32)
  g_run = _mm("nbri,nbhik->nbhrk", run_mask, gc)                        # G_r - G_a(r)
  egl = jnp.exp(g_run)                                                  # <= 1
  qd = qc * egl                                                         # q~ exp(G - G_a)
  kg = kc * egl                                                         # k exp(G - G_a)

  qs_b = qc.reshape(qc.shape[:-2] + (nb, SUB, kd))
  k_b = kc.reshape(kc.shape[:-2] + (nb, SUB, kd))
  if diag_mode == "factor":
    aqk, akk = _scores_factor(qs_b, k_b, gb, ce, tb)
  elif diag_mode == "exact":
    aqk, akk = _scores_exact(qs_b, k_b, gb, ce, tb)
  else:
    ok = jnp.all(tb >= -FACTOR_LIMIT)
    aqk, akk = lax.cond(ok, _scores_factor, _scores_exact, qs_b, k_b, gb, ce, tb)
  causal = jnp.arange(c)[:, None] >= jnp.arange(c)[None, :]
  strict = jnp.arange(c)[:, None] > jnp.arange(c)[None, :]
  same = plan.same[:, :, None]
  aqk = jnp.where(same & causal, aqk, 0.0)
  akk = jnp.where(same & strict, akk, 0.0)
  lmat = jnp.eye(c, dtype=jnp.float32) + bc[..., None] * akk
  linv = _unit_lower_inverse(lmat)
  p_mat = _mm("...ri,...ij->...rj", aqk, linv)                          # Aqk L^-1

  last = jnp.full((nc, b, h), c - 1, jnp.int32)
  kd_last = kc * _decay_to_row(gb, ce, tb, last) * plan.last_row[:, :, None, :, None]
  kd_p = _mm("...ir,...ik->...rk", linv, kd_last)                       # L^-T Kd
  dec = egl[..., c - 1, :]                                              # [NC, B, H, K]

  cont = plan.cont_row[:, :, None, :, None]
  kgb = kg * bc[..., None]
  qk_cont = jnp.concatenate([jnp.where(cont, kgb, 0.0), jnp.where(cont, qd, 0.0)], axis=-2)
  rv = vc * bc[..., None]
  o_add = None
  bidx = jnp.arange(b)
  if n_slots is None:
    raise ValueError("n_slots is required")
  first, lastpos, present = _slot_spans(seg, n_slots)
  if h0 is not None:
    # Documents that start inside a chunk enter with their own initial state: their rows' part of
    # W S_in and q~ S_in is computed here, one chunk per slot, and scattered into the scan inputs.
    c_s = jnp.clip(first // c, 0, nc - 1)
    rows_s = (_gather_chunks(segc, c_s) == jnp.arange(1, n_slots + 1)[None, :, None]) & present[..., None]
    qkf = _gather_chunks(jnp.concatenate([kgb, qd], axis=-2), c_s)     # [B, N, H, 2C, K]
    rows2 = jnp.concatenate([rows_s, rows_s], axis=-1)[:, :, None, :, None]
    x = _mm("bnhrk,bnhkv->bnhrv", jnp.where(rows2, qkf, 0.0), h0)
    corr = jnp.zeros((nc, b, h, 2 * c, vd), jnp.float32).at[c_s, bidx[:, None]].add(x)
    rv = rv - corr[..., :c, :]
    o_add = corr[..., c:, :]

  out_prec = _HI

  def step(carry, xs):
    s, buf = carry
    qk_c, rv_c, p_c, kdp_c, dec_c, lic, sl, cc, sc = xs[:9]
    xw = _mm("bhrk,bhkv->bhrv", qk_c, s)
    r = rv_c - xw[..., :c, :]
    o = xw[..., c:, :] + _mm("bhri,bhiv->bhrv", p_c, r, out_prec)
    if o_add is not None:
      o = o + xs[9]
    if h0 is not None:
      fresh = h0[bidx, sl]
    else:
      fresh = jnp.zeros_like(s)
    base = jnp.where(lic[:, None, None, None], s, fresh)
    s_next = dec_c[..., None] * base + _mm("bhik,bhiv->bhkv", kdp_c, r)
    if buf is not None:
      old = buf[bidx, sc]
      buf = buf.at[bidx, sc].set(jnp.where(cc[:, None, None, None], s, old))
    return (s_next, buf), o

  xs = (qk_cont, rv, p_mat, kd_p, dec, plan.last_is_cont, plan.slot_last, plan.cont_closes,
        plan.slot_cont)
  if o_add is not None:
    xs = xs + (o_add,)
  s0 = jnp.zeros((b, h, kd, vd), jnp.float32)
  buf0 = jnp.zeros((b, n_slots, h, kd, vd), jnp.float32) if want_final else None
  (_, buf), o = lax.scan(step, (s0, buf0), xs)
  o = jnp.moveaxis(o, (0, 3), (1, 2)).reshape(b, tp, h, vd)[:, :t]

  if not want_final:
    return o, None
  # Final states, one chunk per slot: the chunk holding the document's last row.
  c_e = jnp.clip(lastpos // c, 0, nc - 1)
  e_row = jnp.clip(lastpos - c_e * c, 0, c - 1)
  cont_e = first < c_e * c
  init = h0 if h0 is not None else jnp.zeros((b, n_slots, h, kd, vd), jnp.float32)
  s_base = jnp.where(cont_e[:, :, None, None, None], buf, init)
  rows_e = (_gather_chunks(segc, c_e) == jnp.arange(1, n_slots + 1)[None, :, None])[:, :, None, :, None]
  gat = lambda x: _gather_chunks(x, c_e)
  r_n = gat(bc)[..., None] * (gat(vc) - _mm("bnhrk,bnhkv->bnhrv", gat(kg), s_base))
  r_n = jnp.where(rows_e, r_n, 0.0)
  e_b = jnp.broadcast_to(e_row[:, :, None], (b, n_slots, h))
  kd_n = gat(kc) * _decay_to_row(gat(gb), gat(ce), gat(tb), e_b)
  kd_n = jnp.where(rows_e, kd_n, 0.0)
  kdp_n = _mm("bnhir,bnhik->bnhrk", gat(linv), kd_n)
  dec_n = jnp.take_along_axis(gat(egl), e_b[..., None, None], axis=-2)[..., 0, :]  # [B, N, H, K]
  final = dec_n[..., None] * s_base + _mm("bnhik,bnhiv->bnhkv", kdp_n, r_n)
  final = jnp.where(present[:, :, None, None, None], final, init)
  return o, final


@functools.partial(jax.jit, static_argnames=("scale", "n_slots", "want_final", "diag_mode"))
def _chunked_jit(q, k, v, g, beta, seg, h0, *, scale, n_slots, want_final, diag_mode):
  f32 = lambda x: x.astype(jnp.float32)
  return kda_chunk_core(f32(q), f32(k), f32(v), f32(g), f32(beta), seg, h0, scale=scale,
                        n_slots=n_slots, want_final=want_final, diag_mode=diag_mode)


def kda_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                segment_ids=None, max_num_segments=None):
  """KDA in the chunked WY/UT form (chunk 64), differentiable with JAX autodiff (the training path).

  Equal to `kda_reference` (the token recurrence, ../shared/docs/kda.md section 1) up to float32
  rounding; packed documents are solved in place by the masked chunk equations of
  ../shared/docs/segment_native_chunk.md (no re-alignment, no per-token loop). State and
  accumulation are float32 whatever the input dtype; outputs and gradients stay finite under any
  decay (exponents are masked before `exp`).

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

  Returns:
    `(o, final_state)`: o `[B, T, H, V]` in q's dtype (exactly 0 on padding); final_state float32 in
    initial_state's layout (a label never present keeps its initial state), or None.

  Raises:
    ValueError, TypeError: see `kda_plugin.ops._contract.check_kda_inputs`.
  """
  p = check_kda_inputs(q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids,
                       max_num_segments=max_num_segments, scale=scale)
  return _run(p, q, k, v, g, beta, initial_state, scale, output_final_state, "auto")


def _run(p, q, k, v, g, beta, initial_state, scale, output_final_state, diag_mode):
  """Shared wrapper: lays out segments and slots, calls the jitted core, restores the contract."""
  scale = float(default_scale(scale, p.key_dim))
  packed = p.segment_ids is not None
  n = p.num_segments if packed else 1
  seg = p.segment_ids if packed else jnp.ones((p.batch, p.seq_len), jnp.int32)
  h0 = None
  if initial_state is not None:
    h0 = jnp.asarray(initial_state, jnp.float32)
    if not packed:
      h0 = h0[:, None]
  o, final = _chunked_jit(q, k, v, g, beta, seg, h0, scale=scale, n_slots=n,
                          want_final=bool(output_final_state), diag_mode=diag_mode)
  o = o.astype(jnp.asarray(q).dtype)
  if not output_final_state:
    return o, None
  return o, (final if packed else final[:, 0])
