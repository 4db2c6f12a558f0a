"""model/engine/continuous.py and runner.py on the demo checkpoint: continuous batching against the offline
`Generator` (each prompt alone), chunked prefill against one uncached forward, mixed steps, the
prefix cache, cancellation, request validation and the compilation count.

One engine (4 slots, max_model_len 640, a 128-token step budget: buckets 16, 32, 64, 128) serves
every test of the module; a second engine of the same sizes with the prefix cache on reuses its
step executables (they are shared per model and sizes).
"""

from __future__ import annotations

import contextlib
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.engine.api import Engine, GenerationError, Request, SamplingParams
from model.engine.config import EngineConfig
from model.engine.continuous import ContinuousEngine
from model.engine.generator import Generator
from model.errors import UsageError
from model.loading import load_model

DEMO = pathlib.Path(__file__).resolve().parents[2] / "kda_plugin" / "assets" / "demo"
SLOTS, MAX_LEN, BUDGET = 4, 640, 128


@pytest.fixture(scope="module")
def model():
  return load_model(DEMO)[0]


def _config(**kw):
  return EngineConfig(max_num_seqs=SLOTS, max_model_len=MAX_LEN, max_num_batched_tokens=BUDGET, **kw)


@pytest.fixture(scope="module")
def engine(model):
  return ContinuousEngine(model, _config())


