"""Kimi-Linear causal LM in Flax NNX, configured by `configs/` and served by a registered attention
backend (see `model/README.md` for the API, the cache layout and the parameter-name table).

Structure (transformers `models/kimi_linear`, Moonshot `modeling_kimi.py`; docs/kda.md section
'Layer', docs/checkpoints.md section 'Parameter names'): token embedding; per layer `x += mixer(input_layernorm(x))` with the KDA mixer for
`kda_layers` and MLA for `full_attn_layers` (1-indexed); `x += ffn(post_attention_layernorm(x))`
with a dense SwiGLU (`mlp`) for the first `first_k_dense_replace` layers and MoE
(`block_sparse_moe`) after; final RMSNorm `model.norm`; untied `lm_head`.
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.nn import cache as cache_lib
from model import registry
from model import partitioning
from model.config import ModelArgs
from model.nn.kda import KimiDeltaAttention
from model.nn.layers import RMSNorm, SwiGLU, as_dtype, linear, normal_init
from model.nn.mla import MultiHeadLatentAttention
from model.nn.moe import SparseMoeBlock
from model.nn import scan as scan_lib

MODES = ("train", "eval")
LOGITS_AT = ("all", "last")  # `prefill(logits_at=...)`: every token's logits, or each document's last


class Mixer(Protocol):
  """The one interface of a decoder layer's sequence mixer (`KimiDeltaAttention`, `MultiHeadLatentAttention`).

  Each mixer owns its cache (its layer cache type in model/nn/cache.py) and its update; the layer
  never looks inside it.
  """

  def __call__(self, x, *, segment_ids, mode, num_slots, cache=None, lengths=None, return_cache=False,
               cache_length=None):
    """`x [B, T, d]` -> `(y [B, T, d], layer cache in decode layout | None)`; `cache`: the incoming
    layer cache (S = B*N sequences, `lengths [S]` tokens so far), `cache_length`: L of a new one."""
    ...

  def decode(self, x, cache, lengths):
    """`x [S, d]`, one token per sequence -> `(y [S, d], new layer cache)`."""
    ...

  def empty_cache(self, num_sequences: int, cache_length: int):
    """The layer cache of `num_sequences` fresh sequences."""
    ...


class DecoderLayer(nnx.Module):
  """One pre-norm block: `input_layernorm`, `self_attn` (a `Mixer`: KDA or MLA),
  `post_attention_layernorm`, then `mlp` (dense SwiGLU) or `block_sparse_moe`."""

  def __init__(self, args: ModelArgs, index: int, backend, rngs: nnx.Rngs):
    dt, wdt = as_dtype(args.dtype), as_dtype(args.weight_dtype)
    self.kind = args.layer_types[index]
    self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps, param_dtype=wdt, dtype=dt)
    self.self_attn: Mixer = (KimiDeltaAttention(args, backend, rngs=rngs) if self.kind == "kda" else
                             MultiHeadLatentAttention(args, rngs=rngs))
    self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps, param_dtype=wdt, dtype=dt)
    self.is_moe = index >= args.first_k_dense_replace
    if self.is_moe:
      self.block_sparse_moe = SparseMoeBlock(args, rngs)
    else:
      self.mlp = SwiGLU(args.hidden_size, args.intermediate_size, args, rngs)

  def _ffn(self, x):
    h = self.post_attention_layernorm(x)
    return x + (self.block_sparse_moe(h) if self.is_moe else self.mlp(h))

  def __call__(self, x, *, segment_ids, mode, num_slots, cache=None, lengths=None, return_cache=False,
               cache_length=None):
    """x `[B, T, d]` -> `(x, layer cache in decode layout | None)`. Traced outside training, runs as
    the layer-kind program `_shared_forward` (see `_shares_trace`); `forward` is the same computation
    in place."""
    kw = dict(mode=mode, num_slots=int(num_slots), return_cache=bool(return_cache),
              cache_length=None if cache_length is None else int(cache_length))
    if not _shares_trace(self, mode, x):
      return self.forward(x, segment_ids=segment_ids, cache=cache, lengths=lengths, **kw)
    graphdef, state = nnx.split(self)
    return _shared_forward(graphdef, state, x, segment_ids, cache, lengths, rules=partitioning.current_rules(), **kw)

  def forward(self, x, *, segment_ids, mode, num_slots, cache=None, lengths=None, return_cache=False,
              cache_length=None):
    """`__call__`'s computation, traced in place."""
    y, new = self.self_attn(self.input_layernorm(x), segment_ids=segment_ids, mode=mode, num_slots=num_slots,
                            cache=cache, lengths=lengths, return_cache=return_cache, cache_length=cache_length)
    return self._ffn(x + y), new

  def decode(self, x, cache, lengths):
    """x `[S, d]` one token per sequence -> `(x, new layer cache)`, as the layer-kind program
    `_shared_decode` (see `_shares_trace`)."""
    if not _shares_trace(self, "decode", x):
      return self.decode_step(x, cache, lengths)
    graphdef, state = nnx.split(self)
    return _shared_decode(graphdef, state, x, cache, lengths, rules=partitioning.current_rules())

  def decode_step(self, x, cache, lengths):
    """`decode`'s computation, traced in place."""
    y, new = self.self_attn.decode(self.input_layernorm(x), cache, lengths)
    return self._ffn(x + y), new


