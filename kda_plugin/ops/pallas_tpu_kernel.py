"""The Mosaic kernel body of `pallas_tpu.kda_pallas_tpu`: one grid step of the packed KDA forward.

Grid `(B, H / HG, NC / CPS)`: a step takes HG heads (`heads_per_step`) of CPS consecutive 64-row
chunks (`chunks_per_step`), chunk after chunk in program order. Per chunk it builds its piece table
in SMEM from the segment labels (`_build_piece_table`), the chunk's state-independent matrices for
all HG heads stage by stage (`_chunk_math.chunk_prep_heads`: their MXU latencies overlap), then
walks the chunk's pieces (runs of one document inside it) through the carried state. Several chunks
per step because each grid step has a fixed cost (pipeline bookkeeping, DMA issue and wait) that a
64-row chunk of 8 heads does not hide. Every piece takes the same path: the carry holds zeros
whenever no document is open, so a piece without an incoming state is the stateful arithmetic on a
zero state (exact: U - W 0 = U), with no second branch.

Refs, in order (blocks of the step; shapes without the squeezed batch dim):
  seg_prev, seg_cur, seg_next: int32 SMEM `[W]`, W = max(128, CPS * 64) labels: the step's label
    block and its neighbours (clamped at the ends; only their last / first label is read).
  q, k, g: `[CPS*C, HG*Kp]` lane-dense, `[CPS*C, HG, Kp]` head-major, or `[CPS*C*H, Kp]` (all H
    heads of each token, strided per head; float32: bf16 blocks are widened into `wide` scratch
    first, Mosaic strides 32-bit data only); v likewise with Vp.
  beta: `[H, W]` lane-dense along T.
  a_log (SMEM `[H]` float32) and dt_bias (`[1, HG*Kp]`) when the gate is applied in the kernel.
  h0 (HBM `[B, N, H, Kp, Vp]`) when given, else the zeros aliased to the final states when wanted.
  o: `[CPS*C, HG*Vp]`; final states (HBM `[B, N, H, Kp, Vp]`, aliased) when wanted; the state
    entering each of the step's chunks `[CPS, HG, Kp, Vp]` (the carry before the chunk) when wanted.
  Scratch: see `pallas_tpu.kda_pallas_tpu`.

Math: `_chunk_math` (docs/kda.md section 'Chunked form (WY/UT)', docs/packing.md section
'Segment-native chunk algorithm').
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kda_plugin.ops import _chunk_math as cm
from kda_plugin.ops import _segment_schedule as ss

C = ss.CHUNK
LANE = 128


def inverse_block_shift(dots) -> int:
  """log2 of the UT inverse's diagonal blocks inverted on the VPU before the MXU doublings
  (`_chunk_math.unit_lower_inverses`). bf16 products (one MXU pass): 1, the exact 2-row blocks then
  five doublings, since the VPU is the busier unit. float32 at HIGHEST (six passes a product): 4,
  16-row blocks by forward substitution then two doublings, since the MXU is. (Estimates per block
  size: docs/performance.md.)"""
  return 1 if dots.bf16 else 4


def _bits(word, offset, width):
  return lax.shift_right_logical(word, offset) & ((1 << width) - 1)


def _lanes_to_col(row, off):
  """Lanes `[off, off + C)` of a `[1, W]` row as a float32 `[C, 1]` column (`off` may be traced):
  one masked lane reduction against a shifted identity."""
  w = row.shape[1]
  pick = cm.iota((C, w), 1) == cm.iota((C, w), 0) + off
  return jnp.sum(jnp.where(pick, jnp.broadcast_to(row.astype(jnp.float32), (C, w)), 0.0), axis=1,
                 keepdims=True)


def _head_reader(ref, hg, heads_layout, r0):
  """`i -> head i's [C, D] float32 rows` of the chunk at block row `r0` of one step's q / k / v / g block.

  Lane-dense blocks `[R, HG*D]`: head i is its lanes. Head-major inputs `[B, T, H, D]` are read in
  place (no relayout copy before the call; on TPU `[B, T, H, D] -> [B, T, H*D]` moves every element,
  the (8, 128) tiles cover different dims): when a step takes all H heads, viewed as `[B, T*H, D]`
  (a free bitcast), block `[R*H, D]`, head i every H-th row (one strided load; Mosaic strides 32-bit
  data only, so a bfloat16 block is first widened whole into a float32 VMEM copy, which is then
  `ref`); else block `[R, HG, D]`, head i its sublane i of every token (Mosaic gathers it with VPU
  shuffles). Mosaic takes neither a dynamic strided start nor a strided store for bfloat16, so the
  head group is the block's and the output stays lane-dense (`[B, T, H*V]`).
  """
  if not heads_layout:
    d = ref.shape[1] // hg
    return lambda i: ref[r0:r0 + C, i * d:(i + 1) * d].astype(jnp.float32)
  if len(ref.shape) == 3:
    return lambda i: ref[r0:r0 + C, i, :].astype(jnp.float32)
  return lambda i: ref[pl.ds(r0 * hg + i, C, stride=hg), :].astype(jnp.float32)


def _build_piece_table(table_ref, seg_prev, seg_cur, seg_next, c, nc, has_h0, base=0):
  """Writes chunk c's piece table (`_segment_schedule.build_chunk_table`'s entry: the piece count,
  then label and packed word per piece) into SMEM `table_ref` from word `base` on.

  seg_cur holds the labels of the W-row block (W / 64 chunks) chunk c belongs to, seg_prev and
  seg_next the blocks before and after (for the rows just outside the chunk). A chunk inside one
  document is recognised from its first and last labels; any other takes one scalar pass over its
  64 rows (`_scan_pieces`).
  """
  w = seg_cur.shape[0]
  off = (c % (w // C)) * C

  def label(i):  # label of chunk row i, i in [-1, C]; 0 outside the sequence
    j = off + i
    inside = seg_cur[jnp.clip(j, 0, w - 1)]
    before = jnp.where(c > 0, seg_prev[w - 1], 0)
    after = jnp.where(c + 1 < nc, seg_next[0], 0)
    return jnp.where(j < 0, before, jnp.where(j >= w, after, inside))

  entering, leaving = label(-1), label(C)
  s0, s_last = label(0), label(C - 1)

  def packed(first, last, cont, ends):
    return (first << ss.PIECE_FIRST | last << ss.PIECE_LAST | cont << ss.PIECE_CONT
            | ends << ss.PIECE_ENDS | (cont | int(has_h0)) << ss.PIECE_HAS_STATE)

  # a document's label is one contiguous run: a chunk whose first and last rows hold the same
  # label is that one piece (most chunks), with no pass over its rows
  single = (s0 != 0) & (s0 == s_last)

  @pl.when(single)
  def _():
    table_ref[base] = 1
    table_ref[base + 1] = s0
    table_ref[base + 2] = packed(0, C - 1, (s0 == entering).astype(jnp.int32),
                                 (s0 != leaving).astype(jnp.int32))

  @pl.when(jnp.logical_not(single))
  def _():
    _scan_pieces(table_ref, label, entering, packed, base)


def _scan_pieces(table_ref, label, entering, packed, base):
  """The general case of `_build_piece_table`: one scalar pass over the chunk's rows."""
  def row(r, carry):
    count, prev, first, s = carry
    nxt = label(r + 1)
    live = s != 0
    begin = live & ((r == 0) | (s != prev))
    count = count + begin.astype(jnp.int32)
    first = jnp.where(begin, r, first)

    @pl.when(begin)
    def _():
      table_ref[base + 1 + ss.WORDS_PER_PIECE * (count - 1)] = s

    @pl.when(live & ((r == C - 1) | (s != nxt)))
    def _():
      cont = ((first == 0) & (s == entering)).astype(jnp.int32)
      ends = 1 - ((r == C - 1) & (s == nxt)).astype(jnp.int32)
      table_ref[base + 2 + ss.WORDS_PER_PIECE * (count - 1)] = packed(first, r, cont, ends)

    return count, s, first, nxt

  zero = jnp.int32(0)
  count = lax.fori_loop(0, C, row, (zero, zero, zero, label(0)))[0]
  table_ref[base] = count