@contextlib.contextmanager
def xla_compiles():
  """Yields a list that gets the seconds of every XLA compilation made inside the block."""
  compiles = []

  def listen(event, seconds, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(seconds)
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield compiles
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


def _prompt(rng, n):
  return tuple(int(t) for t in rng.integers(4, 1000, n))


def run(engine, requests, *, during=None):
  """Runs `requests` to completion; returns {request_id: [TokenEvent...]} and the per-token top-2
  log-probs {request_id: [(a, b)...]}. `during(step_index)` may add or cancel requests."""
  events, top2 = {}, {}
  for r in requests:
    engine.add_request(r)
  i = 0
  while engine.has_unfinished():
    engine.step(lambda e: events.setdefault(e.request_id, []).append(e))
    for rid, t in engine.last_top2.items():
      top2.setdefault(rid, []).append(t)
    if during is not None:
      during(i)
    i += 1
  return events, top2


def tokens(evs):
  return [e.token_id for e in evs if e.token_id is not None]


def logprobs(evs):
  return np.array([e.logprob for e in evs if e.token_id is not None])


def test_is_an_engine(engine):
  assert isinstance(engine, Engine)
  assert engine.runner.buckets == (16, 32, 64, 128)


def test_absent_slots_are_bit_unchanged(engine):
  """A split step that prefills slot 1 only (and decodes none) leaves slots 0, 2, 3 (KDA state, conv
  windows, MLA latents, length) bit for bit as they were: idle slots need no masking in the engine,
  and the sub-pool's unused entries (index S) are dropped, not written to any slot."""
  rng = np.random.default_rng(1)
  s, p = SLOTS, engine.max_num_partial_prefills
  assert p == 4
  runner = engine.runner
  fn = runner.compiled_step(16)
  sampling = (np.ones(s, bool), np.ones(s, np.float32), np.zeros(s, np.int32), np.ones(s, np.float32),
              np.zeros(s, np.uint32), np.zeros(s, np.int32), np.int32(runner.vocab_limit))
  no_decode = (np.zeros(s, np.int32), np.zeros(s, bool))
  ids, seg = np.zeros((2, 16), np.int32), np.zeros((2, 16), np.int32)   # row 1: no tails
  ids[0, :12] = rng.integers(4, 1000, 12)
  seg[0, :4], seg[0, 4:8], seg[0, 8:12] = 1, 2, 3     # sub-pool entries 0, 1, 2 = slots 3, 0, 2
  pool = jax.tree.map(lambda a: jnp.array(a, copy=True), runner.pool.cache)
  *_, before, _ = fn(runner.leaves, pool, *no_decode, ids, seg, np.array([3, 0, 2, s], np.int32), np.ones(p, bool),
                     *sampling)
  before_host = jax.device_get(before)
  ids2, seg2 = np.zeros((2, 16), np.int32), np.zeros((2, 16), np.int32)
  ids2[0, :5], seg2[0, :5] = 7, 1                      # only slot 1, as sub-pool entry 0 (its tail in row 1)
  ids2[1, :3], seg2[1, :3] = 9, 1
  *_, after, _ = fn(runner.leaves, before, *no_decode, ids2, seg2, np.array([1, s, s, s], np.int32),
                    np.array([True, False, False, False]), *sampling)
  after_host = jax.device_get(after)
  assert list(before_host.lengths) == [4, 0, 4, 4] and list(after_host.lengths) == [4, 8, 4, 4]
  for a, b in zip(before_host.layers, after_host.layers):
    for f in a.__dataclass_fields__:
      x, y = getattr(a, f), getattr(b, f)
      for slot in (0, 2, 3):
        np.testing.assert_array_equal(x[slot], y[slot], err_msg=f"{type(a).__name__}.{f} slot {slot}")
      assert not np.array_equal(x[1], y[1])


def test_single_prompt_variant_equals_the_p_slot_step(engine):
  """A step with one prompt chunk runs the bucket's one-prompt executable (sub-pool of 1 slot); it
  gives the tokens, log-probs (1e-5), pool and first-stage `mid` (1e-5) of the same step on the
  P-slot executable, chunk and tail rows included, while 3 slots decode beside it."""
  rng = np.random.default_rng(11)
  s, p = SLOTS, engine.max_num_partial_prefills
  runner = engine.runner
  assert runner.single_prompt_buckets == (16, 32, 64)
  sampling = (np.ones(s, bool), np.ones(s, np.float32), np.zeros(s, np.int32), np.ones(s, np.float32),
              np.zeros(s, np.uint32), np.zeros(s, np.int32), np.int32(runner.vocab_limit))
  # A pool where slots 0, 1, 3 hold 20-token prompts and slot 2 one of 9 tokens.
  ids, seg = np.zeros((2, 64), np.int32), np.zeros((2, 64), np.int32)
  ids[0, :60] = rng.integers(4, 1000, 60)
  seg[0, :20], seg[0, 20:40], seg[0, 40:51], seg[0, 51:60] = 1, 2, 3, 4
  pool = jax.tree.map(lambda a: jnp.array(a, copy=True), runner.pool.cache)
  *_, pool, _ = runner.compiled_step(64)(runner.leaves, pool, np.zeros(s, np.int32), np.zeros(s, bool), ids, seg,
                                          np.array([0, 1, 3, 2], np.int32), np.ones(p, bool), *sampling)
  decode = (rng.integers(4, 1000, s).astype(np.int32), np.array([True, True, False, True]))
  ids, seg = np.zeros((2, 64), np.int32), np.zeros((2, 64), np.int32)
  ids[0, :55], seg[0, :55] = rng.integers(4, 1000, 55), 1     # slot 2 continues: a chunk, then a tail
  ids[1, :30], seg[1, :30] = rng.integers(4, 1000, 30), 1
  runs = []
  for n in (1, p):
    sub = np.full(n, s, np.int32)
    sub[0] = 2
    copy = jax.tree.map(lambda a: jnp.array(a, copy=True), pool)
    runs.append(jax.device_get(runner.compiled_step(64, n)(runner.leaves, copy, *decode, ids, seg, sub,
                                                           np.zeros(n, bool), *sampling)))
  (tok1, lp1, _, pool1, mid1), (tokp, lpp, _, poolp, midp) = runs
  np.testing.assert_array_equal(tok1, tokp)
  np.testing.assert_allclose(lp1, lpp, atol=1e-5, rtol=0)
  np.testing.assert_array_equal(pool1.lengths, [21, 21, 9 + 55 + 30, 12])
  np.testing.assert_array_equal(pool1.lengths, poolp.lengths)
  for a, b in zip(jax.tree.leaves(pool1), jax.tree.leaves(poolp)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
  for a, b in zip(jax.tree.leaves(mid1), jax.tree.leaves(midp)):
    assert a.shape[0] == 1 and b.shape[0] == p
    np.testing.assert_allclose(a[0], b[0], atol=1e-5, rtol=0)
    assert np.abs(a[0]).max() > 0
  with pytest.raises(ValueError, match="no step executable for bucket=128, num_prefill=1"):
    engine.runner.compiled_step(128, 1)


def test_decode_only_step_keeps_inactive_slots(engine):
  """The decode-only executable (`model.decode`) advances the active slots only: inactive slots keep
  their KDA states, conv windows and length bit for bit, and their valid MLA rows."""
  rng = np.random.default_rng(10)
  for i in range(SLOTS):
    engine.add_request(Request(f"d{i}", _prompt(rng, 9 + 7 * i), 40))
  while any(s.prefilling or not s.output_ids for s in engine._running):
    engine.step(lambda e: None)
  runner = engine.runner
  before = jax.device_get(runner.pool.cache)
  s = SLOTS
  active = np.array([True, False, True, False])
  fn = runner.compiled_step(None)
  sampling = (np.ones(s, bool), np.ones(s, np.float32), np.zeros(s, np.int32), np.ones(s, np.float32),
              np.zeros(s, np.uint32), np.zeros(s, np.int32), np.int32(runner.vocab_limit))
  pool = jax.tree.map(lambda a: jnp.array(a, copy=True), runner.pool.cache)
  *_, after = fn(runner.leaves, pool, np.full(s, 5, np.int32), active, *sampling)
  after = jax.device_get(after)
  np.testing.assert_array_equal(after.lengths, before.lengths + active)
  for a, b in zip(before.layers, after.layers):
    for f in a.__dataclass_fields__:
      for slot in (1, 3):
        n = before.lengths[slot]
        x, y = getattr(a, f)[slot], getattr(b, f)[slot]
        np.testing.assert_array_equal(x[:n] if f == "latent" else x, y[:n] if f == "latent" else y)
  for i in range(SLOTS):
    engine.cancel(f"d{i}")
  engine.step(lambda e: None)
  assert not engine.has_unfinished()


# slow (about a minute): the same acceptance point runs in make test end to end, through the server and
# the openai client (tests/serving/test_server.py::test_concurrent_greedy_equals_offline).
@pytest.mark.slow
def test_sixteen_requests_equal_generator_alone(model, engine):
  """16 requests of 16 different lengths, greedy, 4 slots: each returns the tokens `Generator`
  returns for that prompt alone; where they first differ it must be a near-tie (top-2 log-probs
  within 1e-5 at that position)."""
  rng = np.random.default_rng(0)
  lengths = [1, 3, 7, 12, 18, 25, 33, 41, 50, 58, 66, 75, 83, 94, 105, 119]
  prompts = [_prompt(rng, n) for n in lengths]
  new = 8
  events, top2 = run(engine, [Request(f"r{i}", p, new) for i, p in enumerate(prompts)])
  gen = Generator(model, max_length=MAX_LEN, eos_id=None, batch_size=1, prefill_multiple=128, cache_multiple=256)
  ties = 0
  for i, p in enumerate(prompts):
    want = gen.generate([list(p)], new, stop_at_eos=False)[0][0].token_ids
    got = tokens(events[f"r{i}"])
    assert len(got) == new and events[f"r{i}"][-1].finish_reason == "length"
    if got != want:
      k = next(j for j in range(new) if got[j] != want[j])
      a, b = top2[f"r{i}"][k]
      assert a - b <= 1e-5, f"request {i} differs at token {k} with a top-2 margin {a - b}: {got} vs {want}"
      ties += 1
  print(f"near-ties where the engine and Generator first differ: {ties} of {len(prompts)}")
  assert ties <= 2    # near-ties are rare: more means a real difference hides behind them


@functools.lru_cache(maxsize=None)
def _forward(graphdef):
  return jax.jit(lambda st, ids: nnx.merge(graphdef, st)(ids, mode="eval", max_num_segments=1))


def test_chunked_prefill_equals_one_unchunked_forward(model, engine):
  """A 600-token prompt under a 128-token budget is prefilled in 5 chunks; every generated token's
  log-prob equals the log-prob one uncached forward over prompt + generated tokens gives it (1e-5),
  and each token is that forward's argmax."""
  rng = np.random.default_rng(2)
  prompt = _prompt(rng, 600)
  new = 6
  steps = []
  events, _ = run(engine, [Request("long", prompt, new)], during=lambda i: steps.append(i))
  got = tokens(events["long"])
  assert len(steps) == 5 + new - 1                  # ceil(600 / 128) prefill steps, then decode steps
  seq = np.array(prompt + tuple(got[:-1]), np.int32)[None]
  graphdef, state = nnx.split(model)
  logits = np.asarray(_forward(graphdef)(state, jnp.asarray(seq)), np.float64)[0]
  lp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
  rows = np.arange(599, 599 + new)
  np.testing.assert_allclose(logprobs(events["long"]), lp[rows, got], atol=1e-5, rtol=0)
  assert got == lp[rows].argmax(-1).tolist()


def test_prefill_of_a_new_request_while_others_decode_changes_nothing(engine):
  """Two requests decoding alone, and the same two while a 300-token prompt prefills in the same
  steps: identical tokens, log-probs within 1e-5."""
  rng = np.random.default_rng(3)
  a, b, c = _prompt(rng, 20), _prompt(rng, 45), _prompt(rng, 300)
  reqs = [Request("a", a, 12), Request("b", b, 12)]
  alone, _ = run(engine, reqs)
  added = []

  def add_c(i):
    if i == 2:
      engine.add_request(Request("c", c, 3))
      added.append(i)
  mixed, _ = run(engine, reqs, during=add_c)
  assert added and len(tokens(mixed["c"])) == 3
  for rid in ("a", "b"):
    assert tokens(mixed[rid]) == tokens(alone[rid])
    np.testing.assert_allclose(logprobs(mixed[rid]), logprobs(alone[rid]), atol=1e-5, rtol=0)


def test_prefix_cache_hit_equals_cache_off(model, engine):
  """With the cache on, a second request sharing a 128-token prefix restores it (cached_tokens >= 128
  on every event) and returns the tokens of the cache-off engine, log-probs within 1e-5."""
  on = ContinuousEngine(model, _config(prefix_cache_bytes=64 << 20))
  rng = np.random.default_rng(4)
  shared = _prompt(rng, 128)
  first, second = shared + _prompt(rng, 40), shared + _prompt(rng, 51)
  run(on, [Request("first", first, 4)])
  assert on.stats().prefix_cache_bytes > 0 and len(on.prefix_cache) == 1    # saved after token 128
  # The snapshot lives on the device beside the pool (no host copy); its MLA latents keep 128 rows.
  (snap,) = on.prefix_cache._entries.values()
  leaves = [a for layer in snap.layers for a in layer.values()]
  assert all(isinstance(a, jax.Array) and a.devices() == on.pool.cache.lengths.devices() for a in leaves)
  assert {layer["latent"].shape[0] for layer in snap.layers if "latent" in layer} == {128}
  assert on.stats().prefix_cache_bytes == sum(a.nbytes for a in leaves)
  timings = []
  hit, _ = run(on, [Request("second", second, 10)], during=lambda i: timings.append(on.last_step_timing))
  assert all(e.cached_tokens == 128 for e in hit["second"])
  # Each step's stages and counts (`StepTiming`, what the serving benchmark sums): the restore is
  # dispatched in the first step's admission, whose plan prefills the 51 uncached tokens in one chunk;
  # then one decode token a step (10 tokens: 9 decode steps); nothing is saved (no new full block).
  assert [(t.prompts, t.decodes, t.restores, t.saves) for t in timings] == [(1, 0, 1, 0)] + [(0, 1, 0, 0)] * 9
  assert all(t.executed and min(t.admit_s, t.execute_s, t.events_s, t.saves_s) >= 0 for t in timings)
  assert on.stats().cached_prompt_tokens == 128
  off, _ = run(engine, [Request("second", second, 10)])
  assert all(e.cached_tokens == 0 for e in off["second"])
  assert tokens(hit["second"]) == tokens(off["second"])
  np.testing.assert_allclose(logprobs(hit["second"]), logprobs(off["second"]), atol=1e-5, rtol=0)
  assert on.stats().num_compilations <= on.runner.max_compilations
  # The steps with one prompt chunk of at most 64 tokens ran the one-prompt executables.
  assert {(b, n) for b, n in on.runner.compiled if b is not None and b <= 64} == {(64, 1)}


def test_snapshot_rows_are_powers_of_two_blocks_capped_by_the_slot():
  from model.engine.slots import snapshot_rows
  got = [snapshot_rows(n, 648) for n in (1, 64, 65, 128, 129, 192, 256, 257, 512, 513, 640)]
  assert got == [64, 64, 128, 128, 256, 256, 256, 512, 512, 648, 648]


def test_compile_transfers_covers_every_snapshot_size(model):
  """After `compile_transfers`, a take and a put of any prefix length compile nothing more: one
  executable per size in `transfer_sizes` (64, 128, 256, 512 and the slot's 640 rows)."""
  from model.engine.slots import SlotPool
  pool = SlotPool(model, 2, MAX_LEN)
  sizes = pool.transfer_sizes()
  assert sizes == [64, 128, 256, 512, pool.cache_rows] and pool.cache_rows >= MAX_LEN
  with xla_compiles() as compiles:
    pool.compile_transfers()
    assert len(compiles) >= len(sizes)    # (none already compiled by another pool of these shapes)
    compiles.clear()
    for n in (64, 192, 320, 576):
      pool.put(1, pool.take(0, n))
  assert compiles == []


def test_prefix_cache_budget_beyond_free_device_memory_is_refused():
  from model.engine.continuous import check_prefix_cache_fits

  class Device:
    def __init__(self, stats):
      self.stats = stats

    def memory_stats(self):
      return self.stats

  gib = 1 << 30
  hbm = [Device({"bytes_limit": 16 * gib, "bytes_in_use": 12 * gib}) for _ in range(2)]
  check_prefix_cache_fits(8 * gib, hbm)           # 4 + 4 GiB free
  with pytest.raises(UsageError, match=r"^prefix_cache_bytes=8589934593 does not fit: snapshots live in device "
                                       r"memory and 8589934592 bytes are free .*\(2 device\(s\)\); lower "
                                       r"prefix_cache_bytes"):
    check_prefix_cache_fits(8 * gib + 1, hbm)
  check_prefix_cache_fits(1 << 50, [Device(None)])   # XLA:CPU reports nothing: not checked


def test_tail_after_a_snapshot_boundary_emits_in_the_same_step(model, engine):
  """A 200-token prompt under a 128-token budget with the cache on: the second step prefills up to
  its last full block (192) and, in its second stage, the 8-token tail, so the first token comes out
  of that step (not a third one) with the cache-off engine's tokens and log-probs (1e-5); the
  snapshot at 192 comes from the step's first-stage `mid`, and a request restoring it also matches
  the cache-off engine (a snapshot taken after the tail would not)."""
  on = ContinuousEngine(model, _config(prefix_cache_bytes=64 << 20))
  rng = np.random.default_rng(12)
  first = _prompt(rng, 200)
  second = first[:192] + _prompt(rng, 90)
  steps = []
  got, _ = run(on, [Request("first", first, 5)], during=lambda i: steps.append(i))
  assert len(steps) == 2 + 5 - 1            # [0, 128); [128, 192) + tail [192, 200) emits; 4 decode steps
  assert len(on.prefix_cache) == 1 and on.stats().prefix_cache_bytes > 0
  want, _ = run(engine, [Request("first", first, 5)])
  assert tokens(got["first"]) == tokens(want["first"])
  np.testing.assert_allclose(logprobs(got["first"]), logprobs(want["first"]), atol=1e-5, rtol=0)
  hit, _ = run(on, [Request("second", second, 8)])
  assert all(e.cached_tokens == 192 for e in hit["second"])
  off, _ = run(engine, [Request("second", second, 8)])
  assert tokens(hit["second"]) == tokens(off["second"])
  np.testing.assert_allclose(logprobs(hit["second"]), logprobs(off["second"]), atol=1e-5, rtol=0)


def test_cancel_frees_the_slot_in_the_same_step(engine):
  """Four running requests fill the slots and a fifth waits; cancelling one frees its slot at once,
  the next step reports the cancellation and the waiting request takes that slot."""
  rng = np.random.default_rng(5)
  for i in range(SLOTS):
    engine.add_request(Request(f"run{i}", _prompt(rng, 10), 50))
  engine.add_request(Request("next", _prompt(rng, 10), 3))
  events = []
  engine.step(events.append)
  assert engine.stats().num_free_slots == 0 and engine.stats().num_waiting == 1
  slot = engine.slot_of("run2")
  engine.cancel("run2")
  assert engine.stats().num_free_slots == 1 and engine.slot_of("run2") is None
  events.clear()
  engine.step(events.append)
  assert events[0].request_id == "run2" and events[0].finish_reason == "cancelled" and events[0].token_id is None
  assert engine.slot_of("next") == slot
  for i in (0, 1, 3):
    engine.cancel(f"run{i}")
  while engine.has_unfinished():
    engine.step(events.append)
  assert [e.finish_reason for e in events if e.request_id == "next"][-1] == "length"
  assert engine.stats().num_free_slots == SLOTS


def test_stop_token_ends_the_request(engine):
  rng = np.random.default_rng(6)
  p = _prompt(rng, 30)
  free, _ = run(engine, [Request("s", p, 6)])
  stop = tokens(free["s"])[2]
  first = tokens(free["s"]).index(stop)
  stopped, _ = run(engine, [Request("s", p, 6, stop_token_ids=frozenset({stop}))])
  assert tokens(stopped["s"]) == tokens(free["s"])[:first + 1]
  assert stopped["s"][-1].finish_reason == "stop"


def test_sampled_tokens_do_not_depend_on_neighbours(engine):
  """A sampled request (seed fixed) draws the same tokens alone and beside other requests."""
  rng = np.random.default_rng(7)
  p = _prompt(rng, 25)
  req = Request("t", p, 8, sampling=SamplingParams("nucleus", temperature=0.8, top_p=0.9), seed=11)
  alone, _ = run(engine, [req])
  crowd, _ = run(engine, [Request("x", _prompt(rng, 70), 8), req, Request("y", _prompt(rng, 5), 8)])
  assert tokens(crowd["t"]) == tokens(alone["t"])


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt_ids=()), "prompt_ids is empty"),
    (dict(prompt_ids=(1, 1024)), "outside the vocabulary"),
    (dict(prompt_ids=(1, -1)), "outside the vocabulary"),
    (dict(max_tokens=0), "max_tokens must be >= 1"),
    (dict(prompt_ids=(1,) * MAX_LEN), "max_model_len"),
    (dict(prompt_ids=(1,) * 600, max_tokens=41), "max_tokens=41"),
])
def test_bad_requests_name_the_field(engine, kwargs, field):
  req = Request(**{"request_id": "bad", "prompt_ids": (1, 2), "max_tokens": 4, **kwargs})
  with pytest.raises(GenerationError, match=field):
    engine.add_request(req)
  assert not engine.has_unfinished()


