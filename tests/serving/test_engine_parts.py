"""The continuous engine's host-side parts without a model: shape buckets, the step planner (decode
first, chunked prefill, chunks ending at prefix-cache boundaries) and the prefix cache (hash chain,
boundaries, LRU under a byte budget)."""

from __future__ import annotations

import numpy as np
import pytest

from model.engine.api import Request
from model.engine.config import EngineConfig
from model.engine.prefix_cache import BLOCK, PrefixCache, Snapshot, block_keys
from model.engine.scheduler import TAIL_MAX_BUCKET, Sequence, bucket_for, buckets, plan_step
from model.errors import UsageError


def test_buckets():
  assert buckets(128) == (16, 32, 64, 128)
  assert buckets(100) == (16, 32, 64, 100)
  assert buckets(8) == (8,)
  assert bucket_for(17, buckets(128)) == 32 and bucket_for(16, buckets(128)) == 16
  with pytest.raises(ValueError, match="exceed the largest bucket"):
    bucket_for(129, buckets(128))
  assert buckets(1024, 128) == (128, 256, 512, 1024) and buckets(100, 128) == (100,)


def test_smallest_bucket_is_128_on_a_tpu_unless_given():
  """min_bucket_tokens=0 (auto): 128 on a TPU, whose steps below it cost as much (weight-bound), 16
  elsewhere; a value given wins on every platform."""
  from model.engine.scheduler import min_bucket
  auto = EngineConfig(max_num_seqs=32, max_model_len=768, max_num_batched_tokens=1024)
  assert min_bucket(auto, "tpu") == 128 and min_bucket(auto, "cpu") == 16 and min_bucket(auto, "gpu") == 16
  assert min_bucket(auto) == 16   # this host: the CPU
  given = EngineConfig(max_num_seqs=32, max_model_len=768, max_num_batched_tokens=1024, min_bucket_tokens=32)
  assert min_bucket(given, "tpu") == 32 and min_bucket(given, "cpu") == 32
  with pytest.raises(UsageError, match="min_bucket_tokens must be >= 0, got -1"):
    EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64, min_bucket_tokens=-1)
  with pytest.raises(UsageError, match="engine=static compiles one prefill row"):
    EngineConfig(engine="static", max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64, min_bucket_tokens=64)


def _seq(n, slot, done=0, out=(), splits=()):
  s = Sequence(Request(f"s{slot}", tuple(range(1, n + 1)), 8), slot=slot)
  s.num_computed, s.output_ids, s.splits = done, list(out), list(splits)
  return s


def test_plan_decodes_first_then_chunks_the_prompts():
  dec = [_seq(5, 0, done=5, out=[9]), _seq(7, 1, done=7, out=[3, 4])]
  long, short = _seq(300, 2), _seq(10, 3)
  plan = plan_step(dec + [long, short], 128, buckets(128))
  kinds = [(c.seq.slot, len(c.tokens), c.emits, c.output_index) for c in plan.chunks]
  # Two decode tokens, then 126 tokens of the long prompt (no room left for the short one).
  assert kinds == [(0, 1, True, 1), (1, 1, True, 2), (2, 126, False, 0)]
  assert plan.chunks[0].tokens == [9] and plan.chunks[1].tokens == [4]
  assert plan.num_tokens == 128 and plan.bucket == 128
  long.num_computed = 252
  plan = plan_step([long, short], 128, buckets(128))
  assert [(c.seq.slot, len(c.tokens), c.emits) for c in plan.chunks] == [(2, 48, True), (3, 10, True)]
  assert plan.num_tokens == 58 and plan.bucket == 64
  assert plan_step([], 128, buckets(128)) is None


def test_split_plan_limits_prefills_and_buckets_the_prompt_tokens_alone():
  """The split step's plan (decode apart): at most `max_prefills` prompt chunks, the budget still
  counting the decode tokens, and the bucket sized for the prompt tokens only."""
  dec = [_seq(5, 0, done=5, out=[9]), _seq(7, 1, done=7, out=[3, 4])]
  prompts = [_seq(20, 2), _seq(30, 3), _seq(40, 4)]
  plan = plan_step(dec + prompts, 64, buckets(64), max_prefills=2, decodes_in_row=False)
  assert [(c.seq.slot, len(c.tokens)) for c in plan.chunks] == [(0, 1), (1, 1), (2, 20), (3, 30)]
  assert plan.num_tokens == 52 and plan.bucket == 64          # 50 prompt tokens
  plan = plan_step(dec + prompts[:1], 64, buckets(64), max_prefills=2, decodes_in_row=False)
  assert plan.num_tokens == 22 and plan.bucket == 32          # 20 prompt tokens (22 with the decodes)
  plan = plan_step(dec + prompts, 24, buckets(24), max_prefills=2, decodes_in_row=False)
  assert [(c.seq.slot, len(c.tokens)) for c in plan.chunks] == [(0, 1), (1, 1), (2, 20), (3, 2)]
  assert plan_step(dec, 64, buckets(64), max_prefills=2, decodes_in_row=False).bucket == 16


def test_chunks_end_at_snapshot_boundaries():
  seq = _seq(200, 0, splits=[64, 192])
  plan = plan_step([seq], 128, buckets(128))
  assert len(plan.chunks[0].tokens) == 64 and plan.chunks[0].snapshot_at == 64
  seq.num_computed = 64
  plan = plan_step([seq], 128, buckets(128))
  assert len(plan.chunks[0].tokens) == 128 and plan.chunks[0].snapshot_at == 192
  seq.num_computed = 192
  c = plan_step([seq], 128, buckets(128)).chunks[0]
  assert len(c.tokens) == 8 and c.snapshot_at is None and c.emits


