"""Prefix cache of recurrent + latent states at block-aligned prompt boundaries (the index: no JAX).

A prompt is cut into blocks of `BLOCK` tokens, keyed by a hash chain (equal keys: equal prefixes). A
`Snapshot` is a slot's state after exactly such a prefix (KDA states and conv windows, MLA latents);
a request whose prompt starts with a cached prefix restores it and prefills only the rest (a
recurrent state exists only where it was saved, unlike paged KV). `PrefixCache.boundaries` picks
where to save so no extra pass is needed: the prompt's last full block, and its branch point with
earlier prompts (their key chains are remembered). Eviction is least recently used under a byte budget.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

BLOCK = 64  # tokens per block (the KDA kernels' chunk size divides it)
_MAX_SEEN_BLOCKS = 1 << 20   # remembered keys of past prompts, oldest dropped first


def block_keys(prompt: Sequence[int]) -> list[bytes]:
  """The hash chain of `prompt`'s full blocks: key i covers tokens [0, (i + 1) * BLOCK)."""
  ids = np.asarray(prompt, np.int32)
  keys, prev = [], b""
  for i in range(len(ids) // BLOCK):
    prev = hashlib.blake2b(prev + ids[i * BLOCK:(i + 1) * BLOCK].tobytes(), digest_size=16).digest()
    keys.append(prev)
  return keys


@dataclasses.dataclass
class Snapshot:
  """A slot's state after the first `num_tokens` (a multiple of BLOCK) prompt tokens: per decoder
  layer a dict of arrays, KDA {"state", "conv_q", "conv_k", "conv_v"}, MLA {"latent"} (at least
  `num_tokens` rows; those past it are stale). The engine's are device arrays (`model.engine.slots`),
  so `budget_bytes` is device memory."""

  num_tokens: int
  layers: tuple

  @property
  def nbytes(self) -> int:
    return int(sum(a.nbytes for layer in self.layers for a in layer.values()))


class PrefixCache:
  """Snapshots keyed by block-chain keys, LRU under `budget_bytes` (0 = off); an evicted snapshot's
  memory is freed when nothing else holds it (a restore in flight keeps its arrays alive)."""

  def __init__(self, budget_bytes: int):
    self.budget_bytes = int(budget_bytes)  # >= 0: validated once, by EngineConfig
    self._entries: collections.OrderedDict[bytes, Snapshot] = collections.OrderedDict()
    self._seen: collections.OrderedDict[bytes, None] = collections.OrderedDict()
    self.bytes = 0
    self.hits = 0
    self.lookups = 0

  @property
  def enabled(self) -> bool:
    return self.budget_bytes > 0

  def __len__(self) -> int:
    return len(self._entries)

  def lookup(self, keys: Sequence[bytes], prompt_length: int) -> Snapshot | None:
    """The deepest stored snapshot of this prompt that leaves at least one prompt token to prefill
    (the step needs the last prompt token's logits), or None; a hit becomes most recently used."""
    if not self.enabled:
      return None
    self.lookups += 1
    usable = min(len(keys), (prompt_length - 1) // BLOCK)
    for i in range(usable - 1, -1, -1):
      snap = self._entries.get(keys[i])
      if snap is not None:
        self._entries.move_to_end(keys[i])
        self.hits += 1
        return snap
    return None

  def boundaries(self, keys: Sequence[bytes], start: int) -> list[int]:
    """Token counts (> start, multiples of BLOCK, ascending) at which this prompt's prefill should
    end a chunk and be saved: its last full block and its branch point with earlier prompts. Also
    remembers the prompt's key chain. [] when the cache is off."""
    if not self.enabled or not keys:
      return []
    branch = 0
    for i, k in enumerate(keys):
      if k in self._seen:
        branch = (i + 1) * BLOCK
      else:
        break
    for k in keys:
      self._seen[k] = None
      self._seen.move_to_end(k)
    while len(self._seen) > _MAX_SEEN_BLOCKS:
      self._seen.popitem(last=False)
    want = {len(keys) * BLOCK, branch}
    return sorted(b for b in want if b > start and keys[b // BLOCK - 1] not in self._entries)

  def insert(self, key: bytes, snapshot: Snapshot) -> bool:
    """Stores `snapshot` under `key` (most recently used), evicting LRU entries to fit the budget.
    Returns False (nothing stored) when the cache is off or the snapshot alone exceeds the budget."""
    size = snapshot.nbytes
    if not self.enabled or size > self.budget_bytes:
      return False
    old = self._entries.pop(key, None)
    if old is not None:
      self.bytes -= old.nbytes
    while self._entries and self.bytes + size > self.budget_bytes:
      _, evicted = self._entries.popitem(last=False)
      self.bytes -= evicted.nbytes
    self._entries[key] = snapshot
    self.bytes += size
    return True
