"""The engine's one compiled function: a mixed prefill + decode step over the slot pool, with sampling.

`step(leaves, pool, ids [1, T], segment_ids [1, T], fresh [S], sampling arrays [S]...)`:
  1. slots flagged `fresh` (a new request without a prefix-cache hit) get a zero KDA state, zero
     conv windows and length 0 (their MLA latents need no clearing: rows >= length are masked);
  2. `KimiLinearForCausalLM.prefill(ids, segment_ids, cache=pool)`: the document labelled s + 1
     continues slot s from its KDA state, conv windows and MLA latent prefix, whether it is a
     prompt chunk or a one-token decode segment (`kda_inference` solves both in one call);
  3. each slot's last-token logits are sampled (`sample_rows`).
Returns `(tokens int32 [S], logprobs float32 [S], top2 float32 [S, 2], new pool)`; rows of slots
absent from the step are meaningless (the caller reads only the slots it scheduled).

Sampling is per row with runtime parameters, so requests with different strategies share one
executable, and row s draws with `fold_in(key(seed_s), position_s)` (position = index of the
output token): a request's tokens never depend on its batch neighbours or its slot.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from flax import nnx

from model import partitioning
from model.nn import cache as cache_lib
from model.nn.kimi_linear import last_token_logits


def sample_rows(logits, vocab_limit, greedy, temperature, top_k, top_p, seeds, positions):
  """One token per row with per-row sampling parameters.

  Args:
    logits: float `[S, V]` (untempered). vocab_limit: int32 scalar, ids >= it are never chosen.
    greedy: bool `[S]` (argmax, lowest id on ties). temperature: float32 `[S]` (> 0 where not greedy).
    top_k: int32 `[S]`, 0 = no top-k filter. top_p: float32 `[S]` in (0, 1], 1 = no nucleus filter.
      Filters compose as vLLM's: temperature, then top-k, then top-p over the renormalised rest.
    seeds: uint32 `[S]`. positions: int32 `[S]` output index of the token drawn.

  Returns:
    `(tokens int32 [S], logprobs float32 [S], top2 float32 [S, 2])`: log_softmax of the untempered
    (vocab-limited) logits at the chosen id, and its two largest values (a near-tie check).
  """
  v = logits.shape[-1]
  logits = jnp.where(jnp.arange(v) < vocab_limit, logits.astype(jnp.float32), -jnp.inf)
  logp = jax.nn.log_softmax(logits, axis=-1)
  best = jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def draw(_):
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    srt = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(v)[None, :]
    keep = rank < jnp.where(top_k > 0, top_k, v)[:, None]
    srt = jnp.where(keep, srt, -jnp.inf)
    probs = jax.nn.softmax(srt, axis=-1)
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]   # the most likely always stays
    srt = jnp.where(keep, srt, -jnp.inf)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, positions)
    idx = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, srt)
    return jnp.where(greedy, best, jnp.take_along_axis(order, idx[:, None], axis=-1)[:, 0].astype(jnp.int32))

  # An all-greedy step (the common serving case) skips the sort over the vocabulary.
  tok = jax.lax.cond(jnp.all(greedy), lambda _: best, draw, None)
  chosen = jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
  return tok, chosen, jax.lax.top_k(logp, 2)[0]


def _reset(cache, fresh):
  """Zero KDA state / conv windows and length of the slots flagged in `fresh` (bool [S])."""
  def clear(x):
    return jnp.where(fresh.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.zeros_like(x), x)
  layers = tuple(cache_lib.KDALayerCache(*(clear(getattr(c, f)) for f in ("state", "conv_q", "conv_k", "conv_v")))
                 if isinstance(c, cache_lib.KDALayerCache) else c for c in cache.layers)
  return cache_lib.ModelCache(layers, jnp.where(fresh, 0, cache.lengths))


def build_step(graphdef, treedef, num_slots: int):
  """The pure step function (see the module docstring) for a model split into (graphdef, treedef)."""
  def step(leaves, cache, ids, seg, fresh, greedy, temperature, top_k, top_p, seeds, positions, vocab_limit):
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    logits, cache = model.prefill(ids, seg, cache=_reset(cache, fresh))
    last = last_token_logits(logits, seg, num_slots)
    tok, logprob, top2 = sample_rows(last, vocab_limit, greedy, temperature, top_k, top_p, seeds, positions)
    return tok, logprob, top2, cache
  return step


def build_decode(graphdef, treedef):
  """The decode-only step: `(leaves, pool, tokens int32 [S], active bool [S], sampling arrays...)` ->
  `(tokens, logprobs, top2, new pool)` through `KimiLinearForCausalLM.decode` (`kda_decode_step`,
  MLA in the absorbed form), the faster route when no prompt chunk shares the step (README routing
  table, tools/bench/benchmark_decode_routing.py). decode advances every slot, so inactive slots keep
  their KDA states, conv windows and length by selection; their MLA row at index `lengths[s]` may
  receive a stale latent, which is beyond their valid prefix (masked, overwritten when they next run).
  """
  def step(leaves, cache, tok, active, greedy, temperature, top_k, top_p, seeds, positions, vocab_limit):
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    logits, new = model.decode(tok, cache)
    out = _keep_inactive(cache, new, active)
    tok, logprob, top2 = sample_rows(logits, vocab_limit, greedy, temperature, top_k, top_p, seeds, positions)
    return tok, logprob, top2, out
  return step


def _keep_inactive(old, new, active):
  """`new` pool where `active` (bool [S]), else `old`'s KDA states, conv windows and lengths (MLA
  latents from `new`: a row written at an inactive slot's `lengths[s]` is beyond its valid prefix)."""
  def keep(o, n):
    return jnp.where(active.reshape((-1,) + (1,) * (o.ndim - 1)), n, o)
  layers = tuple(cache_lib.KDALayerCache(*(keep(getattr(o, f), getattr(n, f)) for f in ("state", "conv_q", "conv_k",
                                                                                       "conv_v")))
                 if isinstance(o, cache_lib.KDALayerCache) else n for o, n in zip(old.layers, new.layers))
  return cache_lib.ModelCache(layers, jnp.where(active, new.lengths, old.lengths))


