"""Schedules that let the Pallas kernels walk a packed sequence in place.

Two forms: the per-row step schedule below (`build_schedule`, used by the GPU kernel), and the
per-chunk piece table at the end of the module (`build_chunk_table`, used by the TPU kernel).

A packed row of `Tp` tokens is cut into `NC = Tp / C` chunks of `C = 64` rows. A *piece* is the part of
one document that lies inside one chunk (a contiguous run of one label). The kernels take one grid
step per piece, in order, plus one step for each chunk holding only padding; all pieces of a chunk
share that chunk's input blocks (the block index does not change, so nothing is re-fetched). This is
the "short loop over the segments present in the chunk" of docs/packing.md section 'Segment-native chunk algorithm'
("Costs and special cases"): no token is moved, no per-token loop is run.

Static bound on the number of steps per row: every chunk has one step for its first piece (or its
padding), and every further piece in a chunk starts a document inside it, so
`steps <= NC + min(N, Tp)` (each label is one run). Rows with fewer steps are padded with no-op steps
that repeat the last real step's block indices, so no block is fetched or written back for them.

Each step is described by `NUM_FIELDS` int32 values (the `F_*` offsets below); the schedule is a flat
int32 array `[B * S * NUM_FIELDS]` so that it can be scalar-prefetched into TPU SMEM.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

CHUNK = 64

(F_CHUNK,      # chunk index of the step
 F_LABEL,      # label of the piece (0: a padding-only chunk or a no-op step)
 F_FIRST,      # first row of the piece inside its chunk
 F_LAST,       # last row of the piece inside its chunk
 F_VALID,      # 1 for a real step, 0 for a padding no-op step
 F_CONT,       # 1 when the piece continues the document open at the end of the previous chunk
 F_ENDS,       # 1 when the document ends inside this piece (its final state is written)
 F_HAS_STATE,  # 1 when the piece's incoming state may be non-zero (continuing, or initial_state given)
 F_FIRST_OF_CHUNK,  # 1 on the first step of a chunk (the chunk's matrices are built)
 F_LAST_OF_CHUNK,   # 1 on the last step of a chunk (the chunk's output is written)
 F_OPEN_END,   # 1 when the document is still open at the chunk's last row (the carried state)
 F_H0_SLOT,    # state slot whose initial-state block is fetched at this step
 F_OUT_SLOT,   # state slot whose final-state block is resident at this step
 F_PASSTHROUGH,  # 1 on step 0 of a row with no document: copy the initial state of slot 0 through
 NUM_FIELDS) = range(15)


def num_steps(seq_len_padded: int, num_segments: int, chunk: int = CHUNK) -> int:
  """Static upper bound S on the steps of one row (see the module docstring)."""
  return seq_len_padded // chunk + min(num_segments, seq_len_padded)


def _fill_from_next(flag, value, fallback):
  """For each step j: `value` at the first step >= j where `flag`, else at the last step < j, else
  `fallback`. Used to keep a resident block index unchanged until the step that needs it."""
  s = flag.shape[-1]
  j = jnp.arange(s, dtype=jnp.int32)
  nxt = lax.cummin(jnp.where(flag, j, s), axis=flag.ndim - 1, reverse=True)
  prv = lax.cummax(jnp.where(flag, j, -1), axis=flag.ndim - 1)
  pick_next = jnp.take_along_axis(value, jnp.minimum(nxt, s - 1), axis=-1)
  pick_prev = jnp.take_along_axis(value, jnp.maximum(prv, 0), axis=-1)
  return jnp.where(nxt < s, pick_next, jnp.where(prv >= 0, pick_prev, fallback))


def build_schedule(seg, num_steps_: int, *, has_initial_state: bool, chunk: int = CHUNK):
  """Builds the step schedule of every row (traceable: works on traced `seg` under jit).

  Args:
    seg: int32 `[B, Tp]` segment map padded with 0 to a multiple of `chunk`; 0 = padding, labels are
      contiguous runs (validated by the caller).
    num_steps_: static S from `num_steps`.
    has_initial_state: whether per-slot initial states are given (a piece starting a document then
      has a possibly non-zero incoming state).
    chunk: C.

  Returns:
    int32 `[B, S, NUM_FIELDS]`.
  """
  b, tp = seg.shape
  nc = tp // chunk
  s = num_steps_
  t = jnp.arange(tp, dtype=jnp.int32)
  zeros_col = jnp.zeros((b, 1), seg.dtype)
  prev = jnp.concatenate([zeros_col, seg[:, :-1]], axis=1)
  nxt = jnp.concatenate([seg[:, 1:], zeros_col], axis=1)
  live = seg != 0
  doc_start = live & (seg != prev)
  doc_end = live & (seg != nxt)
  row = t % chunk
  piece_begin = live & ((row == 0) | (seg != prev))
  chunk_live = jnp.any(live.reshape(b, nc, chunk), axis=-1)          # [B, NC]
  empty_marker = (row == 0) & ~jnp.repeat(chunk_live, chunk, axis=1)
  step_flag = piece_begin | empty_marker
  boundary_after = (row == chunk - 1) | (seg != nxt)
  piece_end = lax.cummin(jnp.where(boundary_after, t, tp), axis=1, reverse=True)  # [B, Tp]

  # Positions of the steps, in order; padded steps repeat the last real one.
  order = jnp.sort(jnp.where(step_flag, t, tp + t), axis=1)
  if order.shape[1] < s:
    order = jnp.concatenate([order, jnp.full((b, s - order.shape[1]), 2 * tp, jnp.int32)], axis=1)
  order = order[:, :s]
  count = jnp.sum(step_flag, axis=1, keepdims=True).astype(jnp.int32)   # >= 1 (NC >= 1)
  j = jnp.arange(s, dtype=jnp.int32)[None, :]
  valid = j < count
  last_real = jnp.take_along_axis(order, count - 1, axis=1)
  pos = jnp.where(valid, order, last_real)

  take = lambda x: jnp.take_along_axis(x, pos, axis=1)
  label = jnp.where(valid, take(seg), 0)
  live_step = label != 0
  chunk_idx = pos // chunk
  first = pos % chunk
  pend = take(piece_end)
  last = pend % chunk
  cont = live_step & ~take(doc_start)
  ends = live_step & jnp.take_along_axis(doc_end, pend, axis=1)
  open_end = live_step & ~ends
  has_state = live_step & (cont | has_initial_state)
  prev_chunk = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), chunk_idx[:, :-1]], axis=1)
  next_chunk = jnp.concatenate([chunk_idx[:, 1:], jnp.full((b, 1), -1, jnp.int32)], axis=1)
  next_valid = jnp.concatenate([valid[:, 1:], jnp.zeros((b, 1), bool)], axis=1)
  first_of_chunk = valid & (chunk_idx != prev_chunk)
  last_of_chunk = valid & ((chunk_idx != next_chunk) | ~next_valid)
  slot = jnp.maximum(label - 1, 0)
  zero = jnp.zeros_like(slot)
  needs_h0 = has_state & ~cont
  h0_slot = _fill_from_next(needs_h0, slot, zero)
  out_slot = _fill_from_next(ends, slot, zero)
  passthrough = (j == 0) & ~jnp.any(ends, axis=1, keepdims=True)

  fields = [chunk_idx, label, first, last, valid, cont, ends, has_state, first_of_chunk,
            last_of_chunk, open_end, h0_slot, out_slot, passthrough]
  assert len(fields) == NUM_FIELDS
  return jnp.stack([f.astype(jnp.int32) for f in fields], axis=-1)


# ---------------------------------------------------------------------------------------------------
# Per-chunk piece table (the Pallas TPU kernel): one grid step per chunk, its pieces looped in place.
#
# The TPU kernel's grid is (B, H, NC) with arithmetic block indices, so the schedule no longer steers
# any DMA and need not be scalar-prefetched whole: each grid step builds only its own chunk's entry
# in SMEM scratch from the chunk's labels (`pallas_tpu_kernel._build_piece_table`; `build_chunk_table` below
# is the same table in XLA, the definition the tests compare it with). An entry is `1 + 2 * P` int32
# words, P = min(C, N) (a chunk holds at most one run per label and at most C runs): word 0 is the
# chunk's piece count, then two words per piece in order, the label and a packed word (`PIECE_*` bit
# offsets below). SMEM holds one entry and three 128-label blocks whatever B and T are.

PIECE_FIRST = 0       # bits 0-7: first row of the piece inside its chunk
PIECE_LAST = 8        # bits 8-15: last row of the piece inside its chunk
PIECE_CONT = 16       # bit 16: the piece continues the document open at the previous chunk's end
PIECE_ENDS = 17       # bit 17: the document ends inside this piece (its final state is written)
PIECE_HAS_STATE = 18  # bit 18: the incoming state may be non-zero (continuing, or initial_state given)
WORDS_PER_PIECE = 2


def pieces_per_chunk(num_segments: int, chunk: int = CHUNK) -> int:
  """P: the most pieces one chunk can hold (one run per label, at most one per row)."""
  return max(1, min(chunk, num_segments))


def chunk_table_words(num_segments: int, chunk: int = CHUNK) -> int:
  """int32 words of one chunk's entry in `build_chunk_table`."""
  return 1 + WORDS_PER_PIECE * pieces_per_chunk(num_segments, chunk)


