"""The continuous-batching engine (`model.engine.api.Engine`): admission, plan -> run -> update, emit.

Per `step`:
  1. events of requests cancelled since the last step (their slots were freed at `cancel`);
  2. admission: waiting requests take free slots in arrival order; with the prefix cache on, the
     deepest cached block-aligned prefix is restored into the slot and only the rest is prefilled;
  3. plan: `model.engine.scheduler.plan_step` picks the step's decode tokens and prompt chunks;
  4. run: `model.engine.runner.ModelRunner.execute` runs the plan on the device and samples;
  5. update and emit: tokens are emitted; a request that hits a stop id or max_tokens frees its slot
     in this step; then a chunk that ended at a prefix-cache boundary has its state there copied
     into the cache (a device copy, `model.engine.slots`: snapshots live in device memory).
The engine holds no device code: the runner owns the parameters, the slot pool and the executables.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

import numpy as np

from model.engine import scheduler
from model.engine.api import EngineStats, GenerationError, Request, TokenEvent
from model.engine.config import EngineConfig
from model.engine.prefix_cache import PrefixCache, block_keys
from model.engine.runner import ModelRunner
from model.engine.scheduler import Sequence
from model.errors import UsageError


def check_prefix_cache_fits(budget_bytes: int, devices) -> None:
  """Refuses a prefix-cache budget larger than the device memory free now (after the weights and the
  slot pool), summed over `devices`: snapshots live there. Devices that report no memory statistics
  (XLA:CPU) are not checked; the step executables' temporaries need room beside the budget too.

  Raises:
    UsageError: names prefix_cache_bytes, the budget and the free bytes.
  """
  free = 0
  for device in devices:
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
      return
    free += stats["bytes_limit"] - stats.get("bytes_in_use", 0)
  if budget_bytes > free:
    raise UsageError(f"prefix_cache_bytes={budget_bytes} does not fit: snapshots live in device memory and "
                     f"{free} bytes are free after the weights and the slot pool ({len(devices)} device(s)); "
                     f"lower prefix_cache_bytes (0 turns the prefix cache off)")


@dataclasses.dataclass
class StepTiming:
  """Host-clock seconds of the last `ContinuousEngine.step`'s stages, and what it did.

  admit_s: admission (prefix-cache lookups, restores dispatched: their device copies run before the
  step's executable); execute_s: the runner's plan run and sampled tokens back on the host (device time
  of the step and of what was queued before it, dispatch included); events_s: token bookkeeping and
  `emit`; saves_s: snapshot copies dispatched. prompts: prompt chunks in the plan; decodes: decode
  tokens; restores, saves: prefix-cache copies. Zeros (and executed False) for a step with no plan.
  """

  admit_s: float = 0.0
  execute_s: float = 0.0
  events_s: float = 0.0
  saves_s: float = 0.0
  prompts: int = 0
  decodes: int = 0
  restores: int = 0
  saves: int = 0
  executed: bool = False


class ContinuousEngine:
  """Continuous batching over a fixed pool of `max_num_seqs` slots (see the module docstring).

  Args:
    model: a `KimiLinearForCausalLM` (e.g. `model.loading.load(...).model`).
    config: the sizes (`EngineConfig`, engine="continuous").
    vocab_limit: only ids below it are generated (a tokenizer smaller than the padded vocabulary);
      default the model's vocabulary.
    mesh, rules: serve a model sharded on this mesh (`model.partitioning`; rules: a config or parsed
      `logical_axis_rules`); None: one device.

  Attributes:
    runner: the `ModelRunner` (device side: executables, slot pool).
    last_top2: request_id -> the two largest log-probs (untempered) at the position of the token the
      last step emitted for it: lets a caller tell a near-tie from a real disagreement.

  Raises:
    GenerationError: vocab_limit outside [1, vocab_size].
    UsageError: `config.prefix_cache_bytes` exceeds the device memory left (`check_prefix_cache_fits`).
  """

  def __init__(self, model, config: EngineConfig, *, vocab_limit: int | None = None, mesh=None, rules=None):
    self.config = config
    self.max_num_seqs, self.max_model_len = config.max_num_seqs, config.max_model_len
    self.max_num_partial_prefills = config.num_partial_prefills
    self.runner = ModelRunner(model, config, vocab_limit=vocab_limit, mesh=mesh, rules=rules)
    self.vocab_size = self.runner.vocab_size
    self.pool = self.runner.pool
    check_prefix_cache_fits(config.prefix_cache_bytes, self.pool.devices())
    self.prefix_cache = PrefixCache(config.prefix_cache_bytes)
    self.last_top2: dict[str, tuple[float, float]] = {}
    self._waiting: collections.deque[Sequence] = collections.deque()
    self._running: list[Sequence] = []
    self._live: dict[str, Sequence] = {}
    self._cancelled: list[str] = []
    self._stats = EngineStats()
    self.last_step_timing = StepTiming()   # the last step's stages (benchmarks read it)

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
    step executables this engine has used (at most `runner.max_compilations`)."""
    s = self._stats
    s.num_running, s.num_waiting = len(self._running), len(self._waiting)
    s.num_free_slots, s.num_compilations = self.pool.num_free, len(self.runner.compiled)
    s.prefix_cache_bytes = self.prefix_cache.bytes
    return EngineStats(**vars(s))

  def step(self, emit: Callable[[TokenEvent], None]) -> None:
    """One engine step (see the module docstring); `emit` gets every event in order: cancellations,
    then one token per emitting request in slot order."""
    timing = self.last_step_timing = StepTiming()
    t0 = time.perf_counter()
    for rid in self._cancelled:
      emit(TokenEvent(rid, None, None, "cancelled"))
    self._cancelled.clear()
    timing.restores = self._admit()
    split = self.runner.split
    plan = scheduler.plan_step(self._running, self.config.max_num_batched_tokens, self.runner.buckets,
                               max_prefills=self.max_num_partial_prefills if split else None,
                               decodes_in_row=not split, tails=split and self.prefix_cache.enabled)
    t1 = time.perf_counter()
    timing.admit_s = t1 - t0
    if plan is None:
      return
    out = self.runner.execute(plan)
    tok, logprob, top2 = out.tokens, out.logprobs, out.top2
    t2 = time.perf_counter()
    timing.execute_s, timing.executed = t2 - t1, True
    self.last_top2 = {}
    # Snapshots are copied after the step's events are out (device copies, dispatched, not waited for).
    # The pool is not touched until the next step, so the slots still hold the states the snapshots
    # need (a finished request's too).
    saves = []
    for chunk in sorted(plan.chunks, key=lambda c: c.seq.slot):
      seq = chunk.seq
      seq.fresh = False   # the step reset its slot (or continued a restored one)
      if chunk.tokens and seq.prefilling:
        timing.prompts += 1
        seq.num_computed += len(chunk.tokens)
        if chunk.snapshot_at is not None:
          # After a tail the slot is past the boundary: its state there is the step's `mid` output.
          saves.append((seq, seq.slot, chunk.snapshot_at, out.entries[seq.slot] if chunk.tail else None))
        seq.num_computed += len(chunk.tail)
        if chunk.tail_snapshot_at is not None:
          saves.append((seq, seq.slot, chunk.tail_snapshot_at, None))
        if not seq.prefilling:
          self._stats.prompt_tokens += seq.prompt_length
          self._stats.cached_prompt_tokens += seq.cached_tokens
      elif chunk.tokens:
        timing.decodes += 1
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
    t3 = time.perf_counter()
    for seq, slot, num_tokens, entry in saves:
      self._save(seq, slot, num_tokens, entry)
    timing.events_s, timing.saves_s, timing.saves = t3 - t2, time.perf_counter() - t3, len(saves)

  # --- internals ---------------------------------------------------------------------------------
  def _admit(self) -> int:
    """Admits waiting requests into free slots; returns how many prefix-cache restores it dispatched."""
    restores = 0
    while self._waiting and self.pool.num_free:
      seq = self._waiting.popleft()
      seq.slot = self.pool.acquire()
      if self.prefix_cache.enabled:
        seq.keys = block_keys(seq.request.prompt_ids)
        snap = self.prefix_cache.lookup(seq.keys, seq.prompt_length)
        if snap is not None:
          self.runner.restore(seq.slot, snap)
          restores += 1
          seq.cached_tokens = seq.num_computed = snap.num_tokens
          seq.fresh = False
        seq.splits = self.prefix_cache.boundaries(seq.keys, seq.num_computed)
      self._running.append(seq)
    return restores

  def _finish(self, seq: Sequence):
    self._running.remove(seq)
    self._live.pop(seq.request.request_id, None)
    self.pool.release(seq.slot)

  def _save(self, seq: Sequence, slot: int, num_tokens: int, entry: int | None = None):
    """Caches `seq`'s state after `num_tokens` prompt tokens (`ModelRunner.snapshot`)."""
    self.prefix_cache.insert(seq.keys[num_tokens // 64 - 1], self.runner.snapshot(slot, num_tokens, entry))

  def compile_all(self, on_compiled=None, *, threads: int | None = None, on_tracing=None) -> float:
    """Compiles every step executable now and, with the prefix cache on, the slot snapshot transfers,
    so that no request ever waits for a compilation (a server calls it before it listens); see
    `ModelRunner.compile_all` (`on_compiled` gets a `CompileRecord` per executable, `on_tracing` a
    step's name before it is traced). Returns the seconds it took."""
    return self.runner.compile_all(on_compiled, transfers=self.prefix_cache.enabled, threads=threads,
                                   on_tracing=on_tracing)
