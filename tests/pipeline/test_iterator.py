"""The training iterator: a pure function of (seed, step), epoch-aware, resumable."""

import json

import numpy as np
import pytest

from model.data.pipeline import BatchIterator, make_train_iterator, pack_documents
from model.data.tokenizer import IdsOnlyTokenizer


def _rows(num_docs=10, seq_len=6):
  # One document per row (length 4 <= 6, never two in a row with max_segments=1); the first token
  # names the row so the test can identify which row a batch holds.
  docs = [[100 + i, 1, 2, 3] for i in range(num_docs)]
  return pack_documents(docs, seq_len, max_segments=1)


def _ids(batch):
  return (batch.inputs[:, 0] - 100).tolist()


def test_same_seed_same_batches_and_batch_contents():
  rows = _rows()
  a, b = BatchIterator(rows, 3, seed=7), BatchIterator(rows, 3, seed=7)
  for step in [0, 1, 5, 11, 40]:
    x, y = a.batch_at(step), b.batch_at(step)
    for f, g in zip(x, y):
      np.testing.assert_array_equal(f, g)
    # each batch row is the packed row it claims to be, every field
    idx = a.row_indices(step)
    for f, full in zip(x, rows):
      np.testing.assert_array_equal(f, full[idx])
  c = BatchIterator(rows, 3, seed=8)
  assert [_ids(a.batch_at(s)) for s in range(4)] != [_ids(c.batch_at(s)) for s in range(4)]


def test_each_epoch_is_a_permutation_and_epochs_differ():
  it = BatchIterator(_rows(10), 3, seed=0)
  slots = np.concatenate([it.row_indices(s) for s in range(10)])  # 30 slots = 3 epochs
  epochs = slots.reshape(3, 10)
  for e in epochs:
    assert sorted(e.tolist()) == list(range(10))
  assert epochs[0].tolist() != epochs[1].tolist() != epochs[2].tolist()
  assert it.epoch_of(3) == 0 and it.epoch_of(4) == 1  # step 3 covers slots 9..11
  assert it.steps_per_epoch == pytest.approx(10 / 3)


def test_no_shuffle_is_file_order():
  it = BatchIterator(_rows(5), 2, seed=0, shuffle=False)
  assert [_ids(next(it)) for _ in range(3)] == [[0, 1], [2, 3], [4, 0]]


def test_resume_mid_epoch_sees_the_same_batches():
  rows = _rows(10)
  run = BatchIterator(rows, 4, seed=3)
  for _ in range(2):  # mid-epoch: 8 of 10 rows consumed
    next(run)
  saved = json.loads(json.dumps(run.state))  # survives a checkpoint round trip
  expected = [next(run) for _ in range(5)]
  resumed = BatchIterator(rows, 4, seed=3)
  resumed.restore(saved)
  assert resumed.step == 2 and resumed.epoch == 0
  for want in expected:
    got = next(resumed)
    for f, g in zip(want, got):
      np.testing.assert_array_equal(f, g)
  assert BatchIterator(rows, 4, seed=3, start_step=2).batch_at(2).inputs.tolist() == (
      expected[0].inputs.tolist())


@pytest.mark.parametrize("key,value", [("seed", 4), ("num_rows", 11), ("batch_size", 5)])
def test_restore_rejects_other_config(key, value):
  it = BatchIterator(_rows(10), 4, seed=3)
  state = dict(it.state, **{key: value})
  with pytest.raises(ValueError, match=key):
    it.restore(state)


def test_num_epochs_stops_and_pads():
  it = BatchIterator(_rows(5), 3, seed=1, num_epochs=2, pad_id=9)
  batches = list(it)
  assert len(batches) == it.num_steps == 4  # 10 real rows + 2 padding rows
  real = [i for b in batches for i, m in zip(_ids(b), b.segment_ids[:, 0]) if m]
  assert sorted(real) == sorted(list(range(5)) * 2)
  last = batches[-1]
  assert last.segment_ids[0, 0] == 1 and not last.segment_ids[1:].any()
  assert not last.loss_mask[1:].any() and (last.positions[1:] == 0).all()
  assert (last.inputs[1:] == 9).all() and (last.targets[1:] == 9).all()
  with pytest.raises(StopIteration):
    next(it)


def test_bad_arguments():
  rows = _rows(3)
  with pytest.raises(ValueError, match="batch_size"):
    BatchIterator(rows, 0, seed=0)
  with pytest.raises(ValueError, match="num_epochs"):
    BatchIterator(rows, 1, seed=0, num_epochs=0)
  with pytest.raises(ValueError, match="at least one packed row"):
    BatchIterator(pack_documents([], 4), 1, seed=0)
  with pytest.raises(ValueError, match="step"):
    BatchIterator(rows, 1, seed=0).batch_at(-1)


def test_make_train_iterator_uses_train_split_only(tmp_path):
  # 50 documents of ids, one per line; the held-out tail must never reach a training batch.
  p = tmp_path / "c.ids"
  p.write_text("".join(f"{i} {i} {i}\n" for i in range(10, 60)))
  tok = IdsOnlyTokenizer(100, bos_id=1, eos_id=2, pad_id=0)
  it = make_train_iterator(p, "ids", tok, seq_len=8, batch_size=4, seed=0)
  seen = set()
  for step in range(3 * int(np.ceil(it.steps_per_epoch))):
    b = it.batch_at(step)
    seen |= set(b.inputs[b.segment_ids > 0].tolist())
  assert seen == {1, 2} | set(range(10, 55))  # the last 5 of 50 equal-length lines are held out


def test_process_rows_yield_only_that_slice_of_each_global_batch():
  """A multi-host job's share: each process's iterator gives exactly its rows of the global batch
  (the two halves together are the whole batch, across an epoch boundary and the padding past the
  last epoch), with the same step and state as the whole-batch iterator."""
  rows = _rows(7)
  whole = BatchIterator(rows, 4, seed=5, num_epochs=2)
  halves = [BatchIterator(rows, 4, seed=5, num_epochs=2, process_rows=slice(0, 2)),
            BatchIterator(rows, 4, seed=5, num_epochs=2, process_rows=slice(2, 4))]
  steps = 0
  for full, first, second in zip(whole, *halves):
    for a, b0, b1 in zip(full, first, second):
      assert b0.shape[0] == b1.shape[0] == 2
      np.testing.assert_array_equal(np.concatenate([b0, b1]), a)
    steps += 1
  assert steps == whole.num_steps == 4
  assert halves[0].state == halves[1].state == whole.state
  with pytest.raises(ValueError, match="contiguous slice of the 4 batch rows"):
    whole.batch_at(0, slice(2, 6))
