"""`_segment_schedule.build_chunk_table` (the TPU kernel's per-chunk piece table) against a plain
Python walk of the segment map."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_plugin.ops import _segment_schedule as ss

C = ss.CHUNK


def _walk(seg_row, n, has_h0):
  """Per chunk: [(label, first, last, cont, ends, has_state)] by walking the rows one at a time."""
  tp = seg_row.shape[0]
  out = []
  for c in range(tp // C):
    pieces = []
    for r in range(C):
      t = c * C + r
      lab = seg_row[t]
      if lab == 0:
        continue
      if r == 0 or seg_row[t - 1] != lab:
        cont = t > 0 and seg_row[t - 1] == lab
        pieces.append([lab, r, r, int(cont), 0, int(cont or has_h0)])
      pieces[-1][2] = r
    for pc in pieces:
      t_last = c * C + pc[2]
      pc[4] = int(t_last + 1 >= tp or seg_row[t_last + 1] != pc[0])
    out.append(pieces)
  return out


def _decode(table_row, p):
  out = []
  for entry in table_row:
    pieces = []
    for i in range(entry[0]):
      lab, w = int(entry[1 + 2 * i]), int(entry[2 + 2 * i])
      pieces.append([lab, w & 255, (w >> 8) & 255, (w >> 16) & 1, (w >> 17) & 1, (w >> 18) & 1])
    assert np.all(entry[1 + 2 * entry[0]:] == 0)
    out.append(pieces)
  return out


def _random_packings(rng, count, n):
  """`count` rows of 5 chunks, each with up to `n` documents of random lengths (runs of 1 included)
  and random gaps (none, one token, a whole chunk)."""
  rows = []
  for _ in range(count):
    seg = np.zeros(5 * C, np.int32)
    pos, labels = int(rng.integers(0, 3)), list(rng.permutation(np.arange(1, n + 1)))
    while pos < seg.size and labels:
      length = int(rng.choice([1, 1, 2, 5, 17, 40, 64, 90, 130]))
      seg[pos:pos + length] = labels.pop()
      pos += length + int(rng.choice([0, 0, 1, 64]))
    rows.append(seg)
  return rows


@pytest.mark.parametrize("has_h0", [False, True])
def test_table_matches_a_row_walk(has_h0):
  rng = np.random.default_rng(0)
  n = 12
  rows = _random_packings(rng, 4, n)
  rows.append(np.ones(5 * C, np.int32))  # one document through every chunk
  seg = np.stack(rows)
  table = np.asarray(ss.build_chunk_table(jnp.asarray(seg), n, has_initial_state=has_h0))
  assert table.shape == (seg.shape[0], 5, ss.chunk_table_words(n))
  for b in range(seg.shape[0]):
    assert _decode(table[b], ss.pieces_per_chunk(n)) == _walk(seg[b], n, has_h0), seg[b]


def test_table_holds_a_full_chunk_of_single_row_documents():
  seg = np.arange(1, 2 * C + 1, dtype=np.int32)[None]  # 128 documents of one row each
  table = np.asarray(ss.build_chunk_table(jnp.asarray(seg), 2 * C, has_initial_state=False))
  assert table.shape[2] == 1 + 2 * C and list(table[0, :, 0]) == [C, C]
  assert _decode(table[0], C) == _walk(seg[0], 2 * C, False)


def _kernel_tables(seg, n, has_h0):
  """The TPU kernel's in-kernel builder (`pallas_tpu_kernel._build_piece_table`, interpret mode), one
  entry per chunk, from the same three 128-label SMEM blocks the kernel reads."""
  from jax.experimental import pallas as pl  # noqa: PLC0415
  from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415

  from kda_plugin.ops import pallas_tpu_kernel  # noqa: PLC0415

  rows, tp = seg.shape
  nc, lane = tp // C, pallas_tpu_kernel.LANE
  tp2 = -(-tp // lane) * lane
  npair, words = tp2 // lane, -(-ss.chunk_table_words(n) // lane) * lane
  flat = jnp.asarray(np.pad(seg, ((0, 0), (0, tp2 - tp))).reshape(-1))
  smem = lambda f: pl.BlockSpec((lane,), f, memory_space=pltpu.SMEM)

  def kernel(prev_ref, cur_ref, next_ref, out_ref):
    pallas_tpu_kernel._build_piece_table(out_ref, prev_ref, cur_ref, next_ref, pl.program_id(1), nc, has_h0)

  out = pl.pallas_call(
      kernel, grid=(rows, nc),
      in_specs=[smem(lambda b, c: (b * npair + jnp.maximum(c // 2 - 1, 0),)),
                smem(lambda b, c: (b * npair + c // 2,)),
                smem(lambda b, c: (b * npair + jnp.minimum(c // 2 + 1, npair - 1),))],
      out_specs=pl.BlockSpec((words,), lambda b, c: (b * nc + c,), memory_space=pltpu.SMEM),
      out_shape=jax.ShapeDtypeStruct((rows * nc * words,), jnp.int32),
      interpret=pltpu.InterpretParams())(flat, flat, flat)
  return np.asarray(out).reshape(rows, nc, words)


def _decode_used(table_row):
  """Like `_decode`, reading only the words the piece count covers (the kernel leaves the rest)."""
  return [[[int(e[1 + 2 * i]), int(e[2 + 2 * i]) & 255, (int(e[2 + 2 * i]) >> 8) & 255,
            (int(e[2 + 2 * i]) >> 16) & 1, (int(e[2 + 2 * i]) >> 17) & 1, (int(e[2 + 2 * i]) >> 18) & 1]
           for i in range(int(e[0]))] for e in table_row]


@pytest.mark.parametrize("has_h0", [False, True])
def test_in_kernel_table_matches_a_row_walk(has_h0):
  """The TPU kernel builds its piece tables itself (no XLA op): same pieces as the row walk, on
  random packings, a document through every chunk, one-row documents and an odd chunk count (the
  last chunk pair half past the sequence)."""
  rng = np.random.default_rng(1)
  n = 12
  rows = _random_packings(rng, 3, n)
  rows.append(np.ones(5 * C, np.int32))
  rows.append(np.where(np.arange(5 * C) < 2 * C - 1, 0, np.minimum(np.arange(5 * C) - 2 * C + 2, n)
                       ).astype(np.int32))
  seg = np.stack(rows)  # last row: padding, eleven one-row documents, then one long one
  tables = _kernel_tables(seg, n, has_h0)
  for b in range(seg.shape[0]):
    assert _decode_used(tables[b]) == _walk(seg[b], n, has_h0), seg[b]