def kda_fields(cache) -> tuple:
  """Per decoder layer, the KDA layer's `KDALayerCache` of `cache` (state and conv windows), None for
  an MLA layer: what a snapshot takes from a slot besides the MLA latents."""
  return tuple(c if isinstance(c, cache_lib.KDALayerCache) else None for c in cache.layers)


def build_split_step(graphdef, treedef, num_slots: int, num_prefill: int):
  """The step for a batch with prompt chunks, decode and prefill split (the default route).

  `step(leaves, pool, tokens int32 [S], active bool [S], ids int32 [2, T], segment_ids int32 [2, T],
  sub_slots int32 [P], fresh bool [P], sampling arrays [S]..., vocab_limit)`:
    1. the decoding slots (`active`) advance one token through `KimiLinearForCausalLM.decode`
       (`kda_decode_step`, absorbed MLA), as in `build_decode`; skipped (`lax.cond`) when none;
    2. the P prefilling slots `sub_slots` (pool indices; S marks an unused entry) are gathered into
       a P-slot sub-pool, entries flagged `fresh` reset, and row 0 prefilled on it
       (`KimiLinearForCausalLM.prefill`: label p + 1 continues sub-pool entry p, i.e. slot
       `sub_slots[p]`);
    3. the second stage, only when row 1 holds tokens (a `while_loop` of one or two trips over the
       same prefill, so the executable holds one copy of the model): row 1, the tails of chunks
       that ended at a prefix-cache boundary (`model.engine.scheduler`), is prefilled on the
       sub-pool as row 0 left it, so every token is computed once; the sub-pool's KDA states and
       conv windows after row 0 (`mid`) are returned for the snapshot at that boundary (the MLA
       latents before it are in the pool: the tails write rows after it);
    4. the sub-pool is scattered back (unused entries dropped); slot `sub_slots[p]` samples from
       its segment's last-token logits (row 1's when it has a tail there), a decoding slot from its
       decode logits.
  Returns `(tokens int32 [S], logprobs float32 [S], top2 float32 [S, 2], new pool, mid)`; mid is
  `kda_fields` of the sub-pool after row 0 (entry p at index p); rows of slots absent from the
  step are meaningless.

  Why split: the rows carry only prompt tokens, and the prefill's per-slot work (each row's
  initial KDA state, the MLA prefix attention, the final-state extraction) spans P slots, not S;
  a decode token costs what it costs in a decode-only step. A slot is either decoding or in
  `sub_slots` in one step (the scheduler's contract), so the two parts touch disjoint slots; the
  prefill runs second, so it overwrites the stale MLA row the decode may write at a prefilling
  slot's `lengths[s]`.
  """
  labels = jnp.arange(1, num_prefill + 1, dtype=jnp.int32)

  def step(leaves, cache, tok, active, ids, seg, sub_slots, fresh, greedy, temperature, top_k, top_p, seeds,
           positions, vocab_limit):
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

    def run_decode(cache):
      logits, new = model.decode(tok, cache)
      return logits.astype(jnp.float32), _keep_inactive(cache, new, active)

    def skip(cache):
      return jnp.zeros((num_slots, model.args.vocab_size), jnp.float32), cache

    logits, cache = jax.lax.cond(jnp.any(active), run_decode, skip, cache)
    take = jnp.minimum(sub_slots, num_slots - 1)
    sub = _reset(jax.tree.map(lambda x: x[take], cache), fresh)

    def stage(i, carry):
      sub, last, mid = carry
      row_ids = jax.lax.dynamic_slice_in_dim(ids, i, 1, axis=0)
      row_seg = jax.lax.dynamic_slice_in_dim(seg, i, 1, axis=0)
      row_logits, sub = model.prefill(row_ids, row_seg, cache=sub)
      present = jnp.any(row_seg[0][None, :] == labels[:, None], axis=-1)                       # [P]
      row_last = last_token_logits(row_logits, row_seg, num_prefill).astype(jnp.float32)
      last = jnp.where(present[:, None], row_last, last)
      mid = jax.tree.map(lambda m, x: jnp.where(i == 0, x, m), mid, kda_fields(sub))
      return sub, last, mid

    stages = 1 + jnp.any(seg[1] > 0).astype(jnp.int32)
    init = (sub, jnp.zeros((num_prefill, model.args.vocab_size), jnp.float32), kda_fields(sub))
    sub, last, mid = jax.lax.fori_loop(0, stages, stage, init)
    cache = jax.tree.map(lambda x, y: x.at[sub_slots].set(y, mode="drop"), cache, sub)
    logits = logits.at[sub_slots].set(last, mode="drop")
    tok, logprob, top2 = sample_rows(logits, vocab_limit, greedy, temperature, top_k, top_p, seeds, positions)
    return tok, logprob, top2, cache, mid
  return step


