"""Decode caches of the Kimi-Linear host, in decode layout.

A prefill over packed rows `[B, T]` with N document slots per row yields S = B * N decode sequences:
sequence `s = b * N + (label - 1)` continues document `label` of row `b` (an absent label is an
empty sequence). Every array is indexed by s first.

- `KDALayerCache` (a KDA layer): `state` float32 `[S, H, K, V]` (key-major), and the last W-1
  inputs of each short conv, oldest first, float32 `[S, W-1, H*K]` (`conv_q`, `conv_k`, `conv_v`).
- `MLALayerCache` (an MLA layer): `latent` `[S, L, latent_width]` in the compute dtype: per token the
  kv_a_layernorm-ed latent, the shared key part, then zero columns up to a multiple of 128 when
  kv_lora_rank + qk_rope_head_dim is wider than 128 (`MultiHeadLatentAttention.latent_width`); slots
  at index >= `lengths[s]` are unused.
- `ModelCache`: `layers` (one cache per decoder layer, in order) and `lengths` int32 `[S]`, the
  tokens seen so far by each sequence (the MLA write index; equal for every layer).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from model import partitioning


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KDALayerCache:
  state: jax.Array
  conv_q: jax.Array
  conv_k: jax.Array
  conv_v: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MLALayerCache:
  latent: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelCache:
  layers: tuple
  lengths: jax.Array

  @property
  def num_sequences(self) -> int:
    """S, the number of decode sequences."""
    return int(self.lengths.shape[0])

  @property
  def cache_length(self) -> int | None:
    """L of the MLA latent cache, its token slots (`mla_rows` of the length asked for; None for a
    model without MLA layers)."""
    for c in self.layers:
      if isinstance(c, MLALayerCache):
        return int(c.latent.shape[1])
    return None


def rows_to_slots(x, batch: int, num_slots: int):
  """`[B * N, ...]` (decode layout) -> `[B, N, ...]` (per-row slots)."""
  return x.reshape((batch, num_slots) + x.shape[1:])


def slots_to_rows(x):
  """`[B, N, ...]` -> `[B * N, ...]`."""
  return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def empty_kda_cache(s: int, heads: int, head_dim: int, conv_width: int) -> KDALayerCache:
  """Zero KDA cache for s sequences (a fresh document)."""
  conv = jnp.zeros((s, conv_width - 1, heads * head_dim), jnp.float32)
  return KDALayerCache(jnp.zeros((s, heads, head_dim, head_dim), jnp.float32), conv, conv, conv)


MLA_ROW_MULTIPLE = 8


def mla_rows(length: int) -> int:
  """Token slots of an MLA latent cache asked to hold `length`: rounded up to a multiple of
  `MLA_ROW_MULTIPLE`. At a row count that is not one (e.g. 1057), XLA:TPU lays `[S, L, C]` out with L
  outermost, and a decode step copied every MLA layer's whole cache into the row-write layout and
  back (compiled for v5e, 0.9B model, S=64, L=1057: 578 MiB of copies a step; none at 1056 or 1064).
  The extra slots are never valid (`lengths` bounds every read)."""
  return -(-int(length) // MLA_ROW_MULTIPLE) * MLA_ROW_MULTIPLE


def empty_mla_cache(s: int, length: int, width: int, dtype) -> MLALayerCache:
  """Zero MLA latent cache of at least `length` token slots (`mla_rows`) for s sequences."""
  return MLALayerCache(jnp.zeros((s, mla_rows(length), width), dtype))


def logical_axes(cache: ModelCache) -> ModelCache:
  """Logical axes of each leaf of `cache` (same tree structure, a tuple of axis names per leaf).

  KDA state `[S, H, K, V]` and convs `[S, W-1, H*K]` split on sequences and heads; MLA latents
  `[S, L, C]` and `lengths [S]` on sequences only (`model/partitioning.py` maps the names).
  """
  def layer_axes(layer):
    if isinstance(layer, KDALayerCache):
      conv = ("activation_batch", None, "activation_heads")
      return KDALayerCache(partitioning.STATE_SHKV, conv, conv, conv)
    return MLALayerCache(("activation_batch", None, None))

  return ModelCache(tuple(layer_axes(c) for c in cache.layers), ("activation_batch",))


def shardings(cache: ModelCache, mesh, rules_or_cfg=None):
  """`NamedSharding` per leaf of `cache` (arrays or `ShapeDtypeStruct`s), via `logical_axes`;
  dimensions that a mesh axis does not divide stay replicated along it."""
  return partitioning.tree_shardings(cache, logical_axes(cache), mesh, rules_or_cfg)