def test_tails_continue_past_a_boundary_in_the_same_step():
  """With `tails`, a chunk that ends at a boundary before its prompt's end continues in the second
  stage with the budget left, up to the next boundary or the prompt's end; the bucket holds the
  larger of the two rows, and no tail rides a step whose rows exceed TAIL_MAX_BUCKET."""
  dec = [_seq(5, 0, done=5, out=[9])]
  hit = _seq(612, 1, done=512, splits=[576])            # a prefix-cache hit at 512, snapshot at 576
  plan = plan_step(dec + [hit], 2048, buckets(2048), max_prefills=4, decodes_in_row=False, tails=True)
  c = plan.chunks[1]
  assert (len(c.tokens), c.snapshot_at, len(c.tail), c.tail_snapshot_at, c.emits) == (64, 576, 36, None, True)
  assert c.tail == list(range(577, 613)) and (plan.num_tokens, plan.bucket, plan.tail_tokens) == (101, 64, 36)
  plain = plan_step(dec + [_seq(612, 1, done=512, splits=[576])], 2048, buckets(2048), max_prefills=4,
                    decodes_in_row=False)
  assert not plain.chunks[1].tail and not plain.chunks[1].emits and plain.tail_tokens == 0
  # The budget bounds the tail; a tail ending at the next boundary is saved there too.
  two = _seq(300, 2, splits=[64, 192])
  c = plan_step([two], 100, buckets(100), max_prefills=4, decodes_in_row=False, tails=True).chunks[0]
  assert (len(c.tokens), c.snapshot_at, len(c.tail), c.tail_snapshot_at, c.emits) == (64, 64, 36, None, False)
  two.num_computed = 64
  c = plan_step([two], 256, buckets(256), max_prefills=4, decodes_in_row=False, tails=True).chunks[0]
  assert (len(c.tokens), c.snapshot_at, len(c.tail), c.tail_snapshot_at) == (128, 192, 108, None) and c.emits
  # Rows over TAIL_MAX_BUCKET carry no tail: the second stage would cost a large prefill.
  big = _seq(1000, 3, splits=[960])
  plan = plan_step([big], 2048, buckets(2048), max_prefills=4, decodes_in_row=False, tails=True)
  assert len(plan.chunks[0].tokens) == 960 and not plan.chunks[0].tail and plan.bucket == 1024
  assert TAIL_MAX_BUCKET == 256


def _snap(tokens, nbytes):
  return Snapshot(tokens, ({"state": np.zeros(nbytes // 4, np.float32)},))


def test_block_keys_are_a_hash_chain():
  rng = np.random.default_rng(0)
  a = rng.integers(0, 1000, 200).tolist()
  b = a[:128] + rng.integers(0, 1000, 72).tolist()
  ka, kb = block_keys(a), block_keys(b)
  assert len(ka) == 3 and ka[:2] == kb[:2] and ka[2] != kb[2]
  c = list(a)
  c[0] += 1                     # a change in block 0 changes every later key
  assert all(x != y for x, y in zip(block_keys(c), ka))


def test_boundaries_last_block_and_branch_point():
  rng = np.random.default_rng(1)
  shared = rng.integers(0, 1000, 512).tolist()
  first = shared + rng.integers(0, 1000, 100).tolist()
  second = shared + rng.integers(0, 1000, 40).tolist()
  cache = PrefixCache(1 << 20)
  assert cache.boundaries(block_keys(first), 0) == [576]        # last full block only: nothing seen yet
  assert cache.boundaries(block_keys(second), 0) == [512]       # branch point == its last block
  cache.insert(block_keys(second)[7], _snap(512, 1024))
  third = shared + rng.integers(0, 1000, 130).tolist()
  keys = block_keys(third)
  hit = cache.lookup(keys, len(third))
  assert hit is not None and hit.num_tokens == 512
  assert cache.boundaries(keys, 512) == [640]                   # 512 is already stored
  assert PrefixCache(0).boundaries(keys, 0) == [] and PrefixCache(0).lookup(keys, len(third)) is None


def test_lookup_leaves_a_token_to_prefill():
  p = list(range(128))
  cache = PrefixCache(1 << 20)
  keys = block_keys(p)
  cache.insert(keys[1], _snap(128, 64))
  cache.insert(keys[0], _snap(64, 64))
  assert cache.lookup(keys, 128).num_tokens == 64               # not the whole prompt
  assert cache.lookup(block_keys(p + [5]), 129).num_tokens == 128


def test_lru_eviction_under_the_byte_budget():
  cache = PrefixCache(1000)
  keys = [bytes([i]) * 16 for i in range(4)]
  for k in keys[:3]:
    assert cache.insert(k, _snap(64, 400))
  assert len(cache) == 2 and cache.bytes == 800                  # the third evicted the first
  assert cache.lookup([keys[0]], 65) is None and cache.lookup([keys[1]], 65) is not None
  cache.insert(keys[3], _snap(64, 400))                          # evicts keys[2] (keys[1] was just used)
  assert cache.lookup([keys[1]], 65) is not None and cache.lookup([keys[2]], 65) is None
  assert not cache.insert(bytes([9]) * 16, _snap(64, 2000))      # larger than the whole budget
  assert cache.bytes == 800
  # a negative budget is refused once, by EngineConfig (tests/serving/test_server_units.py)
  with pytest.raises(UsageError, match="prefix_cache_bytes"):
    EngineConfig(engine="continuous", max_num_seqs=1, max_model_len=8, max_num_batched_tokens=8,
                 prefix_cache_bytes=-1)
