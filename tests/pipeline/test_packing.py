"""Packing invariants for training rows and evaluation windows.

Oracles are written here from the documents alone: the token stream with each token's
(document, offset), and a per-document running-sum recurrence standing in for a stateful model.
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from model.data.pipeline import carry_initial_states, pack_documents, pack_eval_windows

PAD = 0
docs_st = st.lists(st.integers(0, 40), min_size=0, max_size=14).map(
    # Token values encode (document, offset) so the oracle can recover them from any row:
    # value = 1000 * (doc + 1) + offset + 1 > 0, never equal to PAD.
    lambda lens: [np.arange(n, dtype=np.int64) + 1000 * (i + 1) + 1 for i, n in enumerate(lens)])


def _doc_off(v):
  return v // 1000 - 1, v % 1000 - 1


def _runs(seg_row):
  """[(label, start, end)] of the non-zero runs of one row."""
  out, t = [], 0
  while t < len(seg_row):
    if seg_row[t]:
      s = t
      while t < len(seg_row) and seg_row[t] == seg_row[s]:
        t += 1
      out.append((int(seg_row[s]), s, t))
    else:
      t += 1
  return out


def _check_train_rows(docs, b, seq_len, max_segments, split):
  r = b.inputs.shape[0]
  assert all(a.shape == (r, seq_len) for a in b)
  assert b.inputs.dtype == b.targets.dtype == b.segment_ids.dtype == b.positions.dtype == np.int32
  assert b.loss_mask.dtype == bool
  # Every token appears exactly once, in document order (next-fit keeps order).
  stream = b.inputs[b.segment_ids > 0]
  np.testing.assert_array_equal(stream, np.concatenate([np.zeros(0, np.int64)] + list(docs)))
  assert (b.inputs[b.segment_ids == 0] == PAD).all()
  pieces_per_doc = {}
  for row in range(r):
    seg = b.segment_ids[row]
    runs = _runs(seg)
    # labels 1..n left to right, padding only after the last segment
    assert [lab for lab, _, _ in runs] == list(range(1, len(runs) + 1))
    assert not seg[runs[-1][2]:].any() if runs else not seg.any()
    if max_segments is not None:
      assert len(runs) <= max_segments
    for lab, s, e in runs:
      np.testing.assert_array_equal(b.positions[row, s:e], np.arange(e - s))  # restart at 0
      d, off = _doc_off(b.inputs[row, s:e])
      assert (d == d[0]).all() and (np.diff(off) == 1).all()  # one contiguous piece of one doc
      pieces_per_doc[int(d[0])] = pieces_per_doc.get(int(d[0]), 0) + 1
    assert (b.positions[row][seg == 0] == 0).all()
  # Loss mask: exactly the positions whose next token is the next token of the same document.
  seg = b.segment_ids
  nxt = np.concatenate([seg[:, 1:], np.zeros((r, 1), np.int32)], axis=1)
  np.testing.assert_array_equal(b.loss_mask, (seg != 0) & (nxt == seg))
  d_in, o_in = _doc_off(b.inputs[b.loss_mask])
  d_tg, o_tg = _doc_off(b.targets[b.loss_mask])
  np.testing.assert_array_equal(d_tg, d_in)  # no cross-document target
  np.testing.assert_array_equal(o_tg, o_in + 1)
  assert (b.targets[~b.loss_mask] == PAD).all()
  # Split modes
  for i, d in enumerate(docs):
    if len(d) == 0:
      continue
    if split == "long":
      assert pieces_per_doc[i] == -(-len(d) // seq_len)  # short docs are never cut
    elif split == "none":
      assert pieces_per_doc[i] == 1
  if split == "fill" and max_segments is None:
    assert (seg[:-1] != 0).all()  # every row but the last is full


@settings(max_examples=150)
@given(docs_st, st.integers(2, 24), st.one_of(st.none(), st.integers(1, 5)),
       st.sampled_from(["none", "long", "fill"]))
def test_train_packing_invariants(docs, seq_len, max_segments, split):
  if split == "none" and any(len(d) > seq_len for d in docs):
    with pytest.raises(ValueError, match="split='long'"):
      pack_documents(docs, seq_len, max_segments=max_segments, split=split, pad_id=PAD)
    return
  b = pack_documents(docs, seq_len, max_segments=max_segments, split=split, pad_id=PAD)
  _check_train_rows(docs, b, seq_len, max_segments, split)


def test_train_packing_hand_example():
  b = pack_documents([[5, 6, 7], [8, 9], [1, 2, 3, 4, 5, 6, 7]], 6, split="long", pad_id=0)
  np.testing.assert_array_equal(b.inputs, [[5, 6, 7, 8, 9, 0], [1, 2, 3, 4, 5, 6], [7, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(b.segment_ids, [[1, 1, 1, 2, 2, 0], [1] * 6, [1, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(b.positions, [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5], [0] * 6])
  np.testing.assert_array_equal(b.targets, [[6, 7, 0, 9, 0, 0], [2, 3, 4, 5, 6, 0], [0] * 6])
  np.testing.assert_array_equal(b.loss_mask.astype(int), [[1, 1, 0, 1, 0, 0], [1] * 5 + [0], [0] * 6])


@pytest.mark.parametrize("kwargs,needle", [
    ({"seq_len": 1}, "seq_len"),
    ({"seq_len": 8, "max_segments": 0}, "max_segments"),
    ({"seq_len": 8, "split": "cut"}, "split must be one of"),
])
def test_pack_bad_args(kwargs, needle):
  with pytest.raises(ValueError, match=needle):
    pack_documents([[1, 2]], **kwargs)


def test_pack_bad_documents():
  with pytest.raises(ValueError, match=r"documents\[1\]"):
    pack_documents([[1], [[1, 2]]], 4)
  with pytest.raises(ValueError, match=r"documents\[0\] has token ids outside"):
    pack_documents([[-1, 2]], 4)


def _run_windows_with_carry(windows):
  """A stateful toy model: per-document running sum of token values, state carried per slot."""
  outs = []
  final = None
  for w in windows:
    b, t = w.inputs.shape
    n = w.continues.shape[1]
    init = np.zeros((b, n, 1)) if final is None else np.asarray(carry_initial_states(final, w))
    state = init[..., 0].copy()
    out = np.zeros((b, t))
    for row in range(b):
      for pos in range(t):
        lab = w.segment_ids[row, pos]
        if lab:
          state[row, lab - 1] += w.inputs[row, pos]
          out[row, pos] = state[row, lab - 1]
    final = state[..., None]
    outs.append(out)
  return outs


@settings(max_examples=100)
@given(docs_st, st.integers(2, 16), st.integers(1, 4), st.one_of(st.none(), st.integers(1, 4)))
def test_eval_windows_invariants(docs, seq_len, batch, max_segments):
  windows = pack_eval_windows(docs, seq_len, batch, max_segments=max_segments, pad_id=PAD)
  total = sum(len(d) for d in docs)
  if total == 0:
    assert windows == []
    return
  n_slots = windows[0].continues.shape[1]
  if max_segments is not None:
    assert n_slots == max_segments
  seen_inputs, seen_targets = [], []
  for wi, w in enumerate(windows):
    assert w.inputs.shape == (batch, seq_len) and w.continues.shape == (batch, n_slots)
    for row in range(batch):
      runs = _runs(w.segment_ids[row])
      assert [lab for lab, _, _ in runs] == list(range(1, len(runs) + 1))
      assert len(runs) <= n_slots
      assert (w.doc_index[row, len(runs):] == -1).all()
      for lab, s, e in runs:
        d, off = _doc_off(w.inputs[row, s:e])
        assert (d == w.doc_index[row, lab - 1]).all()
        np.testing.assert_array_equal(off, w.doc_offset[row, lab - 1] + np.arange(e - s))
        np.testing.assert_array_equal(w.positions[row, s:e], off)  # positions continue
        if w.continues[row, lab - 1]:
          assert lab == 1 and off[0] > 0 and wi > 0
          prev = windows[wi - 1]
          pl = w.prev_label[row, 0]
          assert prev.doc_index[row, pl - 1] == d[0]
          assert prev.segment_ids[row, -1] == pl  # the previous row ended inside this document
        else:
          assert off[0] == 0 and w.prev_label[row, lab - 1] == 0
        seen_inputs += list(zip(d.tolist(), off.tolist()))
      m = w.loss_mask[row]
      d_in, o_in = _doc_off(w.inputs[row][m])
      d_tg, o_tg = _doc_off(w.targets[row][m])
      np.testing.assert_array_equal(d_tg, d_in)
      np.testing.assert_array_equal(o_tg, o_in + 1)
      seen_targets += list(zip(d_tg.tolist(), o_tg.tolist()))
      assert (w.targets[row][~m] == PAD).all() and (w.segment_ids[row][m] != 0).all()
  # Every token is an input once, every token but a document's first is a target once.
  expected_in = [(i, j) for i, d in enumerate(docs) for j in range(len(d))]
  assert sorted(seen_inputs) == expected_in
  assert sorted(seen_targets) == [(i, j) for i, j in expected_in if j > 0]
  # Carrying the state with `carry_initial_states` reproduces running each document whole.
  for w, out in zip(windows, _run_windows_with_carry(windows)):
    live = w.segment_ids > 0
    d, off = _doc_off(w.inputs[live])
    expected = np.array([np.cumsum(docs[i])[j] for i, j in zip(d, off)])
    np.testing.assert_array_equal(out[live], expected)


def test_eval_windows_hand_example():
  w0, w1 = pack_eval_windows([[1, 2, 3, 4, 5], [6, 7]], 4, 1)
  np.testing.assert_array_equal(w0.inputs, [[1, 2, 3, 4]])
  np.testing.assert_array_equal(w0.targets, [[2, 3, 4, 5]])  # 4 predicts 5 in the next window
  assert w0.loss_mask.all() and not w0.continues.any()
  np.testing.assert_array_equal(w1.inputs, [[5, 6, 7, 0]])
  np.testing.assert_array_equal(w1.segment_ids, [[1, 2, 2, 0]])
  np.testing.assert_array_equal(w1.positions, [[4, 0, 1, 0]])
  np.testing.assert_array_equal(w1.loss_mask.astype(int), [[0, 1, 0, 0]])
  np.testing.assert_array_equal(w1.continues, [[True, False]])
  np.testing.assert_array_equal(w1.prev_label, [[1, 0]])
  np.testing.assert_array_equal(w1.doc_index, [[0, 1]])
  np.testing.assert_array_equal(w1.doc_offset, [[4, 0]])


def test_carry_initial_states_gathers_by_prev_label():
  w = pack_eval_windows([[1] * 3, [2] * 6], 4, 1)[1]  # row: doc1 (cont., prev label 2), pad
  final = np.arange(2 * 3, dtype=np.float32).reshape(1, 2, 3)  # [B=1, N=2, 3]
  out = np.asarray(carry_initial_states(final, w))
  np.testing.assert_array_equal(out, [[[3, 4, 5], [0, 0, 0]]])
  with pytest.raises(ValueError, match=r"\[B, N\]"):
    carry_initial_states(np.zeros((1, 3, 2)), w)
