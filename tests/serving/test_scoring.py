"""model/engine/scoring.py: per-token log-probs and perplexity against transformers' goldens, state carried
across windows, packing independence, and the figures' formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest

from model.engine.scoring import Scorer, ScoringError


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
  """Windows of 8 tokens (the 40-token document spans all five windows of its row; the others share the second
  row) give the same log-probs as one window of 96 that holds every document whole."""
  model, _ = load("dense", "kda_reference")
  docs = _documents(reference("dense"))
  small = Scorer(model, seq_len=8, batch_size=2, num_slots=3).score(docs)
  whole = Scorer(model, seq_len=96, batch_size=1, num_slots=3).score(docs)
  assert small.num_windows == 5 and whole.num_windows == 1
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
