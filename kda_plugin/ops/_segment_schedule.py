"""The per-chunk piece table that lets the Pallas TPU kernel walk a packed sequence in place.

A packed row of `Tp` tokens is cut into `NC = Tp / C` chunks of `C = 64` rows. A *piece* is the part of
one document that lies inside one chunk (a contiguous run of one label). The TPU kernel's grid is
(B, H, NC) with arithmetic block indices, so nothing about the packing steers a DMA: each grid step
builds its own chunk's entry in SMEM scratch from the chunk's labels (`pallas_tpu_kernel._build_piece_table`)
and loops over the chunk's pieces, the "short loop over the segments present in the chunk" of
docs/packing.md section 'Segment-native chunk algorithm'. `build_chunk_table` below is the same table
in XLA: the definition the tests compare the kernel's table with.

An entry is `1 + 2 * P` int32 words, P = min(C, N) (a chunk holds at most one run per label and at
most C runs): word 0 is the chunk's piece count, then two words per piece in row order, the label and
a packed word (`PIECE_*` bit offsets below). SMEM holds one entry and three 128-label blocks whatever
B and T are.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kda_plugin.ops._chunk_common import CHUNK

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
