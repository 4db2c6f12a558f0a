"""model/engine/scoring.py: per-token log-probs and perplexity against transformers' goldens, state carried
across windows, packing independence, and the figures' formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest

from model.engine.scoring import Schedule, Scorer, ScoringError, ScoringOutOfMemory, plan_schedules


# The sharded checkpoint (about 40 s of CPU) runs under make test-slow; dense stays in make test.
@pytest.mark.parametrize("name", ["dense", pytest.param("sharded", marks=pytest.mark.slow)])
def test_logprobs_match_transformers_across_windows(load, reference, name):
  """Windows of 16 tokens, one row: each 24-token reference sequence is cut at a window end and
  continues from its carried KDA state, conv windows and MLA latents (kda_native, as served)."""
  model, _ = load(name, "kda_native")
  ref = reference(name)
  res = Scorer(model, seq_len=16, batch_size=1, num_slots=8).score(list(ref["input_ids"]))
  assert res.num_windows == 3 and res.num_tokens == ref["next_token_logprobs"].size
  for got, want in zip(res.logprobs, ref["next_token_logprobs"]):
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  want_ppl = math.exp(-np.mean(ref["next_token_logprobs"].astype(np.float64)))
  assert abs(res.perplexity - want_ppl) <= 1e-4 * want_ppl


def _documents(ref):
  """A 40-token document (the two reference rows, truncated and joined), a 24-token one, and a short one."""
  ids = ref["input_ids"]
  return [np.concatenate([ids[0], ids[1, :16]]), ids[1], ids[0, 3:9]]


def test_long_document_equals_a_window_that_fits(load, reference):
  """Windows of 8 tokens (the 40- and 24-token documents are long there: one pass of two rows, five windows
  for the 40-token one; the 6-token one gets the packed pass) give the same log-probs as one window of 96
  that holds every document whole."""
  model, _ = load("dense", "kda_reference")
  docs = _documents(reference("dense"))
  small = Scorer(model, seq_len=8, batch_size=2, num_slots=3).score(docs)
  whole = Scorer(model, seq_len=96, batch_size=1, num_slots=3).score(docs)
  assert small.schedules == [Schedule((2,), 2, 3, 64, False, 1), Schedule((0, 1), 2, 1, 64, True, 5)]
  assert small.num_windows == 6 and whole.num_windows == 1
  assert small.num_tokens == whole.num_tokens == sum(d.size - 1 for d in docs)
  for a, b in zip(small.logprobs, whole.logprobs):
    np.testing.assert_allclose(a, b, atol=2e-6, rtol=0)


def test_figures(load, reference):
  model, _ = load("dense", "kda_reference")
  docs = _documents(reference("dense"))
  res = Scorer(model, seq_len=64, batch_size=1, num_slots=3).score(docs)
  flat = np.concatenate(res.logprobs)
  assert np.all(flat < 0) and res.total_logprob == pytest.approx(flat.sum(), rel=1e-12)
  assert res.perplexity == pytest.approx(math.exp(-flat.mean()), rel=1e-12)
  assert res.bits_per_byte(100) == pytest.approx(-flat.sum() / math.log(2) / 100, rel=1e-12)


def test_ids_outside_vocabulary(load):
  model, _ = load("dense", "kda_reference")
  with pytest.raises(ScoringError, match=r"document 1 holds token ids outside the vocabulary \[0, 512\): \[512\]"):
    Scorer(model, seq_len=8).score([[3, 4], [5, 512]])


def test_plan_sizes_the_cache_per_document():
  """Documents of at most 2T tokens share the packed pass (B rows x N slots, cache = the longest of them);
  each longer one gets a pass whose cache is its own length's power of two, one slot per row, min(B, count)
  rows: a 40,004-token document no longer sizes the cache of the 64 slots of the short ones (it did: every
  slot got round_up(40004, 64) entries)."""
  lengths = [40004, 300, 30, 793, 0, 1100, 1500, 1025]
  plan = plan_schedules(lengths, seq_len=512, batch_size=8, num_slots=8, cache_multiple=64)
  assert plan == [Schedule((1, 2, 3), 8, 8, 832, False), Schedule((5, 6, 7), 3, 1, 2048, True),
                  Schedule((0,), 1, 1, 65536, True)]
  # A model without MLA layers: its cache does not grow with a document, so one packed pass.
  assert plan_schedules(lengths, seq_len=512, batch_size=8, num_slots=8, has_mla=False) == [
      Schedule((0, 1, 2, 3, 5, 6, 7), 8, 8, 64, False)]
  assert plan_schedules([3, 5], seq_len=2, batch_size=4, num_slots=2, cache_multiple=4) == [
      Schedule((0,), 4, 2, 4, False), Schedule((1,), 1, 1, 8, True)]


def _long_and_short(seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 500, n) for n in (300, 7, 12, 5)]


def test_long_document_in_windows_equals_one_window(load):
  """A 300-token document in windows of 16 (19 windows; from the 9th on its MLA prefix streams over more
  than one block of 128 cached tokens) scores every token as one window of 512 holding the whole corpus:
  per-token log-probs within 2e-6 and perplexity within 1e-5 relative; the long pass's cache holds 512
  entries (300's power of two), the packed pass's 64 (the 12-token document rounded up)."""
  from model.nn import mla
  assert 300 > 2 * mla.PREFIX_BLOCK  # the prefix loop runs several blocks
  model, _ = load("dense", "kda_reference")
  docs = _long_and_short()
  small = Scorer(model, seq_len=16, batch_size=2, num_slots=3).score(docs)
  whole = Scorer(model, seq_len=512, batch_size=1, num_slots=4).score(docs)
  assert small.schedules == [Schedule((1, 2, 3), 2, 3, 64, False, 1), Schedule((0,), 1, 1, 512, True, 19)]
  assert whole.schedules == [Schedule((0, 1, 2, 3), 1, 4, 320, False, 1)]
  assert small.num_tokens == whole.num_tokens == sum(d.size - 1 for d in docs)
  for a, b in zip(small.logprobs, whole.logprobs):
    np.testing.assert_allclose(a, b, atol=2e-6, rtol=0)
  assert abs(small.perplexity - whole.perplexity) <= 1e-5 * whole.perplexity


def _oom(*a, **k):
  import jax
  raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 46918120464 bytes.\nmore")


@pytest.mark.parametrize("lengths, batch, want", [
    # One long document alone: its rows are 1 and its cache shrinks with nothing; only T lowers the window.
    ((40, 5), 8, "lower max_target_length (windows of 1 x 8 tokens; the cache of document 0 (40 tokens), "
                 "1 x 64 MLA entries per layer ("),
    # Two long documents in one pass: two rows, so eval_batch_size lowers it too.
    ((40, 50, 5), 8, "lower max_target_length or eval_batch_size (windows of 2 x 8 tokens; the cache of 2 "
                     "documents (the longest 50 tokens), 2 x 64 MLA entries per layer ("),
])
def test_out_of_memory_names_only_the_keys_that_lower_that_pass(load, monkeypatch, lengths, batch, want):
  """The long pass runs out of memory: the advice names the keys that lower ITS memory (was: always
  `max_target_length or eval_batch_size`, although neither lowered a cache sized to the longest document)."""
  from tools.perplexity import SCORER_KEYS
  model, _ = load("dense", "kda_reference")
  rng = np.random.default_rng(1)
  docs = [rng.integers(3, 500, n) for n in lengths]
  scorer = Scorer(model, seq_len=8, batch_size=batch, num_slots=3, names=SCORER_KEYS)
  real = scorer._window_fn
  monkeypatch.setattr(scorer, "_window_fn", lambda rows, slots, length: _oom() if slots == 1 else
                      real(rows, slots, length))
  with pytest.raises(ScoringOutOfMemory) as e:
    scorer.score(docs)
  msg = str(e.value)
  assert msg.startswith("out of memory (RESOURCE_EXHAUSTED: Out of memory allocating 46918120464 bytes.): " + want), msg
  assert e.value.schedule.long and "max_num_segments" not in msg
  assert msg.endswith("MiB in all), shrinks with no key)"), msg


def test_out_of_memory_in_the_packed_pass_names_its_three_keys(load, monkeypatch):
  from tools.perplexity import SCORER_KEYS
  model, _ = load("dense", "kda_reference")
  scorer = Scorer(model, seq_len=8, batch_size=2, num_slots=3, names=SCORER_KEYS)
  monkeypatch.setattr(scorer, "_window_fn", _oom)
  with pytest.raises(ScoringOutOfMemory, match=r"\): lower max_target_length, eval_batch_size or max_num_segments "
                     r"\(windows of 2 x 8 tokens with 3 documents per row, an MLA cache of 2 x 3 x 64 entries"):
    scorer.score([[3, 4, 5], [6, 7]])
