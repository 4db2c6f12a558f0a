"""Pallas TPU (Mosaic) kernel for packed-sequence KDA inference with native segment IDs.

Grid `(B, H, NC)`: batch and head are parallel, the chunk axis is sequential ("arbitrary"). Every
block index is arithmetic in the grid position, so nothing about the packing steers a DMA: one grid
step per 64-row chunk builds the chunk's matrices once (cumulative gate, masked Akk / Aqk, the UT
inverse, U), then loops over the chunk's pieces (the runs of one document inside it, from the
per-chunk table of `_segment_schedule.build_chunk_table`, delivered as a per-step SMEM block: SMEM
use does not grow with B or T). Each piece applies its incoming state: the carried state in VMEM
scratch when it continues the previous chunk's open document, its slot's initial state (copied
from HBM by a synchronous DMA) when one is given, none otherwise.

Per-slot final states live in HBM (`memory_space=ANY`): the output is aliased to the initial states
(zeros when none are given) and each document's final state is DMAed into its slot at the step where
the document ends, so slots that never appear keep their initial state.

Layouts (prepared by `kda_plugin.ops.inference`): q, k, g `[B, Tp, H*Kp]`, v and o `[B, Tp, H*Vp]`
(the lane-dense layout of the model's projections, K and V multiples of 128, T of 64: no copy when
already aligned); beta `[B, H, Tp2]` (Tp2 = Tp rounded up to 128; XLA keeps a `[B, T, H]` beta
with T minor, so this is a free transpose), one block holding every head's rows of two chunks,
lane-dense. The segment map never enters the kernel as a vector: each step rebuilds its chunk's
label column from the piece table.

Math: `_chunk_math` (../shared/docs/kda.md section 2, ../shared/docs/segment_native_chunk.md).
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
MAX_KV = 256  # K and V padded above this would overflow the VMEM plan (states are [Kp, Vp] float32)


def _bits(word, offset, width):
  return lax.shift_right_logical(word, offset) & ((1 << width) - 1)


def _chunk_rows(row, c):
  """This chunk's half of a `[1, 128]` lane-dense row (two chunks) as a float32 `[C, 1]` column."""
  col = cm.row_to_col(row.astype(jnp.float32))
  return jnp.where(c % PAIR == 0, col[:C], col[C:])


def _kernel(table_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, *refs, scale, use_l2norm, gate,
            lower_bound, has_h0, want_final, key_dim, out_dtype):
  it = iter(refs)
  aexp_ref, dtb_ref = (next(it), next(it)) if gate else (None, None)
  h0_ref = next(it) if has_h0 else None
  if want_final and not has_h0:
    next(it)  # the zeros aliased to the final states: never read
  o_ref = next(it)
  fs_ref = next(it) if want_final else None
  (carry_ref, g_scr, q_scr, k_scr, tinv_scr, aqk_scr, u_scr, vacc_scr, oacc_scr,
   beta_scr, state_scr) = it

  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
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
    beta = jnp.where(valid_row, _chunk_rows(cm.row_at(beta_ref[...].astype(jnp.float32), h), c), 0.0)
    q = q_ref[...].astype(jnp.float32)
    k = k_ref[...].astype(jnp.float32)
    if use_l2norm:
      q, k = cm.l2norm_rows(q), cm.l2norm_rows(k)
    q = q * scale
    g = g_ref[...].astype(jnp.float32)
    if gate:
      g = cm.activate_gate(g, aexp_ref[...], dtb_ref[...], lower_bound)
      g = jnp.where(cm.iota(g.shape, 1) < key_dim, g, 0.0)  # padded lanes stay at g = 0
    g = jnp.where(valid_row, g, 0.0)
    seg_row = cm.col_to_row(seg_col.astype(jnp.float32)).astype(jnp.int32)
    G, tinv, aqk = cm.chunk_prep(q, k, g, beta, seg_col, seg_row, blocked=True)
    g_scr[...] = G
    q_scr[...] = q
    k_scr[...] = k
    tinv_scr[...] = tinv
    aqk_scr[...] = aqk
    beta_scr[...] = beta
    u_scr[...] = cm.dot(tinv, beta * v_ref[...].astype(jnp.float32))
    vacc_scr[...] = jnp.zeros_like(vacc_scr)
    oacc_scr[...] = jnp.zeros_like(oacc_scr)

    def piece(i, carry):
      label = table_ref[1 + ss.WORDS_PER_PIECE * i]
      word = table_ref[2 + ss.WORDS_PER_PIECE * i]
      first, last = _bits(word, ss.PIECE_FIRST, 8), _bits(word, ss.PIECE_LAST, 8)
      cont, ends = _bits(word, ss.PIECE_CONT, 1), _bits(word, ss.PIECE_ENDS, 1)
      has_state = _bits(word, ss.PIECE_HAS_STATE, 1)
      slot = label - 1
      mask = seg_col == label

      def finish(vnew, s_base):
        vacc_scr[...] += vnew
        s_end = s_base + cm.piece_state_update(g_scr[...], k_scr[...], mask, last, vnew)

        @pl.when(ends == 0)
        def _():
          carry_ref[...] = s_end

        if want_final:
          @pl.when(ends == 1)
          def _():
            state_scr[...] = s_end
            pltpu.sync_copy(state_scr, fs_ref.at[b, slot, h])

      @pl.when(has_state == 1)
      def _():
        if has_h0:  # a document starting here enters with its slot's initial state
          @pl.when(cont == 0)
          def _():
            pltpu.sync_copy(h0_ref.at[b, slot, h], carry_ref)

        vnew, o_add, s_base = cm.piece_with_state(
            g_scr[...], q_scr[...], k_scr[...], beta_scr[...], tinv_scr[...], u_scr[...], mask,
            first, last, carry_ref[...])
        oacc_scr[...] += o_add
        finish(vnew, s_base)

      @pl.when(has_state == 0)
      def _():
        finish(jnp.where(mask, u_scr[...], 0.0), jnp.zeros(carry_ref.shape, jnp.float32))

      return carry

    lax.fori_loop(0, count, piece, 0)
    o = oacc_scr[...] + cm.dot(aqk_scr[...], vacc_scr[...])
    o_ref[...] = jnp.where(valid_row, o, 0.0).astype(out_dtype)