# Layer-kind programs. An unrolled 27-layer model traced each layer anew in every program (and, on a
# TPU, lowered its Pallas kernels anew): an engine's cold start traced and lowered 11 step programs
# of 27 layers each. As an inner `jax.jit` keyed by the layer's nnx graphdef (equal for layers of one
# structure: mixer kind and FFN kind) and its state's shapes, the layers of one kind share one trace
# and one lowered function per program, called once per layer (tests/model/test_layer_programs.py).
# XLA inlines the calls, so the compiled program, its numerics and its memory are unchanged. The
# logical-axis rules are read at trace time, so they are a static argument (part of the cache key).
_FORWARD_STATIC = ("mode", "num_slots", "return_cache", "cache_length", "rules")


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=_FORWARD_STATIC)
def _shared_forward(graphdef, state, x, segment_ids, cache, lengths, *, mode, num_slots, return_cache,
                    cache_length, rules):
  with nnx.logical_axis_rules(rules):
    return nnx.merge(graphdef, state).forward(x, segment_ids=segment_ids, mode=mode, num_slots=num_slots,
                                              cache=cache, lengths=lengths, return_cache=return_cache,
                                              cache_length=cache_length)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("rules",))
def _shared_decode(graphdef, state, x, cache, lengths, *, rules):
  with nnx.logical_axis_rules(rules):
    return nnx.merge(graphdef, state).decode_step(x, cache, lengths)


def _shares_trace(layer: DecoderLayer, mode: str, x) -> bool:
  """Whether `layer`'s forward on `x` runs as its kind's shared program: only while traced (an eager
  call runs op by op, as before, with the concrete-value checks inside the layer, and compiling a
  program per layer kind would only slow it), not in training, where remat and gradients trace the
  module itself, and not while a MoE block records its routing (`sow` on the module, which a merged
  copy would drop)."""
  if mode == "train" or not isinstance(x, jax.core.Tracer):
    return False
  return not (layer.is_moe and layer.block_sparse_moe.record_routing)


class KimiLinearModel(nnx.Module):
  """HF `model.`: `embed_tokens`, `layers` (list of `DecoderLayer`), `norm`."""

  def __init__(self, args: ModelArgs, backend, rngs: nnx.Rngs):
    dt, wdt = as_dtype(args.dtype), as_dtype(args.weight_dtype)
    self.embed_tokens = nnx.Embed(args.vocab_size, args.hidden_size, dtype=dt, param_dtype=wdt,
                                  embedding_init=normal_init(args.initializer_range, ("vocab", "embed")),
                                  rngs=rngs)
    self.layers = nnx.List([DecoderLayer(args, i, backend, rngs) for i in range(args.num_hidden_layers)])
    self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps, param_dtype=wdt, dtype=dt)


