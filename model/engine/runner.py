"""The continuous engine's model runner: the device side of a step (vLLM's model-runner role).

It owns the parameters, the slot pool and the step executables (from `model.engine.executables`:
engines over the same model and sizes share them). `execute(plan)` builds a `StepPlan`'s inputs,
runs its executable and returns the sampled tokens on the host. Routes (`EngineConfig.decode_path`):
"decode" runs a step without prompt chunks as the decode-only executable and one with them as the
split step; "mixed" runs every step as one packed prefill row (README, "Which op runs when").
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import sys
import threading
import time

import jax
import numpy as np
from flax import nnx

from model.engine import compilation_cache, executables, mixed_step, scheduler
from model.engine.api import check_vocab_limit
from model.engine.config import EngineConfig
from model.engine.prefix_cache import Snapshot
from model.engine.slots import SlotPool

# Largest bucket with a one-prompt (P = 1) split step: a lone prompt chunk need not pay for P slots;
# above it the row's own work dominates (docs/performance.md).
SINGLE_PROMPT_MAX_BUCKET = 64


@dataclasses.dataclass(frozen=True)
class CompileRecord:
  """One step executable made ready: `name` (`step_name`), `seconds` of compilation (or of loading it
  from the persistent cache); `cached`: True when jax loaded it from the persistent compilation cache,
  False when it compiled it, None when the persistent cache is off; `shared`: the process already
  held it (another engine over an equal model), nothing was compiled."""

  name: str
  seconds: float
  cached: bool | None
  shared: bool = False


def step_name(bucket: int | None, num_prefill: int | None) -> str:
  """A step executable's name for logs: "decode" (the decode-only step), "split T=256 P=4" (decode
  tokens + prompt chunks of a 256-token row on a 4-slot sub-pool) or "mixed T=256" (one packed row)."""
  if bucket is None:
    return "decode"
  return f"mixed T={bucket}" if num_prefill is None else f"split T={bucket} P={num_prefill}"


def default_compile_threads(count: int) -> int:
  """Threads `ModelRunner.compile_all` compiles on: $KDA_COMPILE_THREADS when set, else half the host's
  cores (at most 8: each TPU compilation of the 0.9B model holds a few GiB of host memory), at
  most `count`, at least 1."""
  env = os.environ.get("KDA_COMPILE_THREADS", "").strip()
  n = int(env) if env else min(8, (os.cpu_count() or 2) // 2)
  return max(1, min(n, count))


@dataclasses.dataclass
class StepOutput:
  """A step's results on the host, per slot (unscheduled slots' rows are meaningless): tokens `[S]`,
  logprobs `[S]`, top2 `[S, 2]`; `entries`: slot -> its split-step sub-pool entry (for `snapshot`)."""

  tokens: np.ndarray
  logprobs: np.ndarray
  top2: np.ndarray
  entries: dict


class ModelRunner:
  """Runs the steps of a continuous engine on the device.

  Args:
    model: a `KimiLinearForCausalLM`; its parameters are split out once, the object is not modified.
    config: the engine's sizes (`EngineConfig`, already validated).
    vocab_limit: only ids below it are generated; default the model's vocabulary.
    mesh, rules: run a model sharded on this mesh (`model.partitioning`); None: one device.

  Attributes:
    buckets: the row lengths of the compiled steps. single_prompt_buckets: those that also have a
      one-prompt (P = 1) split step. pool: the `SlotPool`.
    compiled: (bucket, P) -> executable used so far (AOT: never recompiles, so len() counts them).
    compile_seconds: time this runner spent compiling step executables.

  Raises:
    GenerationError: vocab_limit outside [1, vocab_size].
  """

  def __init__(self, model, config: EngineConfig, *, vocab_limit: int | None = None, mesh=None, rules=None):
    self.config = config
    self.num_slots, self.split = config.max_num_seqs, config.decode_path == "decode"
    self.num_partial_prefills = config.num_partial_prefills
    self.vocab_size = int(model.args.vocab_size)
    self.vocab_limit = check_vocab_limit(vocab_limit, self.vocab_size)
    self.buckets = scheduler.buckets(scheduler.row_limit(config), scheduler.min_bucket(config))
    self.single_prompt_buckets = (tuple(b for b in self.buckets if b <= SINGLE_PROMPT_MAX_BUCKET)
                                  if self.split and self.num_partial_prefills > 1 else ())
    self.mesh, self._rules = mesh, rules
    graphdef, state = nnx.split(model)
    self.leaves, treedef = jax.tree.flatten(state)
    p = self.num_partial_prefills
    self._step_fns = ({n: mixed_step.build_split_step(graphdef, treedef, self.num_slots, n) for n in {1, p}}
                      if self.split else {None: mixed_step.build_step(graphdef, treedef, self.num_slots)})
    self._decode_fn = mixed_step.build_decode(graphdef, treedef)
    self._key = executables.model_key(graphdef, treedef, mesh, rules) + (
        "continuous", self.num_slots, config.max_model_len, config.decode_path)
    self.compiled: dict[tuple, object] = {}
    self.compile_seconds = 0.0
    self._compile_lock = threading.Lock()
    self.pool = SlotPool(model, self.num_slots, config.max_model_len, mesh=mesh, rules=rules)
    self._mid = None   # the last split step's sub-pool KDA states after its first stage (device)

  # --- executables --------------------------------------------------------------------------------
  def step_shapes(self) -> list[tuple]:
    """(bucket, P) of every step executable: P None for the decode-only step and the mixed route."""
    if not self.split:
      return [(b, None) for b in self.buckets]
    p = self.num_partial_prefills
    return [(b, p) for b in self.buckets] + [(b, 1) for b in self.single_prompt_buckets] + [(None, None)]

  @property
  def max_compilations(self) -> int:
    """Step executables this runner can ever need (`step_shapes`)."""
    return len(self.step_shapes())

  def compiled_step(self, bucket: int | None, num_prefill: int | None = 0):
    """The executable for a row of `bucket` tokens, or the decode-only step for None (compiled on
    first use, with a log line on stderr: a step that waits for a compilation should be visible).
    `num_prefill`: the split step's P, 1 or by default `num_partial_prefills`.

    Raises:
      ValueError: a (bucket, P) this runner has no executable for.
    """
    shape = self._shape(bucket, num_prefill)
    if shape not in self.compiled:
      key = self._key + shape
      if executables.lookup(key) is None:
        record = self._compile(shape, self._lower(shape))
        print(f"compiled {record.name} on first use: {record.seconds:.1f} s"
              f"{' (persistent cache)' if record.cached else ''}", file=sys.stderr, flush=True)
      self.compiled[shape] = executables.lookup(key)
    return self.compiled[shape]

  def _shape(self, bucket: int | None, num_prefill: int | None = 0) -> tuple:
    split = bucket is not None and self.split
    num_prefill = (num_prefill or self.num_partial_prefills) if split else None
    shape = (bucket, num_prefill)
    if shape not in self.step_shapes():
      raise ValueError(f"no step executable for bucket={bucket}, num_prefill={num_prefill} "
                       f"(this engine's: {self.step_shapes()})")
    return shape

  def _lower(self, shape: tuple):
    bucket, num_prefill = shape
    fn = self._decode_fn if bucket is None else self._step_fns[num_prefill]
    return mixed_step.lower_step(fn, self.leaves, self.pool.cache, bucket, self.num_slots, mesh=self.mesh,
                                 rules=self._rules, pool_shardings=self.pool.shardings, num_prefill=num_prefill)

  def _compile(self, shape: tuple, lowered) -> CompileRecord:
    """Compiles `lowered` (any thread) and stores it in the process's executable cache."""
    t0 = time.perf_counter()
    with compilation_cache.watch() as seen:
      exe = lowered.compile()
    seconds = time.perf_counter() - t0
    executables.put(self._key + shape, exe, seconds)
    with self._compile_lock:   # compile_all's threads
      self.compile_seconds += seconds
    return CompileRecord(step_name(*shape), seconds, seen["hits"] > 0 if seen["requests"] else None)

  def compile_all(self, on_compiled=None, *, transfers: bool = False, threads: int | None = None,
                  on_tracing=None) -> float:
    """Compiles every step executable (with `transfers`, the prefix cache's slot transfers too), so
    no request waits for a compilation; the pool is not changed.

    The programs are traced one after another on this thread, each handed to `threads` compiling
    threads as soon as it is traced (XLA's compilation releases the GIL; default
    `default_compile_threads()`); an executable the process already has (another engine over an
    equal model) or that jax's persistent compilation cache holds (`model.engine.compilation_cache`)
    is not compiled again.

    Args:
      on_compiled: optional `fn(CompileRecord)`, called on this thread as each executable is ready
        (e.g. a tqdm bar's update), in completion order, while later programs are still traced too.
      transfers: also the prefix cache's slot transfers.
      threads: compiling threads (>= 1).
      on_tracing: optional `fn(name)`, called on this thread before each program is traced (tracing
        a 27-layer model unrolled takes seconds a program: a bar should say so).

    Returns:
      The seconds it took (wall clock).
    """
    t0 = time.perf_counter()
    todo = [shape for shape in self.step_shapes() if shape not in self.compiled]
    for shape in list(todo):
      if executables.lookup(self._key + shape) is not None:   # another engine over an equal model compiled it
        self.compiled[shape] = executables.lookup(self._key + shape)
        todo.remove(shape)
        if on_compiled is not None:
          on_compiled(CompileRecord(step_name(*shape), 0.0, None, shared=True))
    threads = default_compile_threads(len(todo)) if threads is None else int(threads)
    if threads < 1:
      raise ValueError(f"threads must be >= 1, got {threads}")
    def traced(shape):
      if on_tracing is not None:
        on_tracing(step_name(*shape))
      return self._lower(shape)

    def finish(shape, record):
      self.compiled[shape] = executables.lookup(self._key + shape)
      if on_compiled is not None:
        on_compiled(record)

    def compile_transfers():
      sizes = sorted({n for _, n in self.step_shapes() if n is not None})
      self.pool.compile_transfers([self._mid_example(n) for n in sizes])

    if threads == 1 or not todo:
      for shape in todo:
        finish(shape, self._compile(shape, traced(shape)))
      if transfers:
        compile_transfers()
    else:
      with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="compile") as pool:
        pending = {}
        for shape in todo:
          lowered = traced(shape)
          pending[pool.submit(self._compile, shape, lowered)] = shape
          for future in [f for f in pending if f.done()]:   # report what finished while tracing
            finish(pending.pop(future), future.result())
        if transfers:   # small programs, compiled here while the steps compile on the threads
          compile_transfers()
        for future in concurrent.futures.as_completed(list(pending)):
          finish(pending.pop(future), future.result())
    return time.perf_counter() - t0

  def _mid_example(self, num_prefill: int):
    """A zero `mid` for a P-slot sub-pool, placed as the step returns it (compiles `take_mid`)."""
    zeros = mixed_step.kda_fields(jax.tree.map(lambda x: jax.numpy.zeros((num_prefill,) + x.shape[1:], x.dtype),
                                               self.pool.cache))
    where = (jax.devices()[0] if self.mesh is None
             else jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
    return jax.device_put(zeros, where)

  # --- a step -------------------------------------------------------------------------------------
  def execute(self, plan: scheduler.StepPlan) -> StepOutput:
    """Runs `plan` (see the module docstring); the pool is updated in place."""
    s_count, t = self.num_slots, plan.bucket
    split = self.split
    decode_only = split and all(not c.seq.prefilling for c in plan.chunks)
    ids = np.zeros((2 if split else 1, t), np.int32)    # split: row 1 = the tails (second stage)
    seg = np.zeros_like(ids)
    last = np.zeros(s_count, np.int32)      # each decoding slot's input token
    active = np.zeros(s_count, bool)        # the slots that decode (split and decode-only steps)
    n_prompts = sum(1 for c in plan.chunks if c.seq.prefilling)
    p_count = 1 if n_prompts == 1 and t in self.single_prompt_buckets else self.num_partial_prefills
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
    entries = {}
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
      greedy[s], temperature[s], top_k[s], top_p[s] = seq.request.sampling.row()
      seeds[s] = int(seq.request.seed) & 0xFFFFFFFF
      positions[s] = c.output_index
    sampling = (greedy, temperature, top_k, top_p, seeds, positions, np.int32(self.vocab_limit))
    if decode_only:
      out = self.compiled_step(None)(self.leaves, self.pool.cache, last, active, *sampling)
    elif split:
      *out, self._mid = self.compiled_step(t, p_count)(self.leaves, self.pool.cache, last, active, ids, seg,
                                                       sub_slots, sub_fresh, *sampling)
    else:
      out = self.compiled_step(t)(self.leaves, self.pool.cache, ids, seg, fresh, *sampling)
    tok, logprob, top2, self.pool.cache = out
    return StepOutput(*jax.device_get((tok, logprob, top2)), entries)

  # --- prefix-cache transfers ---------------------------------------------------------------------
  def snapshot(self, slot: int, num_tokens: int, entry: int | None = None) -> Snapshot:
    """The state after `num_tokens` prompt tokens: slot `slot`'s now, or, with `entry`, the last
    split step's first-stage output (`SlotPool.take_mid`)."""
    if entry is None:
      return self.pool.take(slot, num_tokens)
    return self.pool.take_mid(self._mid, entry, slot, num_tokens)

  def restore(self, slot: int, snapshot: Snapshot) -> None:
    """Writes `snapshot` into slot `slot`."""
    self.pool.put(slot, snapshot)
