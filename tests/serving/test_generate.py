"""model/serving.py: greedy generation against transformers' goldens, batching invariance, and every
cached decode step against a cache-free forward."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.serving import GenerationError, Generator, SamplingParams, pack_prompts

NEW = 12  # the fixtures' greedy continuation length


def _generator(model, cfg, batch_size=8):
  return Generator(model, max_length=int(cfg.max_cache_length), eos_id=int(cfg.eos_token_id),
                   pad_id=int(cfg.pad_token_id), batch_size=batch_size)


@pytest.mark.parametrize("name", ["dense", "sharded"])
def test_greedy_matches_transformers(load, reference, name):
  """Both reference prompts in one packed prefill + batched cached decode (kda_native, as served)
  reproduce transformers' `generate(do_sample=False)` token for token (its margins are >= 9.8e-4)."""
  model, cfg = load(name, "kda_native")
  ref = reference(name)
  results, timings = _generator(model, cfg).generate(list(ref["prompt_ids"]), NEW, stop_at_eos=False)
  got = np.array([r.token_ids for r in results])
  np.testing.assert_array_equal(got, ref["greedy_ids"])
  assert [r.finish_reason for r in results] == ["length", "length"]
  assert timings.prefill_tokens == ref["prompt_ids"].size and timings.decode_tokens == 2 * (NEW - 1)


def _three_prompts(ref):
  """The two reference prompts plus a short one; different lengths."""
  return [ref["prompt_ids"][0].tolist(), ref["prompt_ids"][1, :7].tolist(), ref["input_ids"][1, 12:17].tolist()]


def test_three_prompts_together_equal_each_alone(load, reference):
  model, cfg = load("dense", "kda_reference")
  ref = reference("dense")
  prompts = _three_prompts(ref)
  together, _ = _generator(model, cfg).generate(prompts, NEW, stop_at_eos=False)
  alone = _generator(model, cfg, batch_size=1)
  for p, r in zip(prompts, together):
    single, _ = alone.generate([p], NEW, stop_at_eos=False)
    assert single[0].token_ids == r.token_ids
  # The packed batch also reproduces transformers for the full-length reference prompt.
  assert together[0].token_ids == ref["greedy_ids"][0].tolist()


@functools.lru_cache(maxsize=None)
def _forward(graphdef):
  return jax.jit(lambda state, ids, seg: nnx.merge(graphdef, state)(ids, seg, mode="eval", max_num_segments=1))


def test_every_cached_step_equals_uncached_argmax(load, reference):
  """For every decode step of a batch of three, the token chosen from the cache equals the argmax
  of a full forward over prompt + tokens so far, recomputed without any cache."""
  model, cfg = load("dense", "kda_reference")
  prompts = _three_prompts(reference("dense"))
  steps = 10
  results, _ = _generator(model, cfg).generate(prompts, steps, stop_at_eos=False)
  width = max(len(p) for p in prompts) + steps
  rows, segs, last = [], [], []
  for p, r in zip(prompts, results):
    seq = p + r.token_ids
    for i in range(steps):        # row predicting r.token_ids[i] from seq[:len(p) + i]
      n = len(p) + i
      rows.append(np.pad(seq[:n], (0, width - n)))
      segs.append((np.arange(width) < n).astype(np.int32))
      last.append(n - 1)
  graphdef, state = nnx.split(model)
  logits = np.asarray(_forward(graphdef)(state, jnp.asarray(np.array(rows, np.int32)), jnp.asarray(np.array(segs))))
  want = logits[np.arange(len(rows)), last].argmax(-1).reshape(len(prompts), steps)
  got = np.array([r.token_ids for r in results])
  np.testing.assert_array_equal(got, want)


def test_eos_stops_one_sequence_and_masks_it(load, reference):
  """A sequence that emits EOS stops (EOS kept as its last token), the others run on unchanged."""
  model, cfg = load("dense", "kda_reference")
  ref = reference("dense")
  prompts = _three_prompts(ref)
  free, _ = _generator(model, cfg).generate(prompts, NEW, stop_at_eos=False)
  eos = free[0].token_ids[3]   # pretend the 4th greedy token of prompt 0 is EOS
  gen = Generator(model, max_length=int(cfg.max_cache_length), eos_id=eos, pad_id=0)
  stopped, _ = gen.generate(prompts, NEW)
  first = [r.token_ids.index(eos) if eos in r.token_ids else None for r in free]
  for f, s, k in zip(free, stopped, first):
    if k is None:
      assert s.token_ids == f.token_ids and s.finish_reason == "length"
    else:
      assert s.token_ids == f.token_ids[:k + 1] and s.finish_reason == "eos"
  assert stopped[0].finish_reason == "eos" and len(stopped[0].token_ids) <= 4


def test_sampling_is_seeded_and_per_sequence(load, reference):
  model, cfg = load("dense", "kda_reference")
  prompts = _three_prompts(reference("dense"))
  gen = _generator(model, cfg)
  params = SamplingParams("topk", 1.5, top_k=20)
  a, _ = gen.generate(prompts, 6, sampling_params=params, seed=7, stop_at_eos=False)
  b, _ = gen.generate(prompts, 6, sampling_params=params, seed=7, stop_at_eos=False)
  c, _ = gen.generate(prompts, 6, sampling_params=params, seed=8, stop_at_eos=False)
  assert [r.token_ids for r in a] == [r.token_ids for r in b]
  assert [r.token_ids for r in a] != [r.token_ids for r in c]
  vocab = int(cfg.vocab_size)
  assert all(0 <= t < vocab for r in a for t in r.token_ids)


def test_pack_prompts_layout():
  ids, seg = pack_prompts([[5, 6, 7], [8], [9, 10]], 4, 8)
  np.testing.assert_array_equal(ids, [[5, 6, 7, 8, 9, 10, 0, 0]])
  np.testing.assert_array_equal(seg, [[1, 1, 1, 2, 3, 3, 0, 0]])


def test_request_errors(load):
  model, cfg = load("dense", "kda_reference")
  gen = _generator(model, cfg)
  limit = int(cfg.max_cache_length)
  cases = [
      (([[]], 4), "prompt 0 is empty"),
      (([[3, 4], [512]], 4), r"prompt 1 holds token ids outside the vocabulary \[0, 512\)"),
      (([[3] * (limit + 1)], 4), f"longer than the model's limit max_cache_length={limit}"),
      (([[3] * (limit - 2)], 4), "lower max_new_tokens or raise max_cache_length"),
      (([[3]], 0), "max_new_tokens must be >= 1"),
      (([], 4), "no prompts"),
  ]
  for (prompts, new), msg in cases:
    with pytest.raises(GenerationError, match=msg):
      gen.check_request(prompts, new)
  with pytest.raises(GenerationError, match="unknown sampling strategy 'beam'"):
    SamplingParams("beam")