def test_bad_sizes_name_the_argument():
  """EngineConfig is the one check of the sizes (the engines take it as it is)."""
  with pytest.raises(UsageError, match="max_num_batched_tokens=2 must be >= max_num_seqs=4"):
    EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=2)
  with pytest.raises(UsageError, match="max_model_len must be >= 2"):
    EngineConfig(max_num_seqs=4, max_model_len=1, max_num_batched_tokens=16)


def _random_run(engine, n, seed):
  rng = np.random.default_rng(seed)
  reqs = [Request(f"q{i}", _prompt(rng, int(rng.integers(1, 200))), int(rng.integers(1, 6))) for i in range(n)]
  events, _ = run(engine, reqs)
  assert all(len(tokens(events[r.request_id])) == r.max_tokens for r in reqs)
  return engine.stats()


def test_compilations_over_200_requests(model):
  """200 requests of random lengths on a fresh engine (35 s on the shared CPU once the module's
  executables exist: kept in make test)."""
  fresh = ContinuousEngine(model, _config())
  stats = _random_run(fresh, 200, 9)
  runner = fresh.runner
  assert runner.max_compilations == len(runner.buckets) + len(runner.single_prompt_buckets) + 1 == 8
  assert stats.num_compilations <= runner.max_compilations
  assert stats.generated_tokens > 200 and stats.num_free_slots == SLOTS


