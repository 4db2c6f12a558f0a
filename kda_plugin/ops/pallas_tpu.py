"""Pallas TPU (Mosaic) kernel for packed-sequence KDA inference with native segment IDs.

Grid `(B, H / HG, NC)`: batch and head group are parallel, the chunk axis is sequential
("arbitrary"); each step takes HG heads (`heads_per_step`: 8 when H allows), whose work is
independent and issued stage by stage across the heads (`_chunk_math.chunk_prep_heads`), so their
MXU latencies overlap and the step count drops HG-fold. What the MXU sees was chosen with the frozen
cost model (tools/tpu_cost.py, chain of MXU round trips per step): one cumulative-gate matmul for
all the step's heads, one matmul for all below-diagonal scores of a head, bf16 operands with float32
accumulation for bfloat16 inputs (`matmul_precision`). Every
block index is arithmetic in the grid position, so nothing about the packing steers a DMA: one grid
step per 64-row chunk builds the chunk's matrices once (cumulative gate, masked Akk / Aqk, the UT
inverse, U), then loops over the chunk's pieces (the runs of one document inside it). The piece table
(`_segment_schedule.build_chunk_table`'s entry format) is built by the step itself in SMEM scratch
(`_build_piece_table`) from three 128-label SMEM blocks of the segment map: no XLA op builds it, and
SMEM use does not grow with B or T. Each piece applies its incoming state: the carried state in VMEM
scratch when it continues the previous chunk's open document, its slot's initial state (copied
from HBM by a synchronous DMA) when one is given, none otherwise.

Per-slot final states live in HBM (`memory_space=ANY`): the output is aliased to the initial states
(zeros when none are given) and each document's final state is DMAed into its slot at the step where
the document ends, so slots that never appear keep their initial state.

Layouts (prepared by `kda_plugin.ops.inference_tpu`): q, k, g `[B, Tp, H*Kp]`, v and o `[B, Tp, H*Vp]`
(the lane-dense layout of the model's projections, K and V multiples of 128, T of 64: no copy when
already aligned); beta `[B, H, Tp2]` (Tp2 = Tp rounded up to 128; XLA keeps a `[B, T, H]` beta
with T minor, so this is a free transpose), one block holding every head's rows of two chunks,
lane-dense. The segment map never enters the kernel as a vector: each step rebuilds its chunk's
label column from the piece table.

Math: `_chunk_math` (docs/kda.md section 'Chunked form (WY/UT)', docs/packing.md section 'Segment-native chunk algorithm').
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kda_plugin.ops import _chunk_math as cm
from kda_plugin.ops import _segment_schedule as ss

C = ss.CHUNK
LANE = 128
PAIR = LANE // C  # chunks per lane-dense row of beta / segment ids
# The UT inverse's 16-row diagonal blocks by forward substitution on the VPU (float32), then two
# MXU doublings (`_chunk_math.unit_lower_inverses`). tools/tpu_cost.py, TPU7x seed shape (ESTIMATE):
# 2-row blocks (10 MXU levels) 0.456 ms, 8-row 0.401, 16-row 0.371, 32-row 0.409 (VPU-bound).
VPU_INVERSE_BLOCK_SHIFT = 4
MAX_KV = 256  # K and V padded above this would overflow the VMEM plan (states are [Kp, Vp] float32)


def _bits(word, offset, width):
  return lax.shift_right_logical(word, offset) & ((1 << width) - 1)


def _chunk_rows(row, c):
  """This chunk's half of a `[1, 128]` lane-dense row (two chunks) as a float32 `[C, 1]` column."""
  col = cm.row_to_col(row.astype(jnp.float32))
  return jnp.where(c % PAIR == 0, col[:C], col[C:])