class KimiLinearForCausalLM(nnx.Module):
  """The Kimi-Linear causal LM (see `model/README.md`).

  Args:
    config: an `ml_collections.ConfigDict` from `model.config.load_config` (validated here).
    rngs: `nnx.Rngs` for the random initialisation; default `nnx.Rngs(config.init_seed)`.

  Raises:
    model.config.ConfigError: an invalid config.
    model.registry.UnknownBackendError: `config.attention` names no registered backend.

  Attributes:
    args: the static `ModelArgs`. backend: the attention backend object.
    model: `KimiLinearModel`. lm_head: `nnx.Linear` (`kernel [d, vocab]`).
  """

  def __init__(self, config, *, rngs: nnx.Rngs | None = None):
    args = config if isinstance(config, ModelArgs) else ModelArgs.from_config(config)
    self.args = args
    self.backend = registry.get_backend(args.attention)
    if rngs is None:
      rngs = nnx.Rngs(int(getattr(config, "init_seed", 0)))
    # Logical-axis metadata is recorded on every parameter; it shards eagerly only inside a mesh.
    with nnx.use_eager_sharding(False):
      self.model = KimiLinearModel(args, self.backend, rngs)
      self.lm_head = linear(args.hidden_size, args.vocab_size, ("embed", "vocab"), args, rngs)

  # --- helpers -----------------------------------------------------------------------------------
  def _check_inputs(self, input_ids, segment_ids, positions):
    input_ids = jnp.asarray(input_ids)
    if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
      raise ValueError(f"input_ids must be an integer array [B, T], got {input_ids.dtype} {input_ids.shape}")
    if segment_ids is None:
      segment_ids = jnp.ones(input_ids.shape, jnp.int32)
    segment_ids = jnp.asarray(segment_ids)
    if segment_ids.shape != input_ids.shape or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"segment_ids must be an integer array of input_ids' shape {input_ids.shape}, "
                       f"got {segment_ids.dtype} {segment_ids.shape}")
    if positions is not None and tuple(np.shape(positions)) != input_ids.shape:
      raise ValueError(f"positions must have input_ids' shape {input_ids.shape}, got {np.shape(positions)}")
    return input_ids, segment_ids.astype(jnp.int32)

  @staticmethod
  def _check_labels(segment_ids, num_slots):
    if not isinstance(segment_ids, jax.core.Tracer):
      top = int(np.max(np.asarray(segment_ids))) if segment_ids.size else 0  # numpy: no tracing under jit
      if top > num_slots:
        raise ValueError(f"segment_ids holds label {top} but only {num_slots} document slots per row are "
                         f"configured (max_num_segments / num_slots); raise it")

  def scan_plan(self):
    """`scan_lib.scan_plan` of this model's layers when `scan_layers` is on, else None (unrolled)."""
    a = self.args
    if not a.scan_layers:
      return None
    return scan_lib.scan_plan([(t, i >= a.first_k_dense_replace) for i, t in enumerate(a.layer_types)])

  def _run(self, input_ids, segment_ids, mode, num_slots, cache=None, return_cache=False, cache_length=None,
           logits_at: str = "all"):
    # Logical activation axes (no-ops outside a mesh; see model/partitioning.py).
    x = partitioning.constrain(self.model.embed_tokens(input_ids), partitioning.HIDDEN)
    lengths = None if cache is None else cache.lengths
    caches = [None] * len(self.model.layers) if cache is None else list(cache.layers)

    def step(layer, x, c):
      return layer(x, segment_ids=segment_ids, mode=mode, num_slots=num_slots, cache=c, lengths=lengths,
                   return_cache=return_cache, cache_length=cache_length)

    x, new_layers = scan_lib.run_layers(list(self.model.layers), x, caches, step,
                                        lambda h: layer_boundary(h, partitioning.HIDDEN),
                                        plan=self.scan_plan(), remat_policy=self.args.remat_policy,
                                        train=mode == "train")
    if logits_at == "last":
      return self.last_logits(x, segment_ids, num_slots), new_layers
    if logits_at == "hidden":  # the LM head's input: the caller applies `head` (blocked training loss)
      return self.model.norm(x), new_layers
    return self.head(self.model.norm(x)), new_layers

  def head(self, hidden):
    """The LM head on final-normed hidden states: `[..., T, d]` -> logits `[..., T, vocab]` in the
    compute dtype (constrained to the logits' logical axes when `hidden` is `[B, T, d]`)."""
    logits = self.lm_head(hidden)
    return partitioning.constrain(logits, partitioning.LOGITS) if logits.ndim == 3 else logits

  def final_hidden(self, input_ids, segment_ids=None, positions=None, *, mode: str = "train",
                   max_num_segments: int | None = None):
    """The forward of `__call__` up to the LM head: `model.norm` of the last layer's output,
    `[B, T, d]` in the compute dtype, so that `head(final_hidden(...)) == __call__(...)`.

    The training loss applies `head` a block of tokens at a time (`model.training.steps.blocked_nll`)
    so that no `[B, T, vocab]` logits (and no float32 log-softmax of them, or its gradient) are held
    whole. Arguments and errors as `__call__`.
    """
    if mode not in MODES:
      raise ValueError(f"mode must be one of {MODES} (use prefill()/decode() for cached inference), got {mode!r}")
    n = max_num_segments or (1 if segment_ids is None else self.args.max_num_segments)
    input_ids, segment_ids = self._check_inputs(input_ids, segment_ids, positions)
    self._check_labels(segment_ids, n)
    hidden, _ = self._run(input_ids, segment_ids, mode, n, logits_at="hidden")
    return hidden

  def last_logits(self, hidden, segment_ids, num_slots: int):
    """The LM head at each document's last token only: `[B * N, vocab]` in decode layout (zeros for
    empty slots), equal to `last_token_logits(lm_head(norm(hidden)), segment_ids, num_slots)`.

    Args:
      hidden: `[B, T, d]`, the last decoder layer's output (before the final norm).
      segment_ids: int32 `[B, T]`. num_slots: N.

    The head runs on B*N rows instead of B*T: a prompt's [T, vocab] logits (8192 x 163840 bf16 is
    2.5 GiB) are never formed when only the next token is sampled.
    """
    b, _, d = hidden.shape
    last, present = last_token_index(segment_ids, num_slots)                              # [B, N]
    h = jnp.take_along_axis(hidden, last[..., None], axis=1).reshape(b * num_slots, d)
    h = partitioning.constrain(h, partitioning.DECODE_HIDDEN)
    logits = partitioning.constrain(self.lm_head(self.model.norm(h)), partitioning.DECODE_LOGITS)
    return jnp.where(present.reshape(-1, 1), logits, jnp.zeros((), logits.dtype))

  # --- public API --------------------------------------------------------------------------------
  def __call__(self, input_ids, segment_ids=None, positions=None, *, mode: str = "train",
               max_num_segments: int | None = None):
    """Forward over packed rows (training or evaluation).

    Args:
      input_ids: int32 `[B, T]`.
      segment_ids: int32 `[B, T]`; 0 = padding, labels 1..N name documents (contiguous runs); no
        attention, conv window or KDA state crosses a boundary. None: one document per row.
      positions: int32 `[B, T]` or None; accepted for MaxText-style pipelines and checked for shape,
        but unused: Kimi-Linear has no positional encoding (order comes from the token index).
      mode: "train" (the backend's differentiable op) or "eval" (its inference op).
      max_num_segments: N, the static number of document slots per row; default
        `config.max_num_segments` (1 when segment_ids is None).

    Returns:
      logits `[B, T, vocab]` in the compute dtype (values at padding positions are meaningless).

    Raises:
      ValueError: bad mode, shapes, or (when concrete) a label above N.
    """
    if mode not in MODES:
      raise ValueError(f"mode must be one of {MODES} (use prefill()/decode() for cached inference), got {mode!r}")
    n = max_num_segments or (1 if segment_ids is None else self.args.max_num_segments)
    input_ids, segment_ids = self._check_inputs(input_ids, segment_ids, positions)
    self._check_labels(segment_ids, n)
    logits, _ = self._run(input_ids, segment_ids, mode, n)
    return logits

  def init_cache(self, batch: int, num_slots: int | None = None, cache_length: int | None = None):
    """An empty `ModelCache` for `batch` rows of `num_slots` slots (S = batch * num_slots sequences)."""
    a = self.args
    n = num_slots or a.max_num_segments
    length = cache_length or a.max_cache_length
    s = batch * n
    layers = tuple(layer.self_attn.empty_cache(s, length) for layer in self.model.layers)
    return cache_lib.ModelCache(layers, jnp.zeros((s,), jnp.int32))

  def prefill(self, input_ids, segment_ids=None, positions=None, *, cache=None, num_slots: int | None = None,
              cache_length: int | None = None, logits_at: str = "all"):
    """Forward over packed prompts that also returns the caches, in decode layout.

    Row b's document with label n becomes decode sequence `s = b * num_slots + n - 1`.

    Args:
      input_ids, segment_ids, positions: as `__call__` (segment_ids None: one document per row).
      cache: optional incoming `ModelCache` with S = B * num_slots (e.g. from an earlier window of
        the same documents, or `init_cache`): each document continues its slot's KDA state, conv
        windows and MLA latent prefix (`cache.lengths` tokens).
      num_slots: N; default from `cache`, else `config.max_num_segments` (1 without segment_ids).
      cache_length: L of the MLA latent cache; default from `cache`, else `config.max_cache_length`.
      logits_at: "all" (the logits of every token, `[B, T, vocab]`) or "last" (only each document's
        last token, `[B * N, vocab]` in decode layout, zeros for empty slots: what sampling the next
        token needs; the LM head runs on B*N rows, see `last_logits`).

    Returns:
      `(logits, ModelCache)`: logits as `logits_at` says; `lengths[s]` = incoming length + the
      document's tokens.

    Raises:
      ValueError: shapes, an unknown `logits_at`, or (when concrete) a label above N or more tokens
        than L for a slot.
    """
    if logits_at not in LOGITS_AT:
      raise ValueError(f"logits_at must be one of {LOGITS_AT}, got {logits_at!r}")
    input_ids, segment_ids_ = self._check_inputs(input_ids, segment_ids, positions)
    b = input_ids.shape[0]
    if cache is not None:
      if cache.num_sequences % b:
        raise ValueError(f"cache holds {cache.num_sequences} sequences, not a multiple of the batch {b}")
      n_cache = cache.num_sequences // b
      if num_slots not in (None, n_cache):
        raise ValueError(f"num_slots={num_slots} disagrees with the cache ({n_cache} slots per row)")
      num_slots = n_cache
      cache_length = cache.cache_length or cache_length
    n = num_slots or (1 if segment_ids is None else self.args.max_num_segments)
    length = cache_length or self.args.max_cache_length
    self._check_labels(segment_ids_, n)
    lengths_in = jnp.zeros((b * n,), jnp.int32) if cache is None else cache.lengths
    counts = jnp.sum(segment_ids_[:, None, :] == jnp.arange(1, n + 1)[None, :, None], axis=-1)  # [B, N]
    lengths = lengths_in + counts.reshape(-1).astype(jnp.int32)
    if not isinstance(lengths, jax.core.Tracer) and "mla" in self.args.layer_types:
      if int(jnp.max(lengths)) > length:
        raise ValueError(f"a document needs {int(jnp.max(lengths))} MLA cache entries but cache_length is {length}")
    logits, layers = self._run(input_ids, segment_ids_, "prefill", n, cache=cache, return_cache=True,
                               cache_length=length, logits_at=logits_at)
    return logits, cache_lib.ModelCache(tuple(layers), lengths)

  def decode(self, input_ids, cache):
    """One token per decode sequence.

    Args:
      input_ids: int32 `[S]` or `[S, 1]`, the next token of each sequence.
      cache: the `ModelCache` from `prefill`, `init_cache` or a previous `decode` (required).

    Returns:
      `(logits [S, vocab] (or [S, 1, vocab]), new ModelCache)` with every length advanced by one.

    Raises:
      ValueError: no cache, mismatched S, or (when concrete) a full MLA cache.
    """
    if cache is None:
      raise ValueError("decode needs a cache: pass the ModelCache returned by prefill() (or init_cache() "
                       "for empty sequences); there is no cache-free decode")
    if not isinstance(cache, cache_lib.ModelCache):
      raise TypeError(f"cache must be a model.nn.cache.ModelCache, got {type(cache).__name__}")
    ids = jnp.asarray(input_ids)
    with_time = ids.ndim == 2
    if with_time:
      if ids.shape[1] != 1:
        raise ValueError(f"decode takes one token per sequence, got input_ids {ids.shape}")
      ids = ids[:, 0]
    if ids.ndim != 1 or ids.shape[0] != cache.num_sequences:
      raise ValueError(f"input_ids must be [S] or [S, 1] with S={cache.num_sequences} (the cache's sequences), "
                       f"got {jnp.shape(input_ids)}")
    length = cache.cache_length
    if length is not None and not isinstance(cache.lengths, jax.core.Tracer):
      if int(np.max(np.asarray(cache.lengths))) >= length:
        raise ValueError(f"the MLA cache is full (cache_length={length}); prefill with a larger cache_length")
    x = partitioning.constrain(self.model.embed_tokens(ids), partitioning.DECODE_HIDDEN)
    x, layers = scan_lib.run_layers(list(self.model.layers), x, list(cache.layers),
                                    lambda layer, h, c: layer.decode(h, c, cache.lengths),
                                    lambda h: layer_boundary(h, partitioning.DECODE_HIDDEN),
                                    plan=self.scan_plan(), remat_policy="none", train=False)
    logits = partitioning.constrain(self.lm_head(self.model.norm(x)), partitioning.DECODE_LOGITS)
    return (logits[:, None] if with_time else logits), cache_lib.ModelCache(tuple(layers), cache.lengths + 1)


