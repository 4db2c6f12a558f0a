"""Kimi-Linear host: an independent NumPy oracle, packing, prefill/decode, caches across windows,
backend agreement and the clear errors. Tiny config, float32 unless stated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.nn.kimi_linear import last_token_logits
from tests.model import helpers, oracle

REF = ("attention=kda_reference",)
RNG = np.random.default_rng(2024)
DOCS = [RNG.integers(3, 64, n) for n in (7, 9, 5)]          # three documents, 21 tokens
T = 24


def _packed_and_alone():
  """Row 0: the three documents packed (labels 1, 3, 2: gapped order) + padding; rows 1-3: each alone."""
  ids = np.zeros((4, T), np.int32)
  seg = np.zeros((4, T), np.int32)
  ids[0, :21] = np.concatenate(DOCS)
  seg[0, :21] = np.repeat([1, 3, 2], [7, 9, 5])
  for r, d in enumerate(DOCS, start=1):
    ids[r, :d.size], seg[r, :d.size] = d, 1
  return jnp.asarray(ids), jnp.asarray(seg)


@pytest.fixture(scope="module")
def reference_logits():
  model, gd, st = helpers.build(*REF)
  ids, seg = _packed_and_alone()
  return np.asarray(helpers.forward_fn(gd, "eval", 3)(st, ids, seg))


def test_matches_numpy_float64_oracle(reference_logits):
  model, _, _ = helpers.build(*REF)
  params = oracle.flat_params(model)
  starts = [0, 7, 16]
  for d, s in zip(DOCS, starts):
    want = oracle.forward(params, model.args, d)
    np.testing.assert_allclose(reference_logits[0, s:s + d.size], want, atol=2e-6, rtol=0)


def test_packed_documents_equal_each_document_alone(reference_logits):
  starts = [0, 7, 16]
  for r, (d, s) in enumerate(zip(DOCS, starts), start=1):
    np.testing.assert_allclose(reference_logits[0, s:s + d.size], reference_logits[r, :d.size], atol=1e-5, rtol=0)


# Prefill of packed prompts, then decode; compared with one forward over each whole sequence.
PROMPT_IDS = np.zeros((2, 12), np.int32)
PROMPT_SEG = np.zeros((2, 12), np.int32)
PROMPT_IDS[0, :9] = RNG.integers(3, 64, 9)
PROMPT_SEG[0, :9] = [1] * 5 + [2] * 4                      # row 0: docs of 5 and 4 tokens
PROMPT_IDS[1, :8] = RNG.integers(3, 64, 8)
PROMPT_SEG[1, :8] = 2                                       # row 1: label 2 only; slot 0 stays empty
N_STEPS = 3
DECODE_TOKENS = RNG.integers(3, 64, (N_STEPS, 4)).astype(np.int32)   # [step, sequence]
FULL_T = 15


def _sequence_prompts():
  """Prompt tokens of decode sequence s = row * 2 + label - 1."""
  out = []
  for row in range(2):
    for label in (1, 2):
      out.append(PROMPT_IDS[row][PROMPT_SEG[row] == label])
  return out


def _full_forward(seqs):
  ids = np.zeros((len(seqs), FULL_T), np.int32)
  seg = np.zeros((len(seqs), FULL_T), np.int32)
  for r, s in enumerate(seqs):
    ids[r, :s.size], seg[r, :s.size] = s, 1
  _, gd, st = helpers.build(*REF)
  return np.asarray(helpers.forward_fn(gd, "eval", 3)(st, jnp.asarray(ids), jnp.asarray(seg)))


@pytest.fixture(scope="module")
def prefilled():
  _, gd, st = helpers.build(*REF)
  return helpers.prefill_fn(gd, 2, 16)(st, jnp.asarray(PROMPT_IDS), jnp.asarray(PROMPT_SEG), None)


def test_prefill_then_decode_equals_full_forward(prefilled):
  _, gd, st = helpers.build(*REF)
  logits, cache = prefilled
  prompts = _sequence_prompts()
  np.testing.assert_array_equal(np.asarray(cache.lengths), [p.size for p in prompts])
  assert cache.layers[0].state.shape == (4, 2, 8, 8) and cache.layers[0].state.dtype == jnp.float32
  assert cache.layers[0].conv_q.shape == (4, 3, 16)
  assert cache.layers[1].latent.shape == (4, 16, 12)
  steps = []
  for j in range(N_STEPS):
    step_logits, cache = helpers.decode_fn(gd)(st, jnp.asarray(DECODE_TOKENS[j]), cache)
    steps.append(np.asarray(step_logits))
  full = _full_forward([np.concatenate([p, DECODE_TOKENS[:, s]]) for s, p in enumerate(prompts)])
  for s, p in enumerate(prompts):
    row, label = divmod(s, 2)
    np.testing.assert_allclose(np.asarray(logits)[row][PROMPT_SEG[row] == label + 1], full[s, :p.size],
                               atol=1e-5, rtol=0)
    for j in range(N_STEPS):
      np.testing.assert_allclose(steps[j][s], full[s, p.size + j], atol=1e-5, rtol=0, err_msg=f"seq {s} step {j}")
  last = np.asarray(last_token_logits(logits, jnp.asarray(PROMPT_SEG), 2))
  np.testing.assert_allclose(last[3], full[3, prompts[3].size - 1], atol=1e-5, rtol=0)
  assert not last[2].any()                                   # the empty slot


# Second windows: the MLA prefix attention takes its first N (= 2) tokens as one region, the rest as
# another; "mixed" puts tokens of both slots of a row in that second region (per-token latent
# gathers), "one_slot" only tokens of one slot per row there (one latent block shared per row).
SECOND_WINDOWS = {"mixed": ([1, 1, 1, 2, 2], [1, 1, 1, 1, 2, 2, 2]),
                  "one_slot": ([1, 2, 2, 2, 2, 2], [2, 1, 1, 1, 1])}


@pytest.mark.parametrize("layout", sorted(SECOND_WINDOWS))
def test_prefill_continues_documents_across_windows(prefilled, layout):
  """A second window with an incoming cache equals the forward over each whole document (KDA state,
  conv windows and MLA latent prefix carried per slot; slot 0 of row 1 starts a new document)."""
  _, gd, st = helpers.build(*REF)
  _, cache = prefilled
  ids = np.zeros((2, 12), np.int32)
  seg = np.zeros((2, 12), np.int32)
  for r, labels in enumerate(SECOND_WINDOWS[layout]):
    ids[r, :len(labels)] = RNG.integers(3, 64, len(labels))
    seg[r, :len(labels)] = labels
  logits2, cache2 = helpers.prefill_fn(gd, 2, 16)(st, jnp.asarray(ids), jnp.asarray(seg), cache)
  prompts = _sequence_prompts()
  new = [ids[r][seg[r] == lab] for r in range(2) for lab in (1, 2)]
  full = _full_forward([np.concatenate([p, q]) for p, q in zip(prompts, new)])
  for s, (p, q) in enumerate(zip(prompts, new)):
    row, label = divmod(s, 2)
    np.testing.assert_allclose(np.asarray(logits2)[row][seg[row] == label + 1], full[s, p.size:p.size + q.size],
                               atol=1e-5, rtol=0, err_msg=f"sequence {s}")
  np.testing.assert_array_equal(np.asarray(cache2.lengths), [p.size + q.size for p, q in zip(prompts, new)])


def test_prefix_streamed_in_blocks_equals_one_block(prefilled, monkeypatch):
  """The MLA prefix attention streams over the cache in blocks of PREFIX_BLOCK tokens (online softmax,
  only the blocks holding valid tokens): with blocks of 2 (prefixes of 0, 4, 5 and 8 tokens: up to four
  blocks, two slots per row, a cache of 16 = 8 blocks) the second window equals the one-block result to 1e-6."""
  from flax import nnx
  from model.nn import mla
  _, gd, st = helpers.build(*REF)
  _, cache = prefilled
  assert int(np.max(np.asarray(cache.lengths))) > 2 * 3  # a prefix spans four blocks of 2
  ids = RNG.integers(3, 64, (2, 6)).astype(np.int32)
  seg = np.array([[1, 1, 1, 2, 2, 0], [1, 1, 2, 2, 2, 2]], np.int32)

  def second_window():
    f = jax.jit(lambda st, i, s, c: nnx.merge(gd, st).prefill(i, s, cache=c))  # traced anew: reads PREFIX_BLOCK
    return f(st, jnp.asarray(ids), jnp.asarray(seg), cache)

  one_logits, one_cache = second_window()
  monkeypatch.setattr(mla, "PREFIX_BLOCK", 2)
  blk_logits, blk_cache = second_window()
  np.testing.assert_allclose(np.asarray(blk_logits), np.asarray(one_logits), atol=1e-6, rtol=0)
  for a, b in zip(jax.tree.leaves(blk_cache), jax.tree.leaves(one_cache)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)


# kda_native's train route and kda_chunked's every sequence mode call the same op (kda_chunked), so
# one compile of each op covers the three backends: native/eval -> kda_inference, chunked/train ->
# kda_chunked, reference -> kda_reference.
@pytest.mark.parametrize("backend, mode", [("kda_native", "eval"), ("kda_chunked", "train")])
def test_backends_agree_float32(reference_logits, backend, mode):
  _, gd, st = helpers.build(f"attention={backend}")
  got = np.asarray(helpers.forward_fn(gd, mode, 3)(st, *_packed_and_alone()))
  seg = np.asarray(_packed_and_alone()[1])
  np.testing.assert_allclose(got[seg > 0], reference_logits[seg > 0], atol=1e-5, rtol=0)


def test_native_prefill_agrees_with_reference(prefilled):
  _, gd, st = helpers.build("attention=kda_native")
  logits, cache = helpers.prefill_fn(gd, 2, 16)(st, jnp.asarray(PROMPT_IDS), jnp.asarray(PROMPT_SEG), None)
  valid = PROMPT_SEG > 0
  np.testing.assert_allclose(np.asarray(logits)[valid], np.asarray(prefilled[0])[valid], atol=1e-5, rtol=0)
  for got, want in zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(prefilled[1])):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-5, rtol=0)


# slow (about 40 s of CPU): make test keeps the float32 agreement of every backend and mode.
@pytest.mark.slow
def test_backends_agree_bfloat16():
  bf16 = ("dtype=bfloat16", "weight_dtype=bfloat16")
  ids, seg = _packed_and_alone()
  valid = np.asarray(seg) > 0
  _, gd_ref, st_ref = helpers.build(*REF, *bf16)
  want = np.asarray(helpers.forward_fn(gd_ref, "eval", 3)(st_ref, ids, seg), np.float32)[valid]
  errors = {}
  for backend, mode in (("kda_native", "eval"), ("kda_chunked", "train")):
    _, gd, st = helpers.build(f"attention={backend}", *bf16)
    got = helpers.forward_fn(gd, mode, 3)(st, ids, seg)
    assert got.dtype == jnp.bfloat16
    errors[backend] = helpers.rel_rms(np.asarray(got, np.float32)[valid], want)
  assert max(errors.values()) <= 5e-3, errors


def test_clear_errors():
  model, _, _ = helpers.build(*REF)
  ids = jnp.asarray(PROMPT_IDS)
  with pytest.raises(ValueError, match="decode needs a cache"):
    model.decode(ids[:, 0], None)
  with pytest.raises(ValueError, match="mode must be one of"):
    model(ids, mode="prefill")
  with pytest.raises(ValueError, match="label 3 but only 2 document slots"):
    model(ids, jnp.asarray(np.where(PROMPT_SEG == 2, 3, PROMPT_SEG)), max_num_segments=2)
  cache = model.init_cache(2, num_slots=2, cache_length=4)
  with pytest.raises(ValueError, match="S=4"):
    model.decode(ids[:, 0], cache)
  # cache_length=4 holds 8 slots (rounded up to a multiple of 8, cache.mla_rows): 12 tokens do not fit
  with pytest.raises(ValueError, match="needs 12 MLA cache entries but cache_length is 8"):
    model.prefill(ids, jnp.ones(ids.shape, jnp.int32), cache=cache)
  with pytest.raises(ValueError, match="positions must have"):
    model(ids, positions=jnp.zeros((2, 3), jnp.int32))


def test_train_mode_gradients_match_finite_differences():
  """Directional derivative of a logits functional through every layer type (reference backend)."""
  from flax import nnx
  _, gd, st = helpers.build(*REF)
  ids = jnp.asarray(PROMPT_IDS[:1, :9])
  seg = jnp.asarray(PROMPT_SEG[:1, :9])
  probe = jnp.asarray(np.random.default_rng(1).normal(size=(1, 9, 64)), jnp.float32)

  def loss(state):
    return jnp.sum(nnx.merge(gd, state)(ids, seg, mode="train", max_num_segments=2) * probe)

  grads = jax.jit(jax.grad(loss))(st)
  rng = np.random.default_rng(3)
  direction = jax.tree_util.tree_map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), st)
  analytic = sum(float(jnp.vdot(g, d)) for g, d in zip(jax.tree_util.tree_leaves(grads),
                                                        jax.tree_util.tree_leaves(direction)))
  eps = 1e-4  # small against the 0.02-scale weights (top-k routing must not flip), large against f32 noise
  f = jax.jit(loss)
  shift = lambda sgn: jax.tree_util.tree_map(lambda x, d: x + sgn * eps * d, st, direction)
  numeric = (float(f(shift(1))) - float(f(shift(-1)))) / (2 * eps)
  assert abs(analytic - numeric) <= 2e-2 * abs(numeric) + 1e-3, (analytic, numeric)