def kda_pallas_tpu(q2, k2, v2, g2, beta_t, table, *, num_heads, key_dim, scale,
                   use_l2norm, a_exp=None, dt_bias=None, lower_bound=None, initial_state=None,
                   num_segments=1, want_final=False, interpret=False):
  """Runs the Mosaic kernel on prepared operands (see the module docstring for layouts).

  Args:
    q2, k2, g2: `[B, Tp, H*Kp]`; v2: `[B, Tp, H*Vp]` (Kp, Vp multiples of 128, Tp of 64).
    beta_t: `[B, H, Tp2]` (Tp2 = Tp rounded up to 128), float32 or bfloat16.
    table: int32 `[B or 1, NC, ss.chunk_table_words(N)]` from `ss.build_chunk_table` (one row when
      every batch row shares the segment map).
    a_exp, dt_bias: float32 `[H, 1, Kp]` (in-kernel gate) or None.
    initial_state: float32 `[B, N, H, Kp, Vp]` or None.
    interpret: False, or a `pltpu.InterpretParams` to simulate the TPU on CPU.

  Returns:
    (o `[B, Tp, H*Vp]` in q's dtype, final `[B, N, H, Kp, Vp]` float32 or None).
  """
  bsz, tp, hk = q2.shape
  kp = hk // num_heads
  vp = v2.shape[2] // num_heads
  nc = tp // C
  gate = a_exp is not None
  has_h0 = initial_state is not None
  words = table.shape[2]
  shared = table.shape[0] == 1  # one segment map for every row: one table row
  # one step's entry as a 1-D SMEM block: 1-D blocks need a multiple of 128 words
  words_p = -(-words // LANE) * LANE
  table = jnp.pad(table, ((0, 0), (0, 0), (0, words_p - words))).reshape(-1)

  blk_k = pl.BlockSpec((None, C, kp), lambda b, h, c: (b, c, h))
  blk_v = pl.BlockSpec((None, C, vp), lambda b, h, c: (b, c, h))
  in_specs = [
      pl.BlockSpec((words_p,), lambda b, h, c: ((0 if shared else b) * nc + c,),
                   memory_space=pltpu.SMEM),
      blk_k, blk_k, blk_v, blk_k,
      pl.BlockSpec((None, num_heads, LANE), lambda b, h, c: (b, 0, c // PAIR))]
  operands = [table, q2, k2, v2, g2, beta_t]
  if gate:
    gspec = pl.BlockSpec((None, 1, kp), lambda b, h, c: (h, 0, 0))
    in_specs += [gspec, gspec]
    operands += [a_exp, dt_bias]
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
  out_specs = [blk_v]
  if want_final:
    out_shape.append(jax.ShapeDtypeStruct((bsz, num_segments, num_heads, kp, vp), jnp.float32))
    out_specs.append(pl.BlockSpec(memory_space=pl.ANY))

  f32 = jnp.float32
  scratch = [pltpu.VMEM((kp, vp), f32),  # state of the open document (carried / DMAed in)
             pltpu.VMEM((C, kp), f32), pltpu.VMEM((C, kp), f32), pltpu.VMEM((C, kp), f32),  # G, q~, k
             pltpu.VMEM((C, C), f32), pltpu.VMEM((C, C), f32),  # (I + beta Akk)^-1, Aqk
             pltpu.VMEM((C, vp), f32), pltpu.VMEM((C, vp), f32), pltpu.VMEM((C, vp), f32),  # U, Vnew, O
             pltpu.VMEM((C, 1), f32),  # beta column
             pltpu.VMEM((kp, vp), f32)]  # a final state on its way to HBM
  kernel = functools.partial(
      _kernel, scale=float(scale), use_l2norm=use_l2norm, gate=gate, lower_bound=lower_bound,
      has_h0=has_h0, want_final=want_final, key_dim=key_dim, out_dtype=q2.dtype)
  outs = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(bsz, num_heads, nc), in_specs=in_specs,
      out_specs=out_specs, scratch_shapes=scratch, input_output_aliases=aliases,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary"),
          vmem_limit_bytes=vmem_limit_bytes(kp, vp, num_heads)),
      interpret=interpret, name="kda_inference_tpu")(*operands)
  return outs[0], (outs[1] if want_final else None)


def vmem_limit_bytes(kp: int, vp: int, num_heads: int) -> int:
  """VMEM plan: double-buffered input/output blocks + scratch, with 2x headroom for the kernel's
  temporaries (score blocks, exponent tiles), at least 32 MiB."""
  f4 = 4
  blocks = 2 * (3 * C * kp + 2 * C * vp + max(num_heads, 16) * LANE) * f4
  scratch = (3 * C * kp + 2 * C * C + 3 * C * vp + C * LANE + 2 * kp * vp) * f4
  return max(32 << 20, 2 * (blocks + scratch) + (8 << 20))