def _head_reader(ref, hg, heads_layout):
  """`i -> head i's [C, D] float32 rows` of one step's q / k / v / g block.

  Lane-dense blocks `[C, HG*D]`: head i is its lanes. Head-major inputs `[B, T, H, D]` are read in
  place (no relayout copy before the call; on TPU `[B, T, H, D] -> [B, T, H*D]` moves every element,
  the (8, 128) tiles cover different dims): when a step takes all H heads, viewed as `[B, T*H, D]`
  (a free bitcast), block `[C*H, D]`, head i every H-th row from row i (one strided load; Mosaic
  strides 32-bit data only, so a bfloat16 block is first widened whole into a float32 VMEM copy,
  which is then `ref`); else block `[C, HG, D]`, head i its sublane i of every token (Mosaic
  gathers it with VPU shuffles). Mosaic takes neither a dynamic strided start nor a strided store for bfloat16, so the head group is the
  block's and the output stays lane-dense (`[B, T, H*V]`, one XLA relayout after the call).
  """
  if not heads_layout:
    d = ref.shape[1] // hg
    return lambda i: ref[:, i * d:(i + 1) * d].astype(jnp.float32)
  if len(ref.shape) == 3:
    return lambda i: ref[:, i, :].astype(jnp.float32)
  return lambda i: ref[pl.ds(i, C, stride=hg), :].astype(jnp.float32)


def _build_piece_table(table_ref, seg_prev, seg_cur, seg_next, c, nc, has_h0):
  """Writes this chunk's piece table (`_segment_schedule.build_chunk_table`'s entry: the piece
  count, then label and packed word per piece) into SMEM `table_ref`, from the chunk's labels.

  seg_cur holds the labels of the chunk pair (2 x 64 rows) this chunk belongs to, seg_prev and
  seg_next the pairs before and after (for the rows just outside the chunk). A chunk inside one
  document is recognised from its first and last labels; any other takes one scalar pass over its
  64 rows (`_scan_pieces`). tools/tpu_cost.py, TPU7x seed shape (ESTIMATE): the table built by 25
  XLA ops before the call 0.368 ms, built here 0.287 ms (the scalar pass is off the step's critical
  chain there; on a chip it runs before the vector work, at most ~1.1k cycles per boundary chunk).
  """
  off = (c % PAIR) * C

  def label(i):  # label of chunk row i, i in [-1, C]; 0 outside the sequence
    j = off + i
    inside = seg_cur[jnp.clip(j, 0, LANE - 1)]
    before = jnp.where(c > 0, seg_prev[LANE - 1], 0)
    after = jnp.where(c + 1 < nc, seg_next[0], 0)
    return jnp.where(j < 0, before, jnp.where(j >= LANE, after, inside))

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
    table_ref[0] = 1
    table_ref[1] = s0
    table_ref[2] = packed(0, C - 1, (s0 == entering).astype(jnp.int32),
                          (s0 != leaving).astype(jnp.int32))

  @pl.when(jnp.logical_not(single))
  def _():
    _scan_pieces(table_ref, label, entering, packed)


def _scan_pieces(table_ref, label, entering, packed):
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
      table_ref[1 + ss.WORDS_PER_PIECE * (count - 1)] = s

    @pl.when(live & ((r == C - 1) | (s != nxt)))
    def _():
      cont = ((first == 0) & (s == entering)).astype(jnp.int32)
      ends = 1 - ((r == C - 1) & (s == nxt)).astype(jnp.int32)
      table_ref[2 + ss.WORDS_PER_PIECE * (count - 1)] = packed(first, r, cont, ends)

    return count, s, first, nxt

  zero = jnp.int32(0)
  count = lax.fori_loop(0, C, row, (zero, zero, zero, label(0)))[0]
  table_ref[0] = count


