"""Per-token log-probabilities of whole documents with the Kimi-Linear host (the perplexity engine).

Documents are packed into evaluation windows `[B, T]` by `model.data.pipeline.pack_eval_windows`
(segment IDs keep packed documents apart). A document longer than the window, or cut at a window's
end, is never truncated: its piece in the next window continues from the state the previous window
left, through the model's cache-accepting prefill (`KimiLinearForCausalLM.prefill(cache=...)`): the
KDA state and short-conv windows of its slot and, for MLA layers, the latents of all its earlier
tokens (the MLA cache of each slot therefore holds up to the longest document). Which slot of the
previous window feeds which slot of the next is `EvalWindow.continues / prev_label`; the carry runs
inside the same compiled function as the window, one compilation for every window.

For token t of a document (t >= 1) the score is `log p(doc[t] | doc[:t])`, computed in float32 as
`log_softmax(logits)[target]`. Perplexity = `exp(-sum(logprob) / count)`; bits per byte =
`-sum(logprob) / ln 2 / bytes` (bytes of the documents' UTF-8 text, for text corpora).
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

from model.errors import UserError
from model.nn import cache as cache_lib
from model import partitioning
from model.data.pipeline import EvalWindow, pack_eval_windows
from model.engine.serving import round_up


# Compiled window functions per (graphdef, treedef, T, B, N, cache length, mesh, rules), shared by
# every Scorer in the process.
_COMPILED: dict = {}


class ScoringError(UserError):
  """Documents the model cannot score (token ids outside its vocabulary)."""


@dataclasses.dataclass
class ScoreResult:
  """Log-probabilities per document and the totals.

  Attributes:
    logprobs: per document, float64 `[len(doc) - 1]`: entry t-1 scores token t (empty for documents
      of fewer than 2 tokens).
    num_tokens: scored tokens in all. total_logprob: their sum (nats).
    seconds: wall time of the windows (compilation excluded). compile_s: compilation and one warm-up
      window.
    num_windows: windows evaluated.
  """

  logprobs: list[np.ndarray]
  num_tokens: int
  total_logprob: float
  seconds: float
  compile_s: float
  num_windows: int

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
    batch_size: B, rows (independent document streams) per window.
    num_slots: N, documents per row (`max_num_segments`).
    pad_id: id on padding.
    cache_multiple: the MLA cache length (longest document) is rounded up to this.
    mesh, rules: score with a model sharded on this `jax.sharding.Mesh` (`model.partitioning`; rules: a
      config or parsed `logical_axis_rules`, default the base rules): the window is traced in
      `partitioning.mesh_context`, window rows and the carried cache are split over the batch axes
      (`batch_sharding`, `cache_shardings`; a dimension they do not divide stays replicated), and
      the per-token log-probs come back replicated, so every process of a multi-host job reads
      them all. None: one device (the model's own).

  Raises:
    ValueError: sizes below 1 (seq_len below 2).
  """

  def __init__(self, model, *, seq_len: int, batch_size: int = 1, num_slots: int = 8, pad_id: int = 0,
               cache_multiple: int = 64, mesh=None, rules=None):
    if int(seq_len) < 2:
      raise ValueError(f"max_target_length must be >= 2 (a token and its target), got {seq_len}")
    for name, v in (("batch_size", batch_size), ("num_slots", num_slots), ("cache_multiple", cache_multiple)):
      if int(v) < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")
    self.model = model
    self.seq_len, self.batch_size, self.num_slots = int(seq_len), int(batch_size), int(num_slots)
    self.pad_id, self.cache_multiple = int(pad_id), int(cache_multiple)
    self.mesh, self._rules = mesh, rules
    self._graphdef, state = nnx.split(model)
    self._leaves, self._treedef = jax.tree.flatten(state)

  def _window_fn(self, cache_length: int):
    """`((compiled, input shardings), seconds to compile and warm up)` for this cache length (cached).

    The input shardings are `(cache, [B, T] arrays, [B, N] arrays)`: None each off-mesh."""
    rules_key = None if self._rules is None else repr(partitioning.as_rules(self._rules))
    key = (self._graphdef, self._treedef, self.seq_len, self.batch_size, self.num_slots, cache_length, self.mesh,
           rules_key)
    if key in _COMPILED:
      return _COMPILED[key], 0.0
    b, n = self.batch_size, self.num_slots
    graphdef, treedef = self._graphdef, self._treedef  # not self: the cache must not keep parameters alive

    def run(leaves, cache, inputs, targets, loss_mask, segment_ids, continues, prev_label):
      model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
      cache = _carry(cache, continues, prev_label, b, n)
      logits, cache = model.prefill(inputs, segment_ids, cache=cache)
      logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
      lp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
      return jnp.where(loss_mask, lp, 0.0), cache

    cache = jax.eval_shape(lambda: self.model.init_cache(b, n, cache_length))
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
      # Log-probs replicated (a [B, T] float32: cheap), so that every process can read all of them;
      # the cache keeps the layout it came in with, so one window's output feeds the next.
      jit_kw = dict(in_shardings=(jax.tree.map(lambda x: x.sharding, self._leaves), cache_sh, bt_sh, bt_sh, bt_sh,
                                  bt_sh, bn_sh, bn_sh),
                    out_shardings=(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), cache_sh))
    bt = jax.ShapeDtypeStruct((b, self.seq_len), jnp.int32)
    bn = jax.ShapeDtypeStruct((b, n), jnp.int32)
    t0 = time.perf_counter()
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
    _COMPILED[key] = (compiled, shardings)
    return _COMPILED[key], time.perf_counter() - t0

  def windows(self, docs: Sequence[np.ndarray]) -> list[EvalWindow]:
    """`pack_eval_windows` of `docs` with this scorer's T, B and N."""
    return pack_eval_windows(docs, self.seq_len, self.batch_size, max_segments=self.num_slots,
                             pad_id=self.pad_id)

  def score(self, docs: Sequence[Sequence[int]], *, progress: Callable | None = None) -> ScoreResult:
    """Log-probabilities of every document token after the first.

    Args:
      docs: token-id documents (1-D integer sequences, already framed with bos/eos as wanted).
      progress: optional `fn(iterable, total) -> iterable` wrapping the window loop (e.g. tqdm).

    Returns:
      `ScoreResult`.

    Raises:
      ScoringError: token ids outside the model's vocabulary. ValueError: malformed documents.
    """
    docs = [np.asarray(d, np.int64).reshape(-1) for d in docs]
    vocab = self.model.args.vocab_size
    for i, d in enumerate(docs):
      if d.size and (d.min() < 0 or d.max() >= vocab):
        bad = d[(d < 0) | (d >= vocab)]
        raise ScoringError(f"document {i} holds token ids outside the vocabulary [0, {vocab}): {bad[:8].tolist()}")
    windows = self.windows(docs)
    longest = max((d.size for d in docs), default=1)
    length = round_up(longest, self.cache_multiple)
    (fn, (cache_sh, bt_sh, bn_sh)), compile_s = self._window_fn(length)
    empty = jax.eval_shape(lambda: self.model.init_cache(self.batch_size, self.num_slots, length))
    cache = _zeros_like(empty, cache_sh)
    put = lambda x, sh: x if sh is None else jax.device_put(x, sh)
    sizes = np.array([max(d.size - 1, 0) for d in docs], np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    flat = np.zeros(int(starts[-1]), np.float64)   # every document's scores, end to end
    it = windows if progress is None else progress(windows, len(windows))
    t0 = time.perf_counter()
    total, count = 0.0, 0
    for w in it:
      lp, cache = fn(self._leaves, cache, put(w.inputs, bt_sh), put(w.targets, bt_sh), put(w.loss_mask, bt_sh),
                     put(w.segment_ids, bt_sh), put(w.continues, bn_sh), put(w.prev_label, bn_sh))
      lp = np.asarray(lp, np.float64)
      rows, cols = np.nonzero(w.loss_mask)
      slot = w.segment_ids[rows, cols] - 1
      doc = w.doc_index[rows, slot]
      pos = w.positions[rows, cols]            # offset of the input token; it predicts token pos + 1
      flat[starts[doc] + pos] = lp[rows, cols]
      total += float(lp[rows, cols].sum())
      count += rows.size
    seconds = time.perf_counter() - t0
    out = [flat[starts[i]:starts[i + 1]] for i in range(len(docs))]
    return ScoreResult(out, count, total, seconds, compile_s, len(windows))
