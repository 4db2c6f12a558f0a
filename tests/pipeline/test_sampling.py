"""Sampling: greedy = argmax; top-k stays in the top k; nucleus keeps the shortest prefix with mass
>= p; weighted draws match softmax(logits / T). Frequencies are checked against NumPy float64
probabilities with a 5-sigma binomial bound per token (fixed keys, so the tests are deterministic).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.engine import sampling
from model.engine.sampling import make_sampler, sample_tokens

N_DRAWS = 40_000


def _softmax64(x):
  x = np.asarray(x, np.float64)
  e = np.exp(x - x.max())
  return e / e.sum()


def _draw(sampler, logits_row, seed):
  logits = jnp.tile(jnp.asarray(logits_row, jnp.float32)[None], (N_DRAWS, 1))
  ids = np.asarray(sampler(logits, jax.random.key(seed)))
  assert ids.shape == (N_DRAWS,) and ids.dtype == np.int32
  return np.bincount(ids, minlength=len(logits_row)) / N_DRAWS


def _assert_freqs(freq, p):
  sigma = np.sqrt(p * (1 - p) / N_DRAWS)
  np.testing.assert_array_less(np.abs(freq - p), 5 * sigma + 1e-12)


LOGITS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, -1.0, -np.inf])


def test_greedy_is_argmax():
  logits = jax.random.normal(jax.random.key(0), (16, 33), jnp.float32)
  want = np.argmax(np.asarray(logits), axis=-1)
  np.testing.assert_array_equal(make_sampler("greedy")(logits), want)
  np.testing.assert_array_equal(sample_tokens(logits, None, strategy="greedy"), want)
  bf16 = logits.astype(jnp.bfloat16)
  np.testing.assert_array_equal(make_sampler("greedy")(bf16), np.argmax(np.asarray(bf16, np.float32), -1))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_weighted_matches_softmax(temperature):
  freq = _draw(make_sampler("weighted", temperature=temperature), LOGITS, seed=1)
  p = _softmax64(LOGITS / temperature)
  _assert_freqs(freq, p)
  assert freq[-1] == 0  # -inf is never drawn
  # The bound is tight enough to see the temperature: T=1 frequencies fail the T=0.7 law.
  other = _softmax64(LOGITS / (1.7 - temperature))
  assert np.any(np.abs(freq - other) > 5 * np.sqrt(other * (1 - other) / N_DRAWS) + 1e-12)


def test_topk_never_outside_top_k():
  logits = jax.random.normal(jax.random.key(2), (4000, 50), jnp.float32)
  ids = np.asarray(make_sampler("topk", top_k=3, temperature=3.0)(logits, jax.random.key(3)))
  top3 = np.argsort(-np.asarray(logits), axis=-1)[:, :3]
  assert (ids[:, None] == top3).any(axis=1).all()
  # With a flat temperature all three candidates do get picked.
  assert len(np.unique(ids[:, None] == top3, axis=0)) == 3


def test_topk_frequencies_and_ties():
  freq = _draw(make_sampler("topk", top_k=3, temperature=0.8), LOGITS, seed=4)
  kept = np.full(len(LOGITS), -np.inf)
  kept[[2, 3, 4]] = LOGITS[[2, 3, 4]]
  _assert_freqs(freq, _softmax64(kept / 0.8))
  # Ties with the k-th value do not widen the candidate set: exactly k tokens (lowest ids).
  tied = jnp.zeros((2000, 6), jnp.float32)
  ids = np.asarray(make_sampler("topk", top_k=2)(tied, jax.random.key(5)))
  assert set(ids.tolist()) == {0, 1}


def test_nucleus_respects_p():
  probs = np.array([0.05, 0.3, 0.15, 0.5])  # sorted: 0.5 (id 3), 0.3 (id 1), 0.15, 0.05
  logits = np.log(probs)
  # p=0.75: 0.5 < 0.75 so id 1 is needed too; 0.8 >= 0.75 so the set stops there.
  freq = _draw(make_sampler("nucleus", top_p=0.75), logits, seed=6)
  _assert_freqs(freq, np.array([0, 0.375, 0, 0.625]))
  # p=0.9: the three most likely (0.5 + 0.3 = 0.8 < 0.9).
  freq = _draw(make_sampler("nucleus", top_p=0.9), logits, seed=7)
  _assert_freqs(freq, np.array([0, 0.3, 0.15, 0.5]) / 0.95)
  # p=1: plain weighted sampling; tiny p: always the most likely token.
  _assert_freqs(_draw(make_sampler("nucleus", top_p=1.0), logits, seed=8), probs)
  assert (_draw(make_sampler("nucleus", top_p=0.01), logits, seed=9) == [0, 0, 0, 1]).all()


def test_nucleus_applies_temperature_first():
  probs = np.array([0.5, 0.3, 0.15, 0.05])
  t = 2.0
  scaled = _softmax64(np.log(probs) / t)  # flatter: about [0.37, 0.29, 0.20, 0.12]
  keep = (np.cumsum(scaled) - scaled) < 0.7
  want = np.where(keep, scaled, 0) / scaled[keep].sum()
  freq = _draw(make_sampler("nucleus", top_p=0.7, temperature=t), np.log(probs), seed=10)
  _assert_freqs(freq, want)
  assert keep.sum() == 3  # at T=1 only two tokens would be kept


def test_same_key_same_tokens_and_eager_equals_jit():
  logits = jax.random.normal(jax.random.key(11), (64, 40), jnp.float32)
  key = jax.random.key(12)
  for kw in [dict(strategy="weighted", temperature=0.9), dict(strategy="topk", top_k=5),
             dict(strategy="nucleus", top_p=0.8)]:
    strategy = kw.pop("strategy")
    s = make_sampler(strategy, **kw)
    a, b = np.asarray(s(logits, key)), np.asarray(s(logits, key))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, sample_tokens(logits, key, strategy=strategy, **kw))
    assert not np.array_equal(a, np.asarray(s(logits, jax.random.key(13))))


def test_greedy_accepts_temperature_zero():
  """Greedy ignores the temperature; 0 (the common spelling of "greedy") is accepted, not refused."""
  logits = jnp.asarray([[0.1, 2.0, -1.0, 2.0]])
  assert int(make_sampler("greedy", temperature=0.0)(logits)[0]) == 1
  assert int(sample_tokens(logits, None, strategy="greedy", temperature=0.0)[0]) == 1


def test_errors_name_the_callers_keys():
  with pytest.raises(ValueError, match=r"^decode_sampling_nucleus_p must be in \(0, 1\], got 1.5$"):
    sampling.check_sampling_args("nucleus", 1.0, None, 1.5, names={"top_p": "decode_sampling_nucleus_p"})


@pytest.mark.parametrize("kwargs,needle", [
    (dict(strategy="beam"), "unknown sampling strategy 'beam'"),
    (dict(strategy="weighted", temperature=0.0), "temperature must be"),
    (dict(strategy="greedy", temperature=-1.0), "temperature must be"),
    (dict(strategy="weighted", temperature=float("nan")), "temperature must be"),
    (dict(strategy="topk"), "needs top_k"),
    (dict(strategy="topk", top_k=0), "top_k must be an integer >= 1"),
    (dict(strategy="topk", top_k=2.5), "top_k must be an integer >= 1"),
    (dict(strategy="nucleus"), "needs top_p"),
    (dict(strategy="nucleus", top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(strategy="nucleus", top_p=1.5), r"top_p must be in \(0, 1\]"),
])
def test_invalid_configuration(kwargs, needle):
  with pytest.raises(ValueError, match=needle):
    make_sampler(**kwargs)
  with pytest.raises(ValueError, match=needle):
    sample_tokens(jnp.zeros((1, 4)), jax.random.key(0), **kwargs)


def test_invalid_call_arguments():
  with pytest.raises(ValueError, match="exceeds the vocabulary size 4"):
    make_sampler("topk", top_k=5)(jnp.zeros((1, 4)), jax.random.key(0))
  with pytest.raises(ValueError, match=r"\[B, V\]"):
    make_sampler("greedy")(jnp.zeros((4,)))
  with pytest.raises(TypeError, match="floating"):
    sample_tokens(jnp.zeros((1, 4), jnp.int32), None)
  with pytest.raises(ValueError, match="needs a PRNG key"):
    make_sampler("weighted")(jnp.zeros((1, 4)))


def test_rows_with_different_parameters_draw_as_each_alone():
  """`sample_rows` (the one sampler every engine runs): a batch mixing the four strategies gives each
  row the token that row draws alone with its own key and parameters."""
  logits = jax.random.normal(jax.random.key(20), (8, 40), jnp.float32)
  keys = jax.random.split(jax.random.key(21), 8)
  configs = [("greedy", 1.0, None, None), ("weighted", 0.7, None, None), ("topk", 1.3, 4, None),
             ("nucleus", 0.9, None, 0.8)] * 2
  rows = [sampling.row_params(*c) for c in configs]
  params = [jnp.asarray([r[i] for r in rows]) for i in range(4)]
  mixed = np.asarray(sampling.sample_rows(logits, keys, *params))
  for b, r in enumerate(rows):
    alone = sampling.sample_rows(logits[b:b + 1], keys[b:b + 1], *(jnp.asarray([x]) for x in r))
    assert int(alone[0]) == mixed[b], configs[b]
  assert mixed[0] == int(jnp.argmax(logits[0]))


def test_sample_step_bans_ids_past_the_vocab_limit_and_reports_logprobs():
  logits = jnp.zeros((3, 10), jnp.float32).at[:, 9].set(5.0)
  s = 3
  tok, lp, top2 = sampling.sample_step(logits, jnp.int32(6), jnp.array([True, False, False]), jnp.ones(s),
                                       jnp.zeros(s, jnp.int32), jnp.ones(s), jnp.arange(s, dtype=jnp.uint32),
                                       jnp.zeros(s, jnp.int32))
  assert (np.asarray(tok) < 6).all() and int(tok[0]) == 0
  np.testing.assert_allclose(np.asarray(lp), np.log(1 / 6), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(top2), np.log(1 / 6), rtol=1e-6)
