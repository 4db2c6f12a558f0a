"""The continuous engine's pure step functions over the slot pool, with sampling (compiled by
`compile_step`, run by `model.engine.runner`).

`build_step`: one packed row through `KimiLinearForCausalLM.prefill(cache=pool)`; the document
labelled s + 1 continues slot s, prompt chunk or one-token decode segment alike. `build_decode`: the
decode-only step through `decode`. `build_split_step`: decode tokens through `decode`, prompt chunks
through `prefill` on a P-slot sub-pool. Slots flagged `fresh` start from a zero state. Every step
returns `(tokens [S], logprobs [S], top2 [S, 2], new pool)` (`sampling.sample_step`); rows of slots
absent from the step are meaningless.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from flax import nnx

from model import partitioning
from model.engine import sampling
from model.nn import cache as cache_lib


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
    last, cache = model.prefill(ids, seg, cache=_reset(cache, fresh), logits_at="last")
    tok, logprob, top2 = sampling.sample_step(last, vocab_limit, greedy, temperature, top_k, top_p, seeds, positions)
    return tok, logprob, top2, cache
  return step


def build_decode(graphdef, treedef):
  """The decode-only step: `(leaves, pool, tokens int32 [S], active bool [S], sampling arrays...)` ->
  `(tokens, logprobs, top2, new pool)` through `KimiLinearForCausalLM.decode`. Inactive slots keep
  their KDA states, conv windows and length; the stale MLA row decode writes at their `lengths[s]`
  is beyond their valid prefix."""
  def step(leaves, cache, tok, active, greedy, temperature, top_k, top_p, seeds, positions, vocab_limit):
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    logits, new = model.decode(tok, cache)
    out = _keep_inactive(cache, new, active)
    tok, logprob, top2 = sampling.sample_step(logits, vocab_limit, greedy, temperature, top_k, top_p, seeds, positions)
    return tok, logprob, top2, out
  return step


def _keep_inactive(old, new, active):
  """`new` pool where `active` (bool [S]), else `old`'s KDA states, conv windows and lengths."""
  def keep(o, n):
    return jnp.where(active.reshape((-1,) + (1,) * (o.ndim - 1)), n, o)
  layers = tuple(cache_lib.KDALayerCache(*(keep(getattr(o, f), getattr(n, f)) for f in ("state", "conv_q", "conv_k",
                                                                                       "conv_v")))
                 if isinstance(o, cache_lib.KDALayerCache) else n for o, n in zip(old.layers, new.layers))
  return cache_lib.ModelCache(layers, jnp.where(active, new.lengths, old.lengths))


def kda_fields(cache) -> tuple:
  """Per decoder layer, the KDA layer's `KDALayerCache` of `cache`, None for an MLA layer."""
  return tuple(c if isinstance(c, cache_lib.KDALayerCache) else None for c in cache.layers)


def build_split_step(graphdef, treedef, num_slots: int, num_prefill: int):
  """The step for a batch with prompt chunks, decode and prefill split (the default route).

  `step(leaves, pool, tokens int32 [S], active bool [S], ids int32 [2, T], segment_ids int32 [2, T],
  sub_slots int32 [P], fresh bool [P], sampling arrays [S]..., vocab_limit)`:
    1. the `active` slots advance one token through `decode` (skipped when none);
    2. the slots `sub_slots` (S marks an unused entry) are gathered into a P-slot sub-pool, entries
       flagged `fresh` reset, and row 0 prefilled on it (label p + 1 continues entry p);
    3. only when row 1 holds tokens, a second stage prefills row 1 (the tails of chunks that ended
       at a prefix-cache boundary, `model.engine.scheduler`) from where row 0 left the sub-pool;
       `mid`, the sub-pool's KDA states after row 0, is returned for the snapshot at that boundary;
    4. the sub-pool is scattered back and every scheduled slot samples.
  Returns `(tokens, logprobs, top2, new pool, mid)`.

  Why split: the prefill's per-slot work spans P slots, not S, and a decode token costs what it
  costs in a decode-only step. A slot is decoding or in `sub_slots`, never both, and the prefill runs
  second, so it overwrites the stale MLA row the decode may write at a prefilling slot.
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
      row_last, sub = model.prefill(row_ids, row_seg, cache=sub, logits_at="last")
      present = jnp.any(row_seg[0][None, :] == labels[:, None], axis=-1)                       # [P]
      row_last = row_last.astype(jnp.float32)
      last = jnp.where(present[:, None], row_last, last)
      mid = jax.tree.map(lambda m, x: jnp.where(i == 0, x, m), mid, kda_fields(sub))
      return sub, last, mid

    stages = 1 + jnp.any(seg[1] > 0).astype(jnp.int32)
    init = (sub, jnp.zeros((num_prefill, model.args.vocab_size), jnp.float32), kda_fields(sub))
    sub, last, mid = jax.lax.fori_loop(0, stages, stage, init)
    cache = jax.tree.map(lambda x, y: x.at[sub_slots].set(y, mode="drop"), cache, sub)
    logits = logits.at[sub_slots].set(last, mode="drop")
    tok, logprob, top2 = sampling.sample_step(logits, vocab_limit, greedy, temperature, top_k, top_p, seeds, positions)
    return tok, logprob, top2, cache, mid
  return step


def compile_step(step, leaves, pool, bucket: int | None, num_slots: int, *, mesh=None, rules=None,
                 pool_shardings=None, num_prefill: int | None = None):
  """`step` compiled ahead of time for a row of `bucket` tokens (`build_step`; `build_split_step` when
  `num_prefill` is given), or the decode-only step for bucket None. The pool is donated (updated in
  place); on a mesh the outputs keep the pool's shardings, so one executable serves every step."""
  return lower_step(step, leaves, pool, bucket, num_slots, mesh=mesh, rules=rules, pool_shardings=pool_shardings,
                    num_prefill=num_prefill).compile()


def lower_step(step, leaves, pool, bucket: int | None, num_slots: int, *, mesh=None, rules=None,
               pool_shardings=None, num_prefill: int | None = None):
  """`compile_step` before the XLA compilation: the `jax.stages.Lowered` (tracing holds the GIL;
  `.compile()` does not, so the runner compiles several of these on threads)."""
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
    return jax.jit(step, donate_argnums=(1,), **kwargs).lower(*args)
