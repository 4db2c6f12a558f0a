"""The offline Generator: a group of prompts in one packed prefill, then a compiled decode loop.

The prompts are packed into ONE prefill row `[1, T]` with segment IDs: prompt i gets label i + 1 and
becomes decode sequence i of the cache. T is rounded up to `prefill_multiple` (padding touches no
state), so prompt sets of similar size reuse one compiled prefill. The decode function (a scan of
`decode_chunk` steps: one dispatch and one host transfer per chunk) is compiled ahead of time per
(N, cache length) with fixed shapes. A finished sequence (or an unused slot of a short group) keeps
running masked: its outputs are replaced by `pad_id` and ignored.

Sampling (`model.engine.sampling`) runs inside the compiled functions; sequence s draws at step i
with `fold_in(fold_in(group_key, i), s)`, so its tokens never depend on the other prompts of a group.

Timings exclude compilation and one warm-up run (reported apart). Decode tokens count live sequences
only (EOS included), and decode steps those that generated at least one token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model import partitioning
from model.engine import executables, sampling
from model.engine.api import GenerationError, SamplingParams, check_vocab_limit

MAX_STOP_IDS = 8   # stop ids one Generator may hold (a runtime int32 vector of the compiled decode step)


def check_max_new_tokens(max_new_tokens: int) -> None:
  """GenerationError unless `max_new_tokens` >= 1 (the one check: the tool calls it before the model
  loads, `Generator.check_request` for every other caller)."""
  if int(max_new_tokens) < 1:
    raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


@dataclasses.dataclass
class SequenceResult:
  """One prompt's outcome: its ids, the generated ids (EOS included when emitted) and why it stopped
  ("eos" or "length")."""

  prompt_ids: list[int]
  token_ids: list[int]
  finish_reason: str


@dataclasses.dataclass
class Timings:
  """Wall-clock figures of a `generate` call, in seconds and tokens (summed over prompt groups; see
  the module docstring for what decode_tokens and decode_steps count)."""

  compile_s: float = 0.0
  time_to_first_token_s: float = 0.0
  prefill_s: float = 0.0
  prefill_tokens: int = 0
  decode_s: float = 0.0
  decode_tokens: int = 0
  decode_steps: int = 0

  @property
  def prefill_tokens_per_s(self) -> float:
    return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

  @property
  def decode_tokens_per_s(self) -> float:
    return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")

  def as_dict(self) -> dict:
    return dict(dataclasses.asdict(self), prefill_tokens_per_s=self.prefill_tokens_per_s,
                decode_tokens_per_s=self.decode_tokens_per_s)


def _leading_axis(sh):
  """The sharding of a `[K, S]` array whose S axis is laid out like the `[S]` array of `sh`."""
  if isinstance(sh, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(None, *sh.spec))
  return sh


def round_up(n: int, multiple: int) -> int:
  """Smallest multiple of `multiple` that is >= max(n, 1)."""
  return -(-max(int(n), 1) // multiple) * multiple


def pack_prompts(prompts: Sequence[Sequence[int]], num_slots: int, length: int):
  """Packs prompts into one row: `(ids int32 [1, length], segment_ids int32 [1, length])`; prompt i
  gets label i + 1, the rest is padding (id 0, label 0).

  Raises:
    ValueError: more prompts than slots, or more tokens than `length`.
  """
  if len(prompts) > num_slots:
    raise ValueError(f"{len(prompts)} prompts do not fit {num_slots} slots")
  total = sum(len(p) for p in prompts)
  if total > length:
    raise ValueError(f"{total} prompt tokens do not fit a row of {length}")
  ids = np.zeros((1, length), np.int32)
  seg = np.zeros((1, length), np.int32)
  u = 0
  for i, p in enumerate(prompts):
    ids[0, u:u + len(p)] = np.asarray(p, np.int32)
    seg[0, u:u + len(p)] = i + 1
    u += len(p)
  return ids, seg


def _sample_rows(logits, key, step, params: SamplingParams, vocab_limit):
  """int32 `[S]`: one token per row, row s drawn with `fold_in(fold_in(key, step), s)`, among ids
  below `vocab_limit` only (a model's vocabulary may be padded beyond its tokenizer's)."""
  logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits.astype(jnp.float32), -jnp.inf)
  keys = None
  if params.strategy != "greedy":
    step_key = jax.random.fold_in(key, step)
    keys = jax.vmap(lambda s: jax.random.fold_in(step_key, s))(jnp.arange(logits.shape[0]))
  return sampling.sample_rows(logits, keys, *params.row())


class Generator:
  """Serves greedy or sampled generation from a `KimiLinearForCausalLM`.

  Args:
    model: the model (its parameters are split out once; the model object is not modified).
    max_length: prompt + generated tokens a request may need (normally `config.max_cache_length`).
    eos_id: the id that ends a sequence (when `stop_at_eos`), or None.
    stop_ids: the ids that end a sequence (when `stop_at_eos`), at most MAX_STOP_IDS of them, e.g. a
      Kimi tokenizer's `stop_ids` (<|im_end|> and generation_config.json's EOS ids); default {eos_id}.
    pad_id: the id fed to finished sequences and reported for them.
    batch_size: prompts per packed prefill and decode batch; more run in consecutive groups.
    prefill_multiple, cache_multiple: prefill row length and MLA cache length are rounded up to
      these, so requests of similar size reuse compiled functions.
    decode_chunk: decode steps per compiled call (streaming callbacks see a chunk's tokens together).
    vocab_limit: only ids below it are generated; default the model's vocabulary.
    mesh, rules: serve a model sharded on this mesh (`model.partitioning`); None: one device.

  Raises:
    GenerationError: non-positive sizes, or vocab_limit outside [1, vocab_size].
  """

  def __init__(self, model, *, max_length: int, eos_id: int | None, pad_id: int = 0, batch_size: int = 8,
               prefill_multiple: int = 64, cache_multiple: int = 64, vocab_limit: int | None = None,
               mesh=None, rules=None, decode_chunk: int = 8, stop_ids=None):
    for name, v in (("max_length", max_length), ("batch_size", batch_size),
                    ("prefill_multiple", prefill_multiple), ("cache_multiple", cache_multiple),
                    ("decode_chunk", decode_chunk)):
      if int(v) < 1:
        raise GenerationError(f"{name} must be >= 1, got {v}")
    self.vocab_size = int(model.args.vocab_size)
    self.decode_chunk = int(decode_chunk)
    self.vocab_limit = check_vocab_limit(vocab_limit, self.vocab_size)
    self.max_length = int(max_length)
    self.eos_id = eos_id
    stops = sorted({int(i) for i in stop_ids}) if stop_ids is not None else ([] if eos_id is None else [int(eos_id)])
    if len(stops) > MAX_STOP_IDS:
      raise GenerationError(f"stop_ids holds {len(stops)} ids; at most {MAX_STOP_IDS} are supported")
    self.stop_ids = frozenset(stops)
    self.pad_id = int(pad_id)
    self.batch_size = int(batch_size)
    self.prefill_multiple = int(prefill_multiple)
    self.cache_multiple = int(cache_multiple)
    self.mesh, self._rules = mesh, rules
    self._graphdef, state = nnx.split(model)
    # A flat leaf list is cheaper to pass per decode step than the nested nnx.State.
    self._leaves, self._treedef = jax.tree.flatten(state)
    self._model_key = executables.model_key(self._graphdef, self._treedef, mesh, rules)

  # --- validation ---------------------------------------------------------------------------------
  def check_request(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Validates prompts and the token budget; returns them as lists of Python ints.

    Raises:
      GenerationError: no prompts, an empty prompt, ids outside [0, vocab_size), max_new_tokens < 1,
        or a prompt whose length plus max_new_tokens exceeds `max_length` (names the prompt).
    """
    check_max_new_tokens(max_new_tokens)
    if not prompts:
      raise GenerationError("no prompts to generate from")
    out = []
    for i, p in enumerate(prompts):
      p = [int(t) for t in np.asarray(p).reshape(-1)]
      if not p:
        raise GenerationError(f"prompt {i} is empty (it has no tokens)")
      bad = [t for t in p if not 0 <= t < self.vocab_size]
      if bad:
        raise GenerationError(f"prompt {i} holds token ids outside the vocabulary [0, {self.vocab_size}): "
                              f"{bad[:8]}")
      if len(p) > self.max_length:
        raise GenerationError(f"prompt {i} has {len(p)} tokens, longer than the model's limit "
                              f"max_cache_length={self.max_length}")
      if len(p) + int(max_new_tokens) > self.max_length:
        raise GenerationError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                              f"{len(p) + int(max_new_tokens)} > max_cache_length={self.max_length} cache entries "
                              f"(lower max_new_tokens or raise max_cache_length)")
      out.append(p)
    return out

  # --- compiled functions ---------------------------------------------------------------------------
  def _functions(self, num_slots: int, row_length: int, cache_length: int, params: SamplingParams):
    """`((prefill, step), seconds to compile and warm up now)`, compiled ahead of time for these
    static sizes (`model.engine.executables`: 0.0 seconds when they already were)."""
    key = self._model_key + ("generator", num_slots, row_length, cache_length, params, self.decode_chunk)
    return executables.get(key, lambda: self._compile(num_slots, row_length, cache_length, params))

  def _compile(self, num_slots: int, row_length: int, cache_length: int, params: SamplingParams):
    graphdef, treedef = self._graphdef, self._treedef  # not self: the cache must not keep parameters alive
    model_of = lambda leaves: nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

    def prefill(leaves, ids, seg, rng, vocab_limit):
      last, cache = model_of(leaves).prefill(ids, seg, num_slots=num_slots, cache_length=cache_length,
                                             logits_at="last")
      tok = _sample_rows(last, rng, 0, params, vocab_limit)
      return tok, cache

    chunk = self.decode_chunk

    def step(leaves, tok, cache, done, stops, pad, vocab_limit, rng, index):
      # `chunk` decode steps in one call (a scan: one dispatch and one host transfer per chunk).
      # stops (int32 [MAX_STOP_IDS], -1 = unused), pad and vocab_limit are runtime values: no recompilation.
      model = model_of(leaves)

      def one(carry, i):
        tok, cache, done = carry
        logits, cache = model.decode(tok, cache)
        new = jnp.where(done, pad, _sample_rows(logits, rng, index + i, params, vocab_limit))
        return (new, cache, done | jnp.any(new[:, None] == stops[None, :], axis=-1)), (new, ~done)

      (tok, cache, done), (toks, live) = jax.lax.scan(one, (tok, cache, done), jnp.arange(chunk))
      return toks, live, tok, cache, done

    rng = jax.random.key(0)
    ids = jax.ShapeDtypeStruct((1, row_length), jnp.int32)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    stop_vec = jax.ShapeDtypeStruct((MAX_STOP_IDS,), jnp.int32)
    # On a mesh, trace in its context (KDA kernels per shard); decode keeps the prefill's layouts.
    with (partitioning.mesh_context(self.mesh, self._rules) if self.mesh is not None else contextlib.nullcontext()):
      prefill_c = jax.jit(prefill).lower(self._leaves, ids, ids, rng, scalar).compile()
      _, cache_shape = jax.eval_shape(prefill, self._leaves, ids, ids, rng, scalar)
      tok_sh, cache_sh = prefill_c.output_shardings
      cache_shape = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), cache_shape,
                                 cache_sh)
      vec = jax.ShapeDtypeStruct((num_slots,), jnp.int32, sharding=tok_sh)
      flags = jax.ShapeDtypeStruct((num_slots,), jnp.bool_, sharding=tok_sh)
      # The cache is donated: its buffers (the MLA latent cache above all) are updated in place.
      per_step = _leading_axis(tok_sh)   # [chunk, S] outputs: S laid out as the tokens are
      step_c = jax.jit(step, donate_argnums=(2,),
                       out_shardings=(per_step, per_step, tok_sh, cache_sh, tok_sh)).lower(
          self._leaves, vec, cache_shape, flags, stop_vec, scalar, scalar, rng, scalar).compile()
    # A warm-up run: a fresh executable's one-time set-up costs belong with compilation, not with TTFT.
    zeros = jnp.zeros((1, row_length), jnp.int32)
    limit = jnp.int32(self.vocab_limit)
    tok, cache = prefill_c(self._leaves, zeros, zeros, rng, limit)
    jax.block_until_ready(step_c(self._leaves, tok, cache, jnp.ones((num_slots,), bool),
                                 jnp.full((MAX_STOP_IDS,), -1, jnp.int32), jnp.int32(0), limit, rng, jnp.int32(1)))
    return prefill_c, step_c

  # --- generation -----------------------------------------------------------------------------------
  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
               sampling_params: SamplingParams = SamplingParams(), seed: int = 0, stop_at_eos: bool = True,
               on_tokens: Callable[[int, np.ndarray, np.ndarray], None] | None = None):
    """Generates up to `max_new_tokens` tokens for every prompt.

    Args:
      prompts: token-id sequences (lists or 1-D integer arrays), any lengths.
      max_new_tokens: tokens to generate per prompt (fewer when EOS comes first).
      sampling_params: the sampling strategy. seed: PRNG seed of the random strategies.
      stop_at_eos: stop a sequence at one of `stop_ids` (that token is kept in its output).
      on_tokens: optional `fn(group_start, tokens int32 [n], live bool [n])` called after the first
        token and after every decode step (streaming); `live[i]`: tokens[i] belongs to prompt
        group_start + i's output.

    Returns:
      `(list[SequenceResult] in prompt order, Timings)`.

    Raises:
      GenerationError: see `check_request`.
    """
    prompts = self.check_request(prompts, max_new_tokens)
    max_new_tokens = int(max_new_tokens)
    n = min(len(prompts), self.batch_size)
    groups = [prompts[i:i + n] for i in range(0, len(prompts), n)]
    row = round_up(max(sum(len(p) for p in g) for g in groups), self.prefill_multiple)
    need = max(len(p) for p in prompts) + max_new_tokens   # <= max_length (check_request)
    # Steps of the last chunk past max_new_tokens are dropped, their cache writes too (mode="drop").
    cache_length = min(round_up(need, self.cache_multiple), self.max_length)
    (prefill, step), compile_s = self._functions(n, row, cache_length, sampling_params)
    timings = Timings(compile_s=compile_s)
    rng = jax.random.key(int(seed))
    results: list[SequenceResult] = []
    group_rngs = [jax.random.fold_in(rng, gi) for gi in range(len(groups))]  # outside the timed region
    for gi, group in enumerate(groups):
      group_rng = group_rngs[gi]
      results.extend(self._run_group(group, gi * n, n, row, max_new_tokens, prefill, step, group_rng,
                                     stop_at_eos, on_tokens, timings, first=gi == 0))
    return results, timings

  def _run_group(self, group, start, n, row, max_new_tokens, prefill, step, rng, stop_at_eos, on_tokens,
                 timings, first):
    ids, seg = pack_prompts(group, n, row)
    real = np.arange(n) < len(group)
    stop = stop_at_eos and bool(self.stop_ids)
    stops = np.full((MAX_STOP_IDS,), -1, np.int32)
    if stop:
      stops[:len(self.stop_ids)] = sorted(self.stop_ids)
    ids, seg, eos_arg, pad_arg = jnp.asarray(ids), jnp.asarray(seg), jnp.asarray(stops), jnp.int32(self.pad_id)
    limit = jnp.int32(self.vocab_limit)
    t0 = time.perf_counter()
    tok, cache = prefill(self._leaves, ids, seg, rng, limit)
    tok_host = np.asarray(tok)
    t1 = time.perf_counter()
    if first:
      timings.time_to_first_token_s = t1 - t0
    timings.prefill_s += t1 - t0
    timings.prefill_tokens += int(sum(len(p) for p in group))
    outputs = [[int(tok_host[i])] for i in range(len(group))]
    done_host = ~real | (np.isin(tok_host, list(self.stop_ids)) if stop else False)
    if on_tokens is not None:
      on_tokens(start, tok_host[:len(group)], real[:len(group)])
    done = jnp.asarray(done_host)
    t2 = time.perf_counter()
    i = 1                                       # tokens produced so far by each live sequence
    while i < max_new_tokens and not done_host.all():
      toks, lives, tok, cache, done = step(self._leaves, tok, cache, done, eos_arg, pad_arg, limit, rng,
                                           jnp.int32(i))
      toks_host, lives_host, done_host = jax.device_get((toks, lives, done))
      for k in range(min(self.decode_chunk, max_new_tokens - i)):   # steps past the budget are dropped
        live = lives_host[k] & real
        if not live.any():  # every sequence had finished: a masked step of the chunk, nothing generated
          break
        timings.decode_steps += 1
        timings.decode_tokens += int(live.sum())
        for j in np.nonzero(live)[0]:
          outputs[j].append(int(toks_host[k, j]))
        if on_tokens is not None:
          on_tokens(start, toks_host[k, :len(group)], live[:len(group)])
      i += self.decode_chunk
    timings.decode_s += time.perf_counter() - t2
    results = []
    for p, out in zip(group, outputs):
      reason = "eos" if stop and out and out[-1] in self.stop_ids else "length"
      results.append(SequenceResult(list(p), out, reason))
    return results