def _kernel(seg_prev_ref, seg_cur_ref, seg_next_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, *refs,
            heads_per_step, scale, use_l2norm, gate, lower_bound, has_h0, want_final, key_dim,
            out_dtype, dots, num_chunks, heads_layout):
  it = iter(refs)
  alog_ref, dtb_ref = (next(it), next(it)) if gate else (None, None)
  h0_ref = next(it) if has_h0 else None
  if want_final and not has_h0:
    next(it)  # the zeros aliased to the final states: never read
  o_ref = next(it)
  fs_ref = next(it) if want_final else None
  (carry_ref, g_scr, q_scr, k_scr, tinv_scr, aqk_scr, u_scr, vacc_scr, oacc_scr,
   beta_scr, state_scr, table_ref, *wide) = it  # each but the table with a leading dim: the step's heads
  hg = heads_per_step
  kp, vp = carry_ref.shape[1], carry_ref.shape[2]

  b, hb, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  _build_piece_table(table_ref, seg_prev_ref, seg_cur_ref, seg_next_ref, c, num_chunks, has_h0)
  count = table_ref[0]

  def label_rows(i, seg_col):  # the chunk's segment column, rebuilt from its pieces
    label = table_ref[1 + ss.WORDS_PER_PIECE * i]
    word = table_ref[2 + ss.WORDS_PER_PIECE * i]
    r = cm.iota(seg_col.shape, 0)
    inside = (r >= _bits(word, ss.PIECE_FIRST, 8)) & (r <= _bits(word, ss.PIECE_LAST, 8))
    return jnp.where(inside, label, seg_col)

  seg_col = lax.fori_loop(0, count, label_rows, jnp.zeros((C, 1), jnp.int32))   # [C, 1]
  valid_row = seg_col != 0

  @pl.when(count == 0)
  def _():
    o_ref[...] = jnp.zeros(o_ref.shape, out_dtype)

  @pl.when(count > 0)
  def _():
    seg_row = cm.col_to_row(seg_col.astype(jnp.float32)).astype(jnp.int32)
    beta_all = beta_ref[...].astype(jnp.float32)
    srcs = (q_ref, k_ref, v_ref, g_ref)
    if wide:  # bf16 [C*H, D] blocks widened to float32 copies for the strided per-head reads
      for src, dst in zip(srcs, wide):
        dst[...] = src[...].astype(jnp.float32)
      srcs = wide
    read_q, read_k, read_v, read_g = (_head_reader(r, hg, heads_layout) for r in srcs)
    g_all = (jnp.concatenate([read_g(i) for i in range(hg)], axis=1) if heads_layout
             else g_ref[...].astype(jnp.float32))
    if gate:
      # exp(A_log) of the step's heads as a [1, HG*Kp] row, from their SMEM scalars
      a_exp = jnp.exp(jnp.concatenate(
          [jnp.full((1, kp), alog_ref[hb * hg + i], jnp.float32) for i in range(hg)], axis=1))
      g_all = cm.activate_gate(g_all, a_exp, dtb_ref[...], lower_bound)
      g_all = jnp.where((cm.iota(g_all.shape, 1) & (kp - 1)) < key_dim, g_all, 0.0)  # padded lanes: g = 0
    if not (gate and lower_bound is not None):  # the bounded gate is >= lower_bound >= -5 already
      g_all = cm.clamp_gate(g_all)
    # every head's gate summed per document (restarting at each document's first row) at once
    G_all = cm.cumsum_rows_split(jnp.where(valid_row, g_all, 0.0), cm.same_document(seg_col, seg_row))
    # the heads are independent: each stage is issued for all of them before the next, so their
    # MXU latencies overlap (cm.chunk_prep_heads)
    qs, ks, betas = [], [], []
    for i in range(hg):
      betas.append(jnp.where(valid_row, _chunk_rows(cm.row_at(beta_all, hb * hg + i), c), 0.0))
      q, k = read_q(i), read_k(i)
      if use_l2norm:
        q, k = cm.l2norm_rows(q), cm.l2norm_rows(k)
      qs.append(q * scale)
      ks.append(k)
    Gs = [G_all[:, i * kp:(i + 1) * kp] for i in range(hg)]
    # the in-kernel bounded gate bounds every row's log decay: the diagonal score blocks factor
    prepped = cm.chunk_prep_heads(qs, ks, Gs, betas, seg_col, seg_row, blocked=True, dots=dots,
                                  inverse_dots=dots, lower_bound=lower_bound if gate else None,
                                  vpu_block_shift=VPU_INVERSE_BLOCK_SHIFT)
    for i, (tinv, aqk) in enumerate(prepped):
      g_scr[i] = Gs[i]
      q_scr[i] = qs[i]
      k_scr[i] = ks[i]
      tinv_scr[i] = tinv
      aqk_scr[i] = aqk
      beta_scr[i] = betas[i]
    for i, (tinv, _) in enumerate(prepped):
      u_scr[i] = dots.nn(tinv, betas[i] * read_v(i))
    vacc_scr[...] = jnp.zeros_like(vacc_scr)
    oacc_scr[...] = jnp.zeros_like(oacc_scr)

    def piece(p_i, carry):
      label = table_ref[1 + ss.WORDS_PER_PIECE * p_i]
      word = table_ref[2 + ss.WORDS_PER_PIECE * p_i]
      first, last = _bits(word, ss.PIECE_FIRST, 8), _bits(word, ss.PIECE_LAST, 8)
      cont, ends = _bits(word, ss.PIECE_CONT, 1), _bits(word, ss.PIECE_ENDS, 1)
      has_state = _bits(word, ss.PIECE_HAS_STATE, 1)
      slot = label - 1
      mask = seg_col == label

      def finish(vnews, s_bases):
        # stage by stage across the heads (each stage's matmuls issued together: their MXU
        # latencies overlap instead of adding up head after head)
        updates = [cm.piece_state_update(g_scr[i], k_scr[i], mask, last, vnews[i], dots)
                   for i in range(hg)]
        for i in range(hg):
          vacc_scr[i] = vacc_scr[i] + vnews[i]
          s_end = updates[i] if s_bases is None else s_bases[i] + updates[i]

          @pl.when(ends == 0)
          def _():
            carry_ref[i] = s_end

          if want_final:
            @pl.when(ends == 1)
            def _():
              state_scr[i] = s_end
              pltpu.sync_copy(state_scr.at[i], fs_ref.at[b, slot, hb * hg + i])

      @pl.when(has_state == 1)
      def _():
        if has_h0:  # a document starting here enters with its slot's initial state
          @pl.when(cont == 0)
          def _():
            for i in range(hg):
              pltpu.sync_copy(h0_ref.at[b, slot, hb * hg + i], carry_ref.at[i])

        outs = cm.piece_with_state_heads(
            [g_scr[i] for i in range(hg)], [q_scr[i] for i in range(hg)],
            [k_scr[i] for i in range(hg)], [beta_scr[i] for i in range(hg)],
            [tinv_scr[i] for i in range(hg)], [u_scr[i] for i in range(hg)], mask, first, last,
            [carry_ref[i] for i in range(hg)], dots)
        for i, (_, o_add, _) in enumerate(outs):
          oacc_scr[i] = oacc_scr[i] + o_add
        finish([vnew for vnew, _, _ in outs], [s_base for _, _, s_base in outs])

      @pl.when(has_state == 0)
      def _():
        finish([jnp.where(mask, u_scr[i], 0.0) for i in range(hg)], None)

      return carry

    lax.fori_loop(0, count, piece, 0)
    for i in range(hg):
      o = oacc_scr[i] + dots.nn(aqk_scr[i], vacc_scr[i])
      o_ref[:, i * vp:(i + 1) * vp] = jnp.where(valid_row, o, 0.0).astype(out_dtype)