def kernel(seg_prev_ref, seg_cur_ref, seg_next_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, *refs,
           heads_per_step, chunks_per_step, scale, use_l2norm, gate, lower_bound, has_h0, want_final,
           key_dim, out_dtype, dots, num_chunks, heads_layout, words, want_states=False):
  it = iter(refs)
  alog_ref, dtb_ref = (next(it), next(it)) if gate else (None, None)
  h0_ref = next(it) if has_h0 else None
  if want_final and not has_h0:
    next(it)  # the zeros aliased to the final states: never read
  o_ref = next(it)
  fs_ref = next(it) if want_final else None
  st_ref = next(it) if want_states else None
  # each scratch but the carry, the final-state buffer and the tables has a leading dim of
  # CPS * HG: chunk j's head i at j * HG + i (the chunks of a step share no scratch but the carry)
  (carry_ref, g_scr, q_scr, k_scr, tinv_scr, aqk_scr, u_scr, vacc_scr, oacc_scr,
   beta_scr, state_scr, table_ref, *wide) = it
  hg = heads_per_step
  kp, vp = carry_ref.shape[1], carry_ref.shape[2]
  b, hb, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  srcs = (q_ref, k_ref, v_ref, g_ref)
  if wide:  # bf16 [R*H, D] blocks widened to float32 copies for the strided per-head reads
    for src, dst in zip(srcs, wide):
      dst[...] = src[...].astype(jnp.float32)
    srcs = tuple(wide)
  a_exp = dtb = None
  if gate:
    # exp(A_log) of the step's heads as a [1, HG*Kp] row, from their SMEM scalars
    a_exp = jnp.exp(jnp.concatenate(
        [jnp.full((1, kp), alog_ref[hb * hg + i], jnp.float32) for i in range(hg)], axis=1))
    dtb = dtb_ref[...]
  beta_all = beta_ref[...].astype(jnp.float32)
  seg_w = seg_cur_ref.shape[0]

  @pl.when(s == 0)
  def _():  # the carry holds zeros whenever no document is open (a piece reads it unconditionally)
    carry_ref[...] = jnp.zeros(carry_ref.shape, jnp.float32)

  for j in range(chunks_per_step):
    c = s * chunks_per_step + j
    _build_piece_table(table_ref, seg_prev_ref, seg_cur_ref, seg_next_ref, c, num_chunks, has_h0,
                       base=j * words)
    # the chunk's lanes of the beta block: static when a step covers its whole label block
    off = j * C if chunks_per_step * C >= seg_w else (c % (seg_w // C)) * C
    if want_states:
      st_ref[j] = carry_ref[...]
    _chunk(j, c, off, srcs, beta_all, a_exp, dtb, o_ref, h0_ref, fs_ref, carry_ref,
           (g_scr, q_scr, k_scr, tinv_scr, aqk_scr, u_scr, vacc_scr, oacc_scr, beta_scr),
           state_scr, table_ref, b, hb, hg=hg, kp=kp, vp=vp, scale=scale, use_l2norm=use_l2norm,
           gate=gate, lower_bound=lower_bound, has_h0=has_h0, want_final=want_final,
           key_dim=key_dim, out_dtype=out_dtype, dots=dots, heads_layout=heads_layout,
           base=j * words)


def _chunk(j, c, off, srcs, beta_all, a_exp, dtb, o_ref, h0_ref, fs_ref, carry_ref, scr, state_scr,
           table_ref, b, hb, *, hg, kp, vp, scale, use_l2norm, gate, lower_bound, has_h0, want_final,
           key_dim, out_dtype, dots, heads_layout, base):
  """Chunk c, the step's j-th (block rows `[j*C, (j+1)*C)`), for the step's HG heads."""
  g_scr, q_scr, k_scr, tinv_scr, aqk_scr, u_scr, vacc_scr, oacc_scr, beta_scr = scr
  r0 = j * C
  h_at = lambda i: j * hg + i  # this chunk's head i in the scratch
  count = table_ref[base]

  def label_rows(i, seg_col):  # the chunk's segment column, rebuilt from its pieces
    label = table_ref[base + 1 + ss.WORDS_PER_PIECE * i]
    word = table_ref[base + 2 + ss.WORDS_PER_PIECE * i]
    r = cm.iota(seg_col.shape, 0)
    inside = (r >= _bits(word, ss.PIECE_FIRST, 8)) & (r <= _bits(word, ss.PIECE_LAST, 8))
    return jnp.where(inside, label, seg_col)

  seg_col = lax.fori_loop(0, count, label_rows, jnp.zeros((C, 1), jnp.int32))   # [C, 1]
  valid_row = seg_col != 0

  @pl.when(count == 0)
  def _():
    o_ref[r0:r0 + C, :] = jnp.zeros((C, o_ref.shape[1]), out_dtype)

  @pl.when(count > 0)
  def _():
    seg_row = cm.col_to_row(seg_col.astype(jnp.float32)).astype(jnp.int32)
    read_q, read_k, read_v, read_g = (_head_reader(r, hg, heads_layout, r0) for r in srcs)
    g_all = (jnp.concatenate([read_g(i) for i in range(hg)], axis=1) if heads_layout
             else srcs[3][r0:r0 + C, :].astype(jnp.float32))
    if gate:
      g_all = cm.activate_gate(g_all, a_exp, dtb, lower_bound)
      g_all = jnp.where((cm.iota(g_all.shape, 1) & (kp - 1)) < key_dim, g_all, 0.0)  # padded lanes: g = 0
    if not (gate and lower_bound is not None):  # the bounded gate is >= lower_bound >= -5 already
      g_all = cm.clamp_gate(g_all)
    # every head's gate summed per document (restarting at each document's first row) at once
    G_all = cm.cumsum_rows_split(jnp.where(valid_row, g_all, 0.0), cm.same_document(seg_col, seg_row))
    # the heads are independent: each stage is issued for all of them before the next, so their
    # MXU latencies overlap (cm.chunk_prep_heads)
    qs, ks, betas = [], [], []
    for i in range(hg):
      betas.append(jnp.where(valid_row, _lanes_to_col(cm.row_at(beta_all, hb * hg + i), off), 0.0))
      q, k = read_q(i), read_k(i)
      if use_l2norm:
        q, k = cm.l2norm_rows(q), cm.l2norm_rows(k)
      qs.append(q * scale)
      ks.append(k)
    Gs = [G_all[:, i * kp:(i + 1) * kp] for i in range(hg)]

    def prep(bound):  # the chunk's (I + beta Akk)^-1 and Aqk for every head, into the scratch
      prepped = cm.chunk_prep_heads(qs, ks, Gs, betas, seg_col, seg_row, blocked=True, dots=dots,
                                    inverse_dots=dots, lower_bound=bound,
                                    vpu_block_shift=inverse_block_shift(dots))
      for i, (tinv, aqk) in enumerate(prepped):
        tinv_scr[h_at(i)] = tinv
        aqk_scr[h_at(i)] = aqk

    if gate and lower_bound is not None:
      prep(lower_bound)  # the in-kernel bounded gate bounds every row's log decay: the diagonal blocks factor
    else:
      # An unbounded gate (softplus, or a given log decay) has no static bound, so the bound is read
      # from the data: a chunk whose every valid row decays by at most GENTLE_LOG_DECAY per step (every
      # chunk of a typical model) takes the factored diagonal blocks; a steeper one the elementwise
      # blocks. Both are exact; the elementwise ones cost ~12x on v5e (docs/performance.md).
      gentle = jnp.min(jnp.where(valid_row, g_all, 0.0)) >= cm.GENTLE_LOG_DECAY

      @pl.when(gentle)
      def _():
        prep(cm.GENTLE_LOG_DECAY)

      @pl.when(jnp.logical_not(gentle))
      def _():
        prep(None)
    for i in range(hg):
      g_scr[h_at(i)] = Gs[i]
      q_scr[h_at(i)] = qs[i]
      k_scr[h_at(i)] = ks[i]
      beta_scr[h_at(i)] = betas[i]
    for i in range(hg):
      u_scr[h_at(i)] = dots.nn(tinv_scr[h_at(i)], betas[i] * read_v(i))
    for i in range(hg):
      vacc_scr[h_at(i)] = jnp.zeros((C, vp), jnp.float32)
      oacc_scr[h_at(i)] = jnp.zeros((C, vp), jnp.float32)

    def piece(p_i, carry):
      label = table_ref[base + 1 + ss.WORDS_PER_PIECE * p_i]
      word = table_ref[base + 2 + ss.WORDS_PER_PIECE * p_i]
      first, last = _bits(word, ss.PIECE_FIRST, 8), _bits(word, ss.PIECE_LAST, 8)
      cont, ends = _bits(word, ss.PIECE_CONT, 1), _bits(word, ss.PIECE_ENDS, 1)
      slot = label - 1
      mask = seg_col == label

      if has_h0:  # a document starting here enters with its slot's initial state
        @pl.when(cont == 0)
        def _():
          for i in range(hg):
            pltpu.sync_copy(h0_ref.at[b, slot, hb * hg + i], carry_ref.at[i])

      # without an incoming state the carry holds zeros (see `kernel`), and the same arithmetic
      # gives the stateless piece exactly: u - W 0 = u, (q~ e) 0 = 0, Diag(e) 0 = 0
      hs = [h_at(i) for i in range(hg)]
      outs = cm.piece_with_state_heads(
          [g_scr[h] for h in hs], [q_scr[h] for h in hs], [k_scr[h] for h in hs],
          [beta_scr[h] for h in hs], [tinv_scr[h] for h in hs], [u_scr[h] for h in hs], mask,
          first, last, [carry_ref[i] for i in range(hg)], dots)
      # stage by stage across the heads (each stage's matmuls issued together: their MXU
      # latencies overlap instead of adding up head after head)
      updates = [cm.piece_state_update(g_scr[h], k_scr[h], mask, last, vnew, dots)
                 for h, (vnew, _, _) in zip(hs, outs)]
      for i, ((vnew, o_add, s_base), update) in enumerate(zip(outs, updates)):
        oacc_scr[h_at(i)] = oacc_scr[h_at(i)] + o_add
        vacc_scr[h_at(i)] = vacc_scr[h_at(i)] + vnew
        s_end = s_base + update

        @pl.when(ends == 0)
        def _():
          carry_ref[i] = s_end

        @pl.when(ends == 1)
        def _():
          if want_final:
            state_scr[i] = s_end
            pltpu.sync_copy(state_scr.at[i], fs_ref.at[b, slot, hb * hg + i])
          carry_ref[i] = jnp.zeros((kp, vp), jnp.float32)  # the next document starts from zeros

      return carry

    lax.fori_loop(0, count, piece, 0)
    for i in range(hg):
      o = oacc_scr[h_at(i)] + dots.nn(aqk_scr[h_at(i)], vacc_scr[h_at(i)])
      o_ref[r0:r0 + C, i * vp:(i + 1) * vp] = jnp.where(valid_row, o, 0.0).astype(out_dtype)