def compile_step(step, leaves, pool, bucket: int | None, num_slots: int, *, mesh=None, rules=None,
                 pool_shardings=None, num_prefill: int | None = None):
  """`step` compiled ahead of time for a row of `bucket` tokens (`build_step`, or `build_split_step`
  when `num_prefill`, its P, is given: two rows of `bucket`), or for the decode-only step when bucket is None
  (`build_decode`); the pool (argument 1) is donated, so the MLA latents are updated in place. On a
  mesh the outputs keep the pool's shardings, so the next step takes them as they are (one
  executable per shape, no resharding)."""
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  flags = lambda n: jax.ShapeDtypeStruct((n,), jnp.bool_)
  if bucket is None:
    rows = (i32(num_slots), flags(num_slots))
  elif num_prefill is None:
    rows = (i32(1, bucket), i32(1, bucket), flags(num_slots))
  else:
    rows = (i32(num_slots), flags(num_slots), i32(2, bucket), i32(2, bucket), i32(num_prefill), flags(num_prefill))
  args = (leaves, pool, *rows, flags(num_slots), jax.ShapeDtypeStruct((num_slots,), jnp.float32),
          i32(num_slots), jax.ShapeDtypeStruct((num_slots,), jnp.float32),
          jax.ShapeDtypeStruct((num_slots,), jnp.uint32), i32(num_slots), i32())
  kwargs = {}
  ctx = contextlib.nullcontext()
  if mesh is not None:
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    kwargs["out_shardings"] = (rep, rep, rep, pool_shardings) + ((rep,) if bucket is not None and num_prefill else ())
    ctx = partitioning.mesh_context(mesh, rules)
  with ctx:
    return jax.jit(step, donate_argnums=(1,), **kwargs).lower(*args).compile()