def matmul_precision(dtype) -> cm.Dots:
  """The MXU precision of every matmul but the cumulative gate's: bf16 operands with float32
  accumulation (one MXU pass) for bfloat16 inputs, the UT inverse included (their 5e-3 relative
  tolerance holds: tests/kernels/test_inference_numerics.py, b3_packed_bounded_bf16 rel L2 of o
  3.1e-3 with a bf16 or a float32 inverse alike); float32 at HIGHEST (six passes) for float32 inputs
  (1e-4 absolute). Two exceptions for bfloat16 inputs: the state update and the state's
  contribution to the output are bf16x3 (`Dots.tn3` / `nn3`: the nearly-parallel-keys case needs
  them, see `_chunk_math.piece_state_update`), and the inverse's 16-row diagonal blocks are float32
  on the VPU. The cumulative gate is exact for both (`_chunk_math.cumsum_rows_split`): summed from
  one bf16 pass it would be off by ~0.1 nats over a chunk. tools/tpu_cost.py, TPU7x seed shape
  (ESTIMATE): 0.962 ms with a float32 inverse, 0.472 ms with the bf16 one (before the 16-row VPU
  blocks)."""
  return cm.Dots(bf16=jnp.dtype(dtype) == jnp.bfloat16)


def heads_per_step(num_heads: int, kp: int, vp: int) -> int:
  """Heads one grid step processes (their chains are independent and issued stage by stage, so their
  MXU latencies overlap, and the step count drops by that factor): the largest of 8, 4, 2, 1 dividing
  H, 4 at most for K or V of 256 (VMEM). tools/tpu_cost.py, TPU7x seed shape, float32 inverse
  (ESTIMATE): 4 heads 1.026 ms, 8 heads 0.962 ms."""
  cap = 4 if max(kp, vp) > LANE else 8
  return next(d for d in (8, 4, 2, 1) if d <= cap and num_heads % d == 0)


