"""`_segment_schedule.build_chunk_table` (the TPU kernel's per-chunk piece table) against a plain
Python walk of the segment map."""

from __future__ import annotations

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


@pytest.mark.parametrize("has_h0", [False, True])
def test_table_matches_a_row_walk(has_h0):
  rng = np.random.default_rng(0)
  n = 12
  rows = []
  for _ in range(4):
    seg = np.zeros(5 * C, np.int32)
    pos, labels = int(rng.integers(0, 3)), list(rng.permutation(np.arange(1, n + 1)))
    while pos < seg.size and labels:
      length = int(rng.choice([1, 1, 2, 5, 17, 40, 64, 90, 130]))
      seg[pos:pos + length] = labels.pop()
      pos += length + int(rng.choice([0, 0, 1, 64]))
    rows.append(seg)
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
