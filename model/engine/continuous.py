"""The continuous-batching engine (`model.engine.api.Engine`): a slot pool, mixed steps, chunked
prefill and a prefix cache of KDA / MLA states.

Per `step`:
  1. events of requests cancelled since the last step (their slots were freed at `cancel`);
  2. admission: waiting requests take free slots in arrival order; with the prefix cache on, the
     deepest cached block-aligned prefix is restored into the slot (`SlotPool.put`) and only the
     rest of the prompt is prefilled;
  3. `model.engine.scheduler.plan_step` takes one decode token per decoding request, then prompt
     chunks of up to `max_num_partial_prefills` requests, at most `max_num_batched_tokens` tokens
     in all; the prompt tokens are packed into a row padded to a shape bucket (with the prefix
     cache on, a chunk that ends at a boundary continues past it in a second row, its tail);
  4. the bucket's compiled `model.engine.mixed_step` runs it and samples every emitting request;
  5. tokens are emitted; a request that hits a stop id or max_tokens frees its slot in this step;
     then a chunk that ended at a prefix-cache boundary has its state there copied into the cache
     (the slot's, or, when a tail went on past it, the step's first-stage `mid` output).
Host-device traffic per step: the packed row and per-slot sampling arrays in, three [S] vectors out.

Decode routing (`decode_path`), by measurement (README, "Which op runs when"): by default decode
tokens go through `KimiLinearForCausalLM.decode` (`kda_decode_step`, absorbed MLA): a step without
prompt chunks is the decode-only executable; a step with them is the split step
(`mixed_step.build_split_step`: the decode tokens through `decode`, the prompt chunks through
`prefill` on a sub-pool of the P prefilling slots). `decode_path="mixed"` runs every step as one
packed row through `prefill`, decode tokens as one-token segments (`kda_inference` solves chunks
and single tokens in one call). Executables: one per row bucket, plus the decode-only one; with
the split step and P > 1, also a one-prompt variant (P = 1) of each bucket up to
`SINGLE_PROMPT_MAX_BUCKET` tokens, which a step with a single prompt chunk runs (`max_compilations`).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from model import partitioning
from model.engine import mixed_step, scheduler
from model.engine.api import EngineStats, Request, TokenEvent
from model.engine.prefix_cache import PrefixCache, block_keys
from model.engine.scheduler import Sequence
from model.engine.serving import GenerationError
from model.engine.slots import SlotPool

# Step executables per (graphdef, treedef, S, L, mesh, rules, route, bucket, P), shared by every engine in the
# process (an engine over the same model and sizes, e.g. with the prefix cache on and off, reuses
# them). The cache keeps no parameters alive: the key holds only the graph and tree structure.
_EXECUTABLES: dict = {}

# Largest row bucket with a one-prompt (P = 1) variant of the split step. The prefill's per-slot work
# (initial states, MLA prefix attention, final states) spans the sub-pool, so a step with a single
# prompt chunk (the common case: a new request or a prefix-cache hit arriving alone) pays for P slots
# on a P-slot sub-pool. Measured (demo model, 2-core CPU, one prefill stage): T = 16: 8.1 -> 5.8 ms,
# T = 64: 13.5 -> 9.7 ms with P = 4 -> 1; at T >= 128 the row's own work dominates (21.4 vs 21.1 ms),
# so the larger buckets keep one executable each.
SINGLE_PROMPT_MAX_BUCKET = 64


class ContinuousEngine:
  """Continuous batching over a fixed pool of `max_num_seqs` slots (see the module docstring).

  Args:
    model: a `KimiLinearForCausalLM` (e.g. `model.loading.load(...).model`); its parameters are split
      out once, the object is not modified.
    max_num_seqs: S, requests holding a slot at once (>= 1).
    max_model_len: prompt + output tokens of one request (>= 2); the MLA latent rows per slot.
    max_num_batched_tokens: tokens one step may process (>= max_num_seqs, so every decoding request
      gets its token each step); the largest shape bucket.
    prefix_cache_bytes: byte budget of the prefix cache's host snapshots; 0 = off.
    vocab_limit: only ids below it are generated (a tokenizer smaller than the padded vocabulary);
      default the model's vocabulary.
    mesh, rules: serve a model sharded on this mesh (`model.partitioning`; rules: a config or parsed
      `logical_axis_rules`); None: one device.
    decode_path: "decode" (the default: decode tokens go through `model.decode`, in a decode-only
      step or beside the prompt chunks in a split step, the measured faster route) or "mixed"
      (every token through one packed row, one-token decode segments included).
    max_num_partial_prefills: P, prompts (whole or a chunk) prefilled in one step (vLLM's name),
      in [1, max_num_seqs]; default min(4, max_num_seqs). Only for decode_path="decode": the split
      step prefills on a P-slot sub-pool, so its cost grows with P, not with S.

  Attributes:
    buckets: the row lengths of the compiled steps (`model.engine.scheduler.buckets`).
    single_prompt_buckets: the buckets that also have a one-prompt (P = 1) split step, run by steps
      with a single prompt chunk (empty with decode_path="mixed" or P = 1).
    last_top2: request_id -> the two largest log-probs (untempered) at the position of the token the
      last step emitted for it: lets a caller tell a near-tie from a real disagreement.
    compile_seconds: time this engine spent compiling step executables.

  Raises:
    GenerationError: a size out of range (names the argument).
  """

  def __init__(self, model, *, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
               prefix_cache_bytes: int = 0, vocab_limit: int | None = None, mesh=None, rules=None,
               decode_path: str = "decode", max_num_partial_prefills: int | None = None):
    for name, v, low in (("max_num_seqs", max_num_seqs, 1), ("max_model_len", max_model_len, 2),
                         ("max_num_batched_tokens", max_num_batched_tokens, 1), ("prefix_cache_bytes",
                                                                                 prefix_cache_bytes, 0)):
      if int(v) < low:
        raise GenerationError(f"{name} must be >= {low}, got {v}")
    if int(max_num_batched_tokens) < int(max_num_seqs):
      raise GenerationError(f"max_num_batched_tokens={max_num_batched_tokens} must be >= max_num_seqs="
                            f"{max_num_seqs} (every decoding request needs one token per step)")
    if decode_path not in ("decode", "mixed"):
      raise GenerationError(f"decode_path must be 'decode' or 'mixed', got {decode_path!r}")
    self.decode_path = decode_path
    p = min(4, int(max_num_seqs)) if max_num_partial_prefills is None else int(max_num_partial_prefills)
    if not 1 <= p <= int(max_num_seqs):
      raise GenerationError(f"max_num_partial_prefills must be in [1, max_num_seqs={max_num_seqs}], got "
                            f"{max_num_partial_prefills}")
    self.max_num_partial_prefills = p
    self.max_num_seqs = int(max_num_seqs)
    self.max_model_len = int(max_model_len)
    self.max_num_batched_tokens = int(max_num_batched_tokens)
    self.vocab_size = int(model.args.vocab_size)
    self.vocab_limit = self.vocab_size if vocab_limit is None else int(vocab_limit)
    if not 1 <= self.vocab_limit <= self.vocab_size:
      raise GenerationError(f"vocab_limit must be in [1, {self.vocab_size}], got {vocab_limit}")
    self.buckets = scheduler.buckets(self.max_num_batched_tokens)
    self.single_prompt_buckets = tuple(b for b in self.buckets if b <= SINGLE_PROMPT_MAX_BUCKET) \
        if decode_path == "decode" and p > 1 else ()
    self.mesh, self._rules = mesh, rules
    graphdef, state = nnx.split(model)
    self._leaves, treedef = jax.tree.flatten(state)
    self._step_fns = ({n: mixed_step.build_split_step(graphdef, treedef, self.max_num_seqs, n) for n in {1, p}}
                      if decode_path == "decode" else {None: mixed_step.build_step(graphdef, treedef,
                                                                                   self.max_num_seqs)})
    self._decode_fn = mixed_step.build_decode(graphdef, treedef)
    self._key = (graphdef, treedef, self.max_num_seqs, self.max_model_len, mesh,
                 None if rules is None else repr(partitioning.as_rules(rules)), decode_path)
    # (bucket, P) -> the AOT executable this engine steps with. An AOT executable never recompiles (a
    # shape or sharding mismatch raises), so len() of this is exactly the step compilations used.
    self._compiled: dict[tuple, object] = {}
    self.last_top2: dict[str, tuple[float, float]] = {}
    self.compile_seconds = 0.0
    self.pool = SlotPool(model, self.max_num_seqs, self.max_model_len, mesh=mesh, rules=rules)
    self.prefix_cache = PrefixCache(int(prefix_cache_bytes))
    self._waiting: collections.deque[Sequence] = collections.deque()
    self._running: list[Sequence] = []
    self._live: dict[str, Sequence] = {}
    self._cancelled: list[str] = []
    self._stats = EngineStats()
    self._mid = None   # the last split step's sub-pool KDA states after its first stage (device)

  # --- the Engine protocol ----------------------------------------------------------------------------
  def add_request(self, request: Request) -> None:
    """Queues `request` (see `model.engine.api.Request`).

    Raises:
      GenerationError: names the field: `request_id` already live, empty `prompt_ids`, ids outside
        [0, vocab_size), `max_tokens` < 1, or prompt + max_tokens > max_model_len.
    """
    rid = request.request_id
    if rid in self._live:
      raise GenerationError(f"request_id {rid!r} is already in use by a live request")
    n = len(request.prompt_ids)
    if n == 0:
      raise GenerationError("prompt_ids is empty (a request needs at least one prompt token)")
    ids = np.asarray(request.prompt_ids)
    if not np.issubdtype(ids.dtype, np.integer):
      raise GenerationError(f"prompt_ids must be integers, got {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= self.vocab_size)]
    if bad.size:
      raise GenerationError(f"prompt_ids holds token ids outside the vocabulary [0, {self.vocab_size}): "
                            f"{bad[:8].tolist()}")
    if int(request.max_tokens) < 1:
      raise GenerationError(f"max_tokens must be >= 1, got {request.max_tokens}")
    if n >= self.max_model_len:
      raise GenerationError(f"prompt_ids has {n} tokens; max_model_len={self.max_model_len} leaves no room to "
                            f"generate (at most {self.max_model_len - 1} prompt tokens)")
    if n + int(request.max_tokens) > self.max_model_len:
      raise GenerationError(f"max_tokens={request.max_tokens} with a {n}-token prompt needs {n + request.max_tokens} "
                            f"> max_model_len={self.max_model_len} tokens (at most "
                            f"{self.max_model_len - n} new tokens)")
    seq = Sequence(request)
    self._live[rid] = seq
    self._waiting.append(seq)

  def cancel(self, request_id: str) -> None:
    """Ends a waiting or running request now: its slot is free for the next step, which emits its
    TokenEvent(token_id=None, finish_reason="cancelled"). Unknown or finished ids are ignored."""
    seq = self._live.pop(request_id, None)
    if seq is None:
      return
    if seq.slot is None:
      self._waiting.remove(seq)
    else:
      self._running.remove(seq)
      self.pool.release(seq.slot)
      seq.slot = None
    self._cancelled.append(request_id)

  def slot_of(self, request_id: str) -> int | None:
    """The slot a live request holds, or None (waiting, finished or unknown)."""
    seq = self._live.get(request_id)
    return None if seq is None else seq.slot

  def has_unfinished(self) -> bool:
    """True while a request waits or runs, or a cancellation event is still to be emitted."""
    return bool(self._live) or bool(self._cancelled)

  def stats(self) -> EngineStats:
    """A copy of the current figures (`model.engine.api.EngineStats`); num_compilations counts the
    step executables this engine has used (at most `max_compilations`)."""
    s = self._stats
    s.num_running, s.num_waiting = len(self._running), len(self._waiting)
    s.num_free_slots, s.num_compilations = self.pool.num_free, len(self._compiled)
    s.prefix_cache_bytes = self.prefix_cache.bytes
    return EngineStats(**vars(s))

  def step(self, emit: Callable[[TokenEvent], None]) -> None:
    """One engine step (see the module docstring); `emit` gets every event in order: cancellations,
    then one token per emitting request in slot order."""
    for rid in self._cancelled:
      emit(TokenEvent(rid, None, None, "cancelled"))
    self._cancelled.clear()
    self._admit()
    split = self.decode_path == "decode"
    plan = scheduler.plan_step(self._running, self.max_num_batched_tokens, self.buckets,
                               max_prefills=self.max_num_partial_prefills if split else None,
                               decodes_in_row=not split, tails=split and self.prefix_cache.enabled)
    if plan is None:
      return
    tok, logprob, top2, entries = self._run(plan)
    self.last_top2 = {}
    # Snapshots are copied after the step's events are out: a prefix-cache hit's first token need not
    # wait for its own snapshot transfers (each a device-to-host copy). The pool is not touched until
    # the next step, so the slots still hold the states the snapshots need (a finished request's too).
    saves = []
    for chunk in sorted(plan.chunks, key=lambda c: c.seq.slot):
      seq = chunk.seq
      if chunk.tokens and seq.prefilling:
        seq.num_computed += len(chunk.tokens)
        if chunk.snapshot_at is not None:
          # After a tail the slot is past the boundary: its state there is the step's `mid` output.
          saves.append((seq, seq.slot, chunk.snapshot_at, entries[seq.slot] if chunk.tail else None))
        seq.num_computed += len(chunk.tail)
        if chunk.tail_snapshot_at is not None:
          saves.append((seq, seq.slot, chunk.tail_snapshot_at, None))
        if not seq.prefilling:
          self._stats.prompt_tokens += seq.prompt_length
          self._stats.cached_prompt_tokens += seq.cached_tokens
      if not chunk.emits:
        continue
      s = seq.slot
      t, lp = int(tok[s]), float(logprob[s])
      seq.output_ids.append(t)
      self._stats.generated_tokens += 1
      self.last_top2[seq.request.request_id] = (float(top2[s, 0]), float(top2[s, 1]))
      reason = None
      if t in seq.request.stop_token_ids:
        reason = "stop"
      elif len(seq.output_ids) >= seq.request.max_tokens:
        reason = "length"
      if reason is not None:
        self._finish(seq)
      emit(TokenEvent(seq.request.request_id, t, lp, reason, seq.cached_tokens))
    for seq, slot, num_tokens, entry in saves:
      self._save(seq, slot, num_tokens, entry)

  # --- internals --------------------------------------------------------------------------------------
  def _admit(self):
    while self._waiting and self.pool.num_free:
      seq = self._waiting.popleft()
      seq.slot = self.pool.acquire()
      if self.prefix_cache.enabled:
        seq.keys = block_keys(seq.request.prompt_ids)
        snap = self.prefix_cache.lookup(seq.keys, seq.prompt_length)
        if snap is not None:
          self.pool.put(seq.slot, snap)
          seq.cached_tokens = seq.num_computed = snap.num_tokens
          seq.fresh = False
        seq.splits = self.prefix_cache.boundaries(seq.keys, seq.num_computed)
      self._running.append(seq)

  def _finish(self, seq: Sequence):
    self._running.remove(seq)
    self._live.pop(seq.request.request_id, None)
    self.pool.release(seq.slot)

  def _save(self, seq: Sequence, slot: int, num_tokens: int, entry: int | None = None):
    """Caches `seq`'s state after `num_tokens` prompt tokens: slot `slot`'s now, or, with `entry`, the
    last split step's `mid` (sub-pool entry `entry`) with the slot's MLA latents."""
    key = seq.keys[num_tokens // 64 - 1]
    snap = (self.pool.take(slot, num_tokens) if entry is None
            else self.pool.take_mid(self._mid, entry, slot, num_tokens))
    self.prefix_cache.insert(key, snap)

  def compile_all(self, progress=None) -> float:
    """Compiles every step executable now (each row bucket, its one-prompt variant where it has one,
    the decode-only step and, with the prefix cache on, the slot snapshot transfers), so that no
    request ever waits for a compilation (a server calls it before it listens). `progress`: optional
    `fn(iterable, total) -> iterable` wrapping the loop over the step executables (e.g. tqdm).
    Returns the seconds it took; the pool is not changed."""
    t0 = time.perf_counter()
    steps = self._step_shapes()
    for bucket, num_prefill in (progress(steps, len(steps)) if progress is not None else steps):
      self.compiled_step(bucket, num_prefill)
    if self.prefix_cache.enabled:
      sizes = sorted({n for _, n in steps if n is not None})
      self.pool.compile_transfers([self._mid_example(n) for n in sizes])
    return time.perf_counter() - t0

  def _step_shapes(self) -> list[tuple]:
    """(bucket, P) of every step executable: P None for the decode-only step and the mixed route."""
    if self.decode_path != "decode":
      return [(b, None) for b in self.buckets]
    p = self.max_num_partial_prefills
    return ([(b, p) for b in self.buckets] + [(b, 1) for b in self.single_prompt_buckets] + [(None, None)])

  def _mid_example(self, num_prefill: int):
    """A zero `mid` of the split step's shape for a P-slot sub-pool (compiles `SlotPool.take_mid`
    before any step ran)."""
    zeros = mixed_step.kda_fields(jax.tree.map(lambda x: jax.numpy.zeros((num_prefill,) + x.shape[1:], x.dtype),
                                               self.pool.cache))
    # Placed as the step returns it (replicated on a mesh), so that the executable compiled here is
    # the one the step's real output uses.
    where = (jax.devices()[0] if self.mesh is None
             else jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
    return jax.device_put(zeros, where)

  @property
  def max_compilations(self) -> int:
    """Step executables this engine can ever need: one per row bucket, one per single-prompt bucket
    (`single_prompt_buckets`), plus the decode-only step."""
    return len(self._step_shapes())

  def compiled_step(self, bucket: int | None, num_prefill: int | None = 0):
    """The executable for a row of `bucket` tokens, or the decode-only step for None (compiled on
    first use, shared by engines of the same model and sizes). `num_prefill`: the split step's
    sub-pool size P, 1 (a bucket in `single_prompt_buckets`) or, by default, `max_num_partial_prefills`;
    ignored for the decode-only step and the mixed route.

    Raises:
      ValueError: a (bucket, P) this engine has no executable for.
    """
    split = bucket is not None and self.decode_path == "decode"
    num_prefill = (num_prefill or self.max_num_partial_prefills) if split else None
    shape = (bucket, num_prefill)
    if shape not in self._compiled:
      if shape not in self._step_shapes():
        raise ValueError(f"no step executable for bucket={bucket}, num_prefill={num_prefill} "
                         f"(this engine's: {self._step_shapes()})")
      key = self._key + shape
      if key not in _EXECUTABLES:
        t0 = time.perf_counter()
        fn = self._decode_fn if bucket is None else self._step_fns[num_prefill]
        _EXECUTABLES[key] = mixed_step.compile_step(fn, self._leaves, self.pool.cache, bucket,
                                                    self.max_num_seqs, mesh=self.mesh, rules=self._rules,
                                                    pool_shardings=self.pool.shardings, num_prefill=num_prefill)
        self.compile_seconds += time.perf_counter() - t0
      self._compiled[shape] = _EXECUTABLES[key]
    return self._compiled[shape]

  def _run(self, plan):
    s_count, t = self.max_num_seqs, plan.bucket
    split = self.decode_path == "decode"
    decode_only = split and all(not c.seq.prefilling for c in plan.chunks)
    ids = np.zeros((2 if split else 1, t), np.int32)    # split: row 1 = the tails (second stage)
    seg = np.zeros_like(ids)
    last = np.zeros(s_count, np.int32)      # each decoding slot's input token
    active = np.zeros(s_count, bool)        # the slots that decode (split and decode-only steps)
    n_prompts = sum(1 for c in plan.chunks if c.seq.prefilling)
    p_count = 1 if n_prompts == 1 and t in self.single_prompt_buckets else self.max_num_partial_prefills
    sub_slots = np.full(p_count, s_count, np.int32)   # split step: sub-pool entry -> slot (S: unused)
    sub_fresh = np.zeros(p_count, bool)
    fresh = np.zeros(s_count, bool)
    greedy = np.ones(s_count, bool)
    temperature = np.ones(s_count, np.float32)
    top_k = np.zeros(s_count, np.int32)
    top_p = np.ones(s_count, np.float32)
    seeds = np.zeros(s_count, np.uint32)
    positions = np.zeros(s_count, np.int32)
    u = u_tail = n_sub = 0
    entries = {}   # slot -> its sub-pool entry (split step)
    for c in plan.chunks:
      seq, s = c.seq, c.seq.slot
      if split and not seq.prefilling:
        last[s], active[s] = c.tokens[-1], True
      else:
        label = s + 1
        if split:
          sub_slots[n_sub], sub_fresh[n_sub] = s, seq.fresh
          entries[s] = n_sub
          n_sub += 1
          label = n_sub
        ids[0, u:u + len(c.tokens)] = c.tokens
        seg[0, u:u + len(c.tokens)] = label
        u += len(c.tokens)
        if c.tail:
          ids[1, u_tail:u_tail + len(c.tail)] = c.tail
          seg[1, u_tail:u_tail + len(c.tail)] = label
          u_tail += len(c.tail)
        fresh[s] = seq.fresh
      seq.fresh = False
      sp = seq.request.sampling
      greedy[s] = sp.strategy == "greedy"
      temperature[s] = sp.temperature if sp.strategy != "greedy" else 1.0
      top_k[s] = sp.top_k if sp.strategy == "topk" else 0
      top_p[s] = sp.top_p if sp.strategy == "nucleus" else 1.0
      seeds[s] = int(seq.request.seed) & 0xFFFFFFFF
      positions[s] = c.output_index
    sampling = (greedy, temperature, top_k, top_p, seeds, positions, np.int32(self.vocab_limit))
    if decode_only:
      out = self.compiled_step(None)(self._leaves, self.pool.cache, last, active, *sampling)
    elif split:
      *out, self._mid = self.compiled_step(t, p_count)(self._leaves, self.pool.cache, last, active, ids, seg,
                                                       sub_slots, sub_fresh, *sampling)
    else:
      out = self.compiled_step(t)(self._leaves, self.pool.cache, ids, seg, fresh, *sampling)
    tok, logprob, top2, self.pool.cache = out
    return (*jax.device_get((tok, logprob, top2)), entries)