def kda_pallas_tpu(q2, k2, v2, g2, beta_t, seg, *, num_heads, key_dim, scale,
                   use_l2norm, a_log=None, dt_bias=None, lower_bound=None, initial_state=None,
                   num_segments=1, want_final=False, interpret=False):
  """Runs the Mosaic kernel on prepared operands (see the module docstring for layouts).

  Args:
    q2, k2, g2: `[B, Tp, H*Kp]`; v2: `[B, Tp, H*Vp]` (Kp, Vp multiples of 128, Tp of 64), or all
      four head-major `[B, Tp, H, D]` (read in place; `heads_layout_ok` must hold).
    beta_t: `[B, H, Tp2]` (Tp2 = Tp rounded up to 128), float32 or bfloat16.
    seg: int32 `[B or 1, Tp2]` segment labels (0 = padding, also past T; one row when every batch
      row shares the map). The kernel builds each chunk's piece table from them in SMEM.
    a_log: float32 `[H]` (read as SMEM scalars; the kernel takes exp), dt_bias: float32
      `[1, H*Kp]` (lane-dense, zero on padded lanes): the in-kernel gate, or None.
    initial_state: float32 `[B, N, H, Kp, Vp]` or None.
    interpret: False, or a `pltpu.InterpretParams` to simulate the TPU on CPU.

  Returns:
    (o `[B, Tp, H*Vp]` (or `[B, Tp, H, Vp]` for head-major inputs) in q's dtype, final
    `[B, N, H, Kp, Vp]` float32 or None).
  """
  heads_layout = q2.ndim == 4
  bsz, tp = q2.shape[:2]
  kp = q2.shape[-1] if heads_layout else q2.shape[2] // num_heads
  vp = v2.shape[-1] if heads_layout else v2.shape[2] // num_heads
  nc = tp // C
  gate = a_log is not None
  has_h0 = initial_state is not None
  words = ss.chunk_table_words(num_segments)
  shared = seg.shape[0] == 1  # one segment map for every row
  npair = seg.shape[1] // LANE
  seg = seg.reshape(-1)  # 1-D SMEM blocks of 128 labels (two chunks)
  row0 = lambda b: (0 if shared else b) * npair

  hg = heads_per_step(num_heads, kp, vp)
  if heads_layout:
    if not heads_layout_ok(num_heads, kp, vp, q2.dtype):
      raise ValueError(f"head-major operands need H % 8 == 0 and K, V <= 128, got H={num_heads}, "
                       f"K={kp}, V={vp}")
    if hg == num_heads:  # [B, T*H, D]: strided rows
      q2, k2, v2, g2 = (x.reshape(bsz, tp * num_heads, x.shape[-1]) for x in (q2, k2, v2, g2))
      blk_k = pl.BlockSpec((None, C * hg, kp), lambda b, h, c: (b, c, 0))
      blk_v = pl.BlockSpec((None, C * hg, vp), lambda b, h, c: (b, c, 0))
    else:
      blk_k = pl.BlockSpec((None, C, hg, kp), lambda b, h, c: (b, c, h, 0))
      blk_v = pl.BlockSpec((None, C, hg, vp), lambda b, h, c: (b, c, h, 0))
  else:
    blk_k = pl.BlockSpec((None, C, hg * kp), lambda b, h, c: (b, c, h))
    blk_v = pl.BlockSpec((None, C, hg * vp), lambda b, h, c: (b, c, h))
  blk_o = pl.BlockSpec((None, C, hg * vp), lambda b, h, c: (b, c, h))
  in_specs = [
      pl.BlockSpec((LANE,), lambda b, h, c: (row0(b) + jnp.maximum(c // PAIR - 1, 0),),
                   memory_space=pltpu.SMEM),
      pl.BlockSpec((LANE,), lambda b, h, c: (row0(b) + c // PAIR,), memory_space=pltpu.SMEM),
      pl.BlockSpec((LANE,), lambda b, h, c: (row0(b) + jnp.minimum(c // PAIR + 1, npair - 1),),
                   memory_space=pltpu.SMEM),
      blk_k, blk_k, blk_v, blk_k,
      pl.BlockSpec((None, num_heads, LANE), lambda b, h, c: (b, 0, c // PAIR))]
  operands = [seg, seg, seg, q2, k2, v2, g2, beta_t]
  if gate:
    in_specs += [pl.BlockSpec(memory_space=pltpu.SMEM),
                 pl.BlockSpec((1, hg * kp), lambda b, h, c: (0, h))]
    operands += [a_log, dt_bias]
  aliases = {}
  if has_h0:
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    operands.append(initial_state)
  elif want_final:
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    operands.append(jnp.zeros((bsz, num_segments, num_heads, kp, vp), jnp.float32))
  if want_final:
    aliases = {len(operands) - 1: 1}

  out_shape = [jax.ShapeDtypeStruct((bsz, tp, num_heads * vp), q2.dtype)]
  out_specs = [blk_o]
  if want_final:
    out_shape.append(jax.ShapeDtypeStruct((bsz, num_segments, num_heads, kp, vp), jnp.float32))
    out_specs.append(pl.BlockSpec(memory_space=pl.ANY))

  f32 = jnp.float32
  scratch = [pltpu.VMEM((hg, kp, vp), f32),  # state of the open document (carried / DMAed in)
             pltpu.VMEM((hg, C, kp), f32), pltpu.VMEM((hg, C, kp), f32),  # G, q~
             pltpu.VMEM((hg, C, kp), f32),  # k
             pltpu.VMEM((hg, C, C), f32), pltpu.VMEM((hg, C, C), f32),  # (I + beta Akk)^-1, Aqk
             pltpu.VMEM((hg, C, vp), f32), pltpu.VMEM((hg, C, vp), f32),  # U, Vnew
             pltpu.VMEM((hg, C, vp), f32),  # O
             pltpu.VMEM((hg, C, 1), f32),  # beta column
             pltpu.VMEM((hg, kp, vp), f32),  # a final state on its way to HBM
             pltpu.SMEM((words,), jnp.int32)]  # this chunk's piece table
  if heads_layout and hg == num_heads and jnp.dtype(q2.dtype).itemsize == 2:
    scratch += [pltpu.VMEM((C * hg, kp), f32)] * 3 + [pltpu.VMEM((C * hg, vp), f32)]  # q k v g
  kernel = functools.partial(
      _kernel, heads_per_step=hg, scale=float(scale), use_l2norm=use_l2norm, gate=gate, lower_bound=lower_bound,
      has_h0=has_h0, want_final=want_final, key_dim=key_dim, out_dtype=q2.dtype,
      dots=matmul_precision(q2.dtype), num_chunks=nc, heads_layout=heads_layout)
  outs = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(bsz, num_heads // hg, nc), in_specs=in_specs,
      out_specs=out_specs, scratch_shapes=scratch, input_output_aliases=aliases,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary"),
          vmem_limit_bytes=vmem_limit_bytes(kp, vp, num_heads, hg)),
      interpret=interpret, name="kda_inference_tpu")(*operands)
  return outs[0], (outs[1] if want_final else None)


def heads_layout_ok(num_heads: int, kp: int, vp: int, dtype) -> bool:
  """Whether the kernel can read `[B, T, H, D]` operands in place (`_head_reader`): a step's heads
  are whole (8, 128) tiles of one token (a multiple of 8 heads per step), float32 or bfloat16."""
  return (heads_per_step(num_heads, kp, vp) % 8 == 0
          and jnp.dtype(dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)))


def vmem_limit_bytes(kp: int, vp: int, num_heads: int, hg: int = 1) -> int:
  """VMEM plan for `hg` heads per step: double-buffered input/output blocks + scratch, with 2x
  headroom for the kernel's temporaries (score blocks, exponent tiles), at least 32 MiB."""
  f4 = 4
  blocks = 2 * (hg * (3 * C * kp + 2 * C * vp) + max(num_heads, 16) * LANE) * f4
  scratch = hg * (3 * C * kp + 2 * C * C + 3 * C * vp + C * LANE + 2 * kp * vp) * f4
  return max(32 << 20, 2 * (blocks + scratch) + (8 << 20))