def test_min_bucket_tokens_drops_the_small_buckets_and_their_one_prompt_steps(model):
  """min_bucket_tokens=128 (the TPU's auto value): buckets from 128, so no one-prompt (P = 1) steps
  (they exist up to 64 tokens); nothing is compiled to count them."""
  runner = ContinuousEngine(model, _config(min_bucket_tokens=128)).runner
  assert runner.buckets == tuple(b for b in (128, 256, 512, 1024, 2048) if b < BUDGET) + (BUDGET,)
  assert runner.single_prompt_buckets == ()
  assert runner.step_shapes() == [(b, runner.num_partial_prefills) for b in runner.buckets] + [(None, None)]


def test_compile_all_compiles_every_executable_and_changes_no_slot(model):
  """`compile_all` (the server runs it before it listens) leaves nothing to compile later: every
  bucket, the decode-only step and the prefix-cache transfers, with the pool bit-unchanged. The
  module's executables exist by now (shared per process), so this costs the transfers only."""
  fresh = ContinuousEngine(model, _config(prefix_cache_bytes=1 << 24))
  before = [np.asarray(a).copy() for a in jax.tree.leaves(fresh.pool.cache)]
  fresh.compile_all()
  assert fresh.stats().num_compilations == fresh.runner.max_compilations
  assert fresh.pool._take is not None and fresh.pool._put is not None and fresh.pool._take_mid is not None
  for a, b in zip(before, jax.tree.leaves(fresh.pool.cache)):
    np.testing.assert_array_equal(np.asarray(b), a)
  # Then requests with snapshots, hits and tails compile nothing, no XLA compilation at all: a 200-token
  # prompt, two sharing its 192-token prefix in one step (one crossing the next boundary: a tail on
  # the 4-slot sub-pool), then a third alone (a tail on the one-prompt executable).
  with xla_compiles() as compiles:
    rng = np.random.default_rng(13)
    first = _prompt(rng, 200)
    run(fresh, [Request("first", first, 3)])
    hits, _ = run(fresh, [Request("hit", first[:192] + _prompt(rng, 20), 3),
                          Request("tail", first[:192] + _prompt(rng, 90), 3)])
    alone, _ = run(fresh, [Request("alone", first[:192] + _prompt(rng, 100), 3)])
  assert hits["hit"][-1].cached_tokens == hits["tail"][-1].cached_tokens == alone["alone"][-1].cached_tokens == 192
  # Snapshots: the first prompt's last full block (192), then 256 of "tail" and of "alone" (each from a
  # step's `mid`: their chunks went on past it).
  assert len(fresh.prefix_cache) == 3 and compiles == []
