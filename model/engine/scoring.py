"""Per-token log-probabilities of whole documents (the perplexity engine).

Documents are packed into evaluation windows `[B, T]` (`model.data.pipeline.pack_eval_windows`). A
document longer than a window continues in the next one from the state the previous window left
(KDA state, conv windows, MLA latents), carried inside the compiled window function. The corpus is
scored in passes (`plan_schedules`) that size the MLA cache per document: short documents share the
packed pass; longer ones get long passes of one slot per row, grouped by power-of-two length. Token
t's score is `log p(doc[t] | doc[:t])` in float32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.errors import UserError, out_of_memory, out_of_memory_message
from model.nn import cache as cache_lib
from model import partitioning
from model.data.pipeline import EvalWindow, pack_eval_windows
from model.engine import executables
from model.engine.generator import round_up

PACKED_LIMIT = 2   # windows' length up to which a document shares the packed pass


class ScoringError(UserError):
  """Documents the model cannot score (token ids outside its vocabulary)."""


class ScoringOutOfMemory(ScoringError):
  """XLA ran out of memory in one pass: `out of memory (<XLA's first line>): <advice>`
  (`Scorer.memory_advice`). Attributes: `schedule` (the pass), `xla` (XLA's first line)."""

  def __init__(self, message: str, schedule: "Schedule", xla: str):
    super().__init__(message)
    self.schedule, self.xla = schedule, xla


@dataclasses.dataclass(frozen=True)
class Schedule:
  """One pass of the scorer: a group of documents in windows of one shape (`plan_schedules`).

  Attributes:
    documents: indices of its documents in the scored list, in order.
    rows: B of its windows (independent document streams). slots: N, document slots per row.
    cache_length: L, MLA latent entries per slot (the longest document it must hold, rounded up).
    long: True for a long-document pass (one slot per row, L the documents' power-of-two bucket).
    num_windows: windows it ran (0 until scored).
  """

  documents: tuple[int, ...]
  rows: int
  slots: int
  cache_length: int
  long: bool
  num_windows: int = 0


def _next_power_of_two(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


def plan_schedules(lengths: Sequence[int], *, seq_len: int, batch_size: int, num_slots: int,
                   cache_multiple: int = 64, has_mla: bool = True) -> list[Schedule]:
  """The passes that score documents of these token counts.

  Args:
    lengths: tokens per document. seq_len: T. batch_size: B. num_slots: N.
    cache_multiple: cache lengths are rounded up to a multiple of this.
    has_mla: False: the cache does not grow with the document, so every document is packed.

  Returns:
    The packed pass first (if any), then one long pass per cache length, shortest first.
  """
  t, m = int(seq_len), int(cache_multiple)
  live = [i for i, n in enumerate(lengths) if n > 0]
  short = live if not has_mla else [i for i in live if lengths[i] <= PACKED_LIMIT * t]
  out = []
  if short:
    longest = max(lengths[i] for i in short) if has_mla else 1
    out.append(Schedule(tuple(short), int(batch_size), int(num_slots), round_up(longest, m), False))
  buckets: dict[int, list[int]] = {}
  packed = set(short)
  for i in live:
    if i not in packed:
      buckets.setdefault(round_up(_next_power_of_two(lengths[i]), m), []).append(i)
  for length in sorted(buckets):
    docs = buckets[length]
    out.append(Schedule(tuple(docs), min(int(batch_size), len(docs)), 1, length, True))
  return out


@dataclasses.dataclass
class ScoreResult:
  """Log-probabilities per document and the totals.

  Attributes:
    logprobs: per document, float64 `[len(doc) - 1]`: entry t-1 scores token t.
    num_tokens: scored tokens in all. total_logprob: their sum (nats).
    seconds: wall time of the windows. compile_s: compilation and one warm-up window.
    num_windows: windows evaluated (all passes). schedules: the passes run (`Schedule`).
  """

  logprobs: list[np.ndarray]
  num_tokens: int
  total_logprob: float
  seconds: float
  compile_s: float
  num_windows: int
  schedules: list = dataclasses.field(default_factory=list)

  @property
  def perplexity(self) -> float:
    return math.exp(-self.total_logprob / self.num_tokens) if self.num_tokens else float("nan")

  @property
  def tokens_per_s(self) -> float:
    return self.num_tokens / self.seconds if self.seconds > 0 else float("nan")

  def bits_per_byte(self, num_bytes: int) -> float:
    """`-sum(logprob) / ln 2 / num_bytes` (NaN when num_bytes is 0)."""
    return -self.total_logprob / math.log(2) / num_bytes if num_bytes else float("nan")


def _carry(cache, window_continues, window_prev_label, batch: int, num_slots: int):
  """The incoming cache of a window: slot n-1 of row b takes the previous window's slot
  prev_label-1 where `continues`, an empty slot (zeros, length 0) elsewhere."""
  src = jnp.maximum(window_prev_label - 1, 0)                                   # [B, N]

  def move(x):
    x = cache_lib.rows_to_slots(x, batch, num_slots)
    extra = x.ndim - 2
    idx = src.reshape(src.shape + (1,) * extra)
    keep = window_continues.reshape(window_continues.shape + (1,) * extra)
    moved = jnp.take_along_axis(x, idx, axis=1)
    return cache_lib.slots_to_rows(jnp.where(keep, moved, jnp.zeros_like(moved)))

  return jax.tree.map(move, cache)


def _zeros_like(shapes, shardings=None):
  """Fresh zeros per leaf of a tree of shapes (each its own buffer: the cache is donated), placed
  on `shardings` (a matching tree) when given, created sharded rather than copied there."""
  if shardings is None:
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
  return jax.tree.map(lambda x, sh: jax.jit(lambda: jnp.zeros(x.shape, x.dtype), out_shardings=sh)(), shapes,
                      shardings)


class Scorer:
  """Scores documents with a `KimiLinearForCausalLM`.

  Args:
    model: the model (parameters split out once).
    seq_len: T, tokens per window row (`max_target_length`).
    batch_size: B, rows (independent document streams) per window of the packed pass; a long pass
      has min(B, its documents) rows.
    num_slots: N, documents per row of the packed pass (`max_num_segments`).
    pad_id: id on padding.
    cache_multiple: MLA cache lengths are rounded up to this.
    mesh, rules: score with a model sharded on this mesh (`model.partitioning`): window rows and the
      carried cache split over the batch axes, log-probs replicated (every process reads them all).
      None: one device.
    names: what the caller's user calls `seq_len`, `batch_size` and `num_slots` (e.g. a tool's config
      keys), for the out-of-memory advice; default those names.

  Raises:
    ValueError: sizes below 1 (seq_len below 2).
  """

  def __init__(self, model, *, seq_len: int, batch_size: int = 1, num_slots: int = 8, pad_id: int = 0,
               cache_multiple: int = 64, mesh=None, rules=None, names: dict[str, str] | None = None):
    if int(seq_len) < 2:
      raise ValueError(f"max_target_length must be >= 2 (a token and its target), got {seq_len}")
    for name, v in (("batch_size", batch_size), ("num_slots", num_slots), ("cache_multiple", cache_multiple)):
      if int(v) < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")
    self.model = model
    self.seq_len, self.batch_size, self.num_slots = int(seq_len), int(batch_size), int(num_slots)
    self.pad_id, self.cache_multiple = int(pad_id), int(cache_multiple)
    self.mesh, self._rules = mesh, rules
    self.names = {"seq_len": "seq_len", "batch_size": "batch_size", "num_slots": "num_slots", **(names or {})}
    self._graphdef, state = nnx.split(model)
    self._leaves, self._treedef = jax.tree.flatten(state)

  def _window_fn(self, rows: int, slots: int, cache_length: int):
    """`((compiled, input shardings), seconds to compile and warm up)` for windows `[rows, T]` of
    `slots` slots and this cache length (cached).

    The input shardings are `(cache, [B, T] arrays, [B, N] arrays)`: None each off-mesh."""
    key = executables.model_key(self._graphdef, self._treedef, self.mesh, self._rules) + (
        "scorer", self.seq_len, rows, slots, cache_length)
    return executables.get(key, lambda: self._compile(rows, slots, cache_length))

  def _compile(self, rows: int, slots: int, cache_length: int):
    b, n = rows, slots
    graphdef, treedef = self._graphdef, self._treedef  # not self: the cache must not keep parameters alive

    def run(leaves, cache, inputs, targets, loss_mask, segment_ids, continues, prev_label):
      model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
      cache = _carry(cache, continues, prev_label, b, n)
      logits, cache = model.prefill(inputs, segment_ids, cache=cache)
      logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
      lp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
      return jnp.where(loss_mask, lp, 0.0), cache

    cache = self._empty_cache(b, n, cache_length)
    mesh = self.mesh
    if mesh is None:
      shardings = (None, None, None)
      ctx, jit_kw = contextlib.nullcontext(), {}
    else:
      rules = partitioning.as_rules(self._rules)
      cache_sh = cache_lib.shardings(cache, mesh, rules)
      bt_sh = partitioning.batch_sharding(mesh, (b, self.seq_len), rules_or_cfg=rules)
      bn_sh = partitioning.batch_sharding(mesh, (b, n), ("activation_batch", None), rules_or_cfg=rules)
      shardings = (cache_sh, bt_sh, bn_sh)
      ctx = partitioning.mesh_context(mesh, rules)
      # The cache keeps its layout, so one window's output feeds the next.
      jit_kw = dict(in_shardings=(jax.tree.map(lambda x: x.sharding, self._leaves), cache_sh, bt_sh, bt_sh, bt_sh,
                                  bt_sh, bn_sh, bn_sh),
                    out_shardings=(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), cache_sh))
    bt = jax.ShapeDtypeStruct((b, self.seq_len), jnp.int32)
    bn = jax.ShapeDtypeStruct((b, n), jnp.int32)
    with ctx:
      compiled = jax.jit(run, donate_argnums=(1,), **jit_kw).lower(
          self._leaves, cache, bt, bt, jax.ShapeDtypeStruct((b, self.seq_len), jnp.bool_),
          bt, jax.ShapeDtypeStruct((b, n), jnp.bool_), bn).compile()
    # Warm-up on an all-padding window: a fresh executable's first run pays one-time set-up costs.
    zeros = np.zeros((b, self.seq_len), np.int32)
    zn = np.zeros((b, n), np.int32)
    fresh = _zeros_like(cache, shardings[0])
    put = lambda x, sh: jnp.asarray(x) if sh is None else jax.device_put(x, sh)
    jax.block_until_ready(compiled(self._leaves, fresh, put(zeros, shardings[1]), put(zeros, shardings[1]),
                                   put(zeros.astype(bool), shardings[1]), put(zeros, shardings[1]),
                                   put(zn.astype(bool), shardings[2]), put(zn, shardings[2])))
    return compiled, shardings

  def _empty_cache(self, rows: int, slots: int, cache_length: int):
    return jax.eval_shape(lambda: self.model.init_cache(rows, slots, cache_length))

  def schedules(self, docs: Sequence[np.ndarray]) -> list[Schedule]:
    """`plan_schedules` of `docs` with this scorer's T, B, N and cache multiple."""
    return plan_schedules([int(np.size(d)) for d in docs], seq_len=self.seq_len, batch_size=self.batch_size,
                          num_slots=self.num_slots, cache_multiple=self.cache_multiple,
                          has_mla="mla" in self.model.args.layer_types)

  def windows(self, docs: Sequence[np.ndarray], schedule: Schedule) -> list[EvalWindow]:
    """`pack_eval_windows` of the documents of `schedule` (indices into `docs`) in its window shape;
    `doc_index` indexes `schedule.documents`."""
    return pack_eval_windows([docs[i] for i in schedule.documents], self.seq_len, schedule.rows,
                             max_segments=schedule.slots, pad_id=self.pad_id)

  def cache_bytes(self, schedule: Schedule) -> int:
    """Bytes of the carried cache of `schedule` (every layer: KDA states, conv windows, MLA latents)."""
    empty = self._empty_cache(schedule.rows, schedule.slots, schedule.cache_length)
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(empty)))

  def memory_advice(self, schedule: Schedule, lengths: Sequence[int] = ()) -> str:
    """What lowers the memory of `schedule`'s pass, naming only the sizes that do (`self.names`):
    T always, B while the pass has several rows, N for the packed pass; a long pass's cache shrinks
    with no key, so the advice says how large it is."""
    nm = self.names
    keys = [nm["seq_len"]] if self.seq_len > 2 else []
    if schedule.rows > 1:
      keys.append(nm["batch_size"])
    if not schedule.long and schedule.slots > 1:
      keys.append(nm["num_slots"])
    what = (f"windows of {schedule.rows} x {self.seq_len} tokens" +
            (f" with {schedule.slots} documents per row" if not schedule.long else ""))
    advice = ("lower " + (", ".join(keys[:-1]) + " or " + keys[-1] if len(keys) > 1 else keys[0])) if keys else ""
    if schedule.long:
      docs = schedule.documents
      who = f"document {docs[0]}" if len(docs) == 1 else f"{len(docs)} documents"
      if len(lengths):
        longest = max(int(lengths[i]) for i in docs)
        who += f" ({longest} tokens)" if len(docs) == 1 else f" (the longest {longest} tokens)"
      note = (f"{what}; the cache of {who}, {schedule.rows} x {schedule.cache_length} MLA entries per layer "
              f"({self.cache_bytes(schedule) / 2**20:.1f} MiB in all), shrinks with no key")
    else:
      note = f"{what}, an MLA cache of {schedule.rows} x {schedule.slots} x {schedule.cache_length} entries per layer"
    return f"{advice} ({note})" if advice else note

  def score(self, docs: Sequence[Sequence[int]], *, progress: Callable | None = None) -> ScoreResult:
    """Log-probabilities of every document token after the first.

    Args:
      docs: token-id documents (1-D integer sequences, already framed with bos/eos as wanted).
      progress: optional `fn(iterable, total) -> iterable` wrapping the window loop (e.g. tqdm).

    Returns:
      `ScoreResult` (its `schedules` say how each pass was sized).

    Raises:
      ScoringError: token ids outside the model's vocabulary. ScoringOutOfMemory: XLA ran out of
      memory in a pass (the message says what lowers that pass's memory). ValueError: malformed
      documents.
    """
    docs = [np.asarray(d, np.int64).reshape(-1) for d in docs]
    vocab = self.model.args.vocab_size
    for i, d in enumerate(docs):
      if d.size and (d.min() < 0 or d.max() >= vocab):
        bad = d[(d < 0) | (d >= vocab)]
        raise ScoringError(f"document {i} holds token ids outside the vocabulary [0, {vocab}): {bad[:8].tolist()}")
    lengths = [int(d.size) for d in docs]
    passes = [(sch, self.windows(docs, sch)) for sch in self.schedules(docs)]
    sizes = np.array([max(n - 1, 0) for n in lengths], np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    flat = np.zeros(int(starts[-1]), np.float64)   # every document's scores, end to end
    num_windows = sum(len(ws) for _, ws in passes)

    def work():
      for k, (_, ws) in enumerate(passes):
        for w in ws:
          yield k, w

    it = work() if progress is None else progress(work(), num_windows)
    put = lambda x, sh: x if sh is None else jax.device_put(x, sh)
    total, count, compile_s = 0.0, 0, 0.0
    current, fn, cache = None, None, None
    t0 = time.perf_counter()
    for k, w in it:
      sch = passes[k][0]
      try:
        if k != current:  # a new pass: its compiled window and a fresh cache
          cache = None    # the previous pass's cache is freed before the next one is made
          (fn, (cache_sh, bt_sh, bn_sh)), c_s = self._window_fn(sch.rows, sch.slots, sch.cache_length)
          compile_s += c_s
          cache = _zeros_like(self._empty_cache(sch.rows, sch.slots, sch.cache_length), cache_sh)
          current = k
        lp, cache = fn(self._leaves, cache, put(w.inputs, bt_sh), put(w.targets, bt_sh), put(w.loss_mask, bt_sh),
                       put(w.segment_ids, bt_sh), put(w.continues, bn_sh), put(w.prev_label, bn_sh))
        lp = np.asarray(lp, np.float64)
      except Exception as e:
        xla = out_of_memory(e)
        if xla is None:
          raise
        raise ScoringOutOfMemory(out_of_memory_message(e, self.memory_advice(sch, lengths)), sch, xla) from e
      rows, cols = np.nonzero(w.loss_mask)
      slot = w.segment_ids[rows, cols] - 1
      doc = np.asarray(sch.documents, np.int64)[w.doc_index[rows, slot]]
      pos = w.positions[rows, cols]            # offset of the input token; it predicts token pos + 1
      flat[starts[doc] + pos] = lp[rows, cols]
      total += float(lp[rows, cols].sum())
      count += rows.size
    cache = None
    seconds = time.perf_counter() - t0 - compile_s
    out = [flat[starts[i]:starts[i + 1]] for i in range(len(docs))]
    done = [dataclasses.replace(sch, num_windows=len(ws)) for sch, ws in passes]
    return ScoreResult(out, count, total, seconds, compile_s, num_windows, done)