def build_chunk_table(seg, num_segments: int, *, has_initial_state: bool, chunk: int = CHUNK):
  """Per-chunk piece table of every row (traceable: works on traced `seg` under jit).

  Args:
    seg: int32 `[B, Tp]` segment map padded with 0 to a multiple of `chunk`; 0 = padding, labels are
      contiguous runs in 1..num_segments (validated by the caller).
    num_segments: N, static.
    has_initial_state: whether per-slot initial states are given.

  Returns:
    int32 `[B, NC, chunk_table_words(N)]`: per chunk its piece count, then (label, packed word) per
    piece in row order; unused piece words are 0.
  """
  b, tp = seg.shape
  nc = tp // chunk
  p = pieces_per_chunk(num_segments, chunk)
  zeros_col = jnp.zeros((b, 1), seg.dtype)
  prev = jnp.concatenate([zeros_col, seg[:, :-1]], axis=1).reshape(b, nc, chunk)
  nxt = jnp.concatenate([seg[:, 1:], zeros_col], axis=1).reshape(b, nc, chunk)
  seg3 = seg.reshape(b, nc, chunk)
  live = seg3 != 0
  row = jnp.arange(chunk, dtype=jnp.int32)
  begin = live & ((row == 0) | (seg3 != prev))                    # first row of each piece
  cont = begin & (seg3 == prev)                                    # ... continuing a document
  # the document open at a chunk's last row continues into the next chunk: its piece does not end
  open_end = live[..., -1] & (seg3[..., -1] == nxt[..., -1])                        # [B, NC]

  # Only elementwise ops, reductions over the chunk's 64 rows and one small matmul: XLA's TPU
  # scans (cumsum / cummin lower to reduce-window) and gathers take minutes to compile at B = 256.
  # running[r] = piece starts in rows <= r (exact in float32: 0/1 terms, sums <= 64).
  upper = (row[:, None] <= row[None, :]).astype(jnp.float32)
  running = jnp.einsum("bcr,rs->bcs", begin.astype(jnp.float32), upper,
                       precision=lax.Precision.HIGHEST).astype(jnp.int32)           # [B, NC, C]
  count = running[..., -1]
  j = jnp.arange(p, dtype=jnp.int32)[:, None]                                        # [P, 1]
  rj = running[:, :, None, :]                                                        # [B, NC, 1, C]
  # piece j begins after the rows whose running count is still <= j, and owns the live rows
  # whose count is j + 1
  first = jnp.minimum(jnp.sum((rj <= j).astype(jnp.int32), axis=-1), chunk - 1)      # [B, NC, P]
  length = jnp.sum(((rj == j + 1) & live[:, :, None, :]).astype(jnp.int32), axis=-1)
  last = jnp.maximum(first + length - 1, 0)
  at_first = row == first[..., None]                                                 # [B, NC, P, C]
  label = jnp.sum(jnp.where(at_first, seg3[:, :, None, :], 0), axis=-1)
  cont_p = jnp.sum(jnp.where(at_first, cont[:, :, None, :], False).astype(jnp.int32), axis=-1)
  ends = 1 - ((last == chunk - 1) & open_end[:, :, None]).astype(jnp.int32)
  used = j[:, 0] < count[:, :, None]
  has_state = cont_p | int(has_initial_state)
  packed = (first << PIECE_FIRST | last << PIECE_LAST | cont_p << PIECE_CONT | ends << PIECE_ENDS
            | has_state << PIECE_HAS_STATE)
  words = jnp.stack([jnp.where(used, label, 0), jnp.where(used, packed, 0)], axis=-1)
  words = words.astype(jnp.int32).reshape(b, nc, WORDS_PER_PIECE * p)
  return jnp.concatenate([count[:, :, None], words], axis=-1)