def layer_boundary(h, axes):
  """The residual stream between two decoder layers: constrained to its logical `axes` and
  materialised there in its dtype (`jax.lax.optimization_barrier`).

  Without the barrier XLA (TPU and CPU) carries a bf16 residual chain in float32 (excess precision):
  the last hidden state becomes one float32 sum of every layer's `[B, T, d]` contribution, each kept
  alive until the final norm (33 x 36 MiB in the 48B shard's 8192-token prefill: 1.2 GiB of
  temporaries, docs/performance.md), and the rounding then differs between programs (a training
  step, an evaluation, a prefill) that fuse differently. With it every mode rounds the residual to
  the compute dtype once per layer, as the model is written. A no-op on values in float32.
  """
  return jax.lax.optimization_barrier(partitioning.constrain(h, axes))


def last_token_index(segment_ids, num_slots: int):
  """`(last int32 [B, N], present bool [B, N])`: the index of each slot's last token in its row (0 for
  an empty slot) and whether the slot holds any token (label n is slot n - 1)."""
  seg = jnp.asarray(segment_ids, jnp.int32)
  t = seg.shape[1]
  is_lab = seg[:, None, :] == jnp.arange(1, num_slots + 1)[None, :, None]             # [B, N, T]
  last = jnp.max(jnp.where(is_lab, jnp.arange(t), -1), axis=-1)                       # [B, N]
  return jnp.clip(last, 0, t - 1).astype(jnp.int32), last >= 0


def last_token_logits(logits, segment_ids, num_slots: int):
  """Logits of each document's last token, in decode layout `[B * N, vocab]` (zeros for empty slots).

  Use after `prefill(logits_at="all")`; `prefill(logits_at="last")` returns the same without forming
  the other tokens' logits.
  """
  b, t, v = logits.shape
  last, present = last_token_index(segment_ids, num_slots)
  out = jnp.take_along_axis(logits, last[..., None], axis=1)                          # [B, N, V]
  return jnp.where(present[..., None], out, 0).reshape(b * num_slots, v)
