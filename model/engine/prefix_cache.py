"""Prefix cache of recurrent + latent states at block-aligned prompt boundaries (host side, no JAX).

A prompt is cut into blocks of `BLOCK` (64) tokens; block i's key is a hash chain
`h_i = blake2b(h_{i-1} || tokens of block i)`, so equal keys mean equal prefixes of (i + 1) * 64
tokens (up to a 128-bit collision). A `Snapshot` is what a slot holds after exactly that prefix:
every KDA layer's float32 state and conv windows, every MLA layer's latents of those tokens. A
request whose prompt starts with a cached prefix restores the snapshot into its slot and prefills
only the rest (vLLM's mamba-style state cache at block granularity, SGLang's radix cache for hybrid
models: a recurrent state exists only at the boundaries where it was saved, unlike paged KV).

Which boundaries to save (`PrefixCache.boundaries`), so that no extra pass is ever needed (the
engine ends a prefill chunk at each one and copies the slot's state there: after the step, or,
when the rest of the prompt went on in the same step's second stage, from that step's first-stage
output; `model.engine.scheduler`):
  * the prompt's last full block (a 130-token prompt: after token 128), the deepest reusable prefix;
  * the branch point: the deepest boundary this prompt shares with a prompt seen before (the key
    chains of past prompts are remembered, 16 bytes per block, even where no snapshot was taken).
    Two prompts `P + a`, `P + b` with a 512-token shared `P`: the first saves at its last block
    (past P), the second finds the chain of P known, saves at 512, and every later `P + c` hits.

Eviction: least recently used snapshot first, until the bytes held fit `budget_bytes`; a snapshot
larger than the whole budget is not stored. budget 0 = the cache is off (nothing stored or found).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

BLOCK = 64  # tokens per block: snapshots sit at multiples of it (the KDA kernels' chunk size divides it)

# Remembered key chains of past prompts (for branch points): bounded, oldest dropped first.
_MAX_SEEN_BLOCKS = 1 << 20


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
  """A slot's state after the first `num_tokens` prompt tokens (host numpy arrays).

  Attributes:
    num_tokens: a multiple of BLOCK.
    layers: per decoder layer, a dict of arrays: KDA {"state" float32 [H, K, V], "conv_q"/"conv_k"/
      "conv_v" float32 [W-1, H*K]}; MLA {"latent" [num_tokens, r + dr] in the compute dtype}.
  """

  num_tokens: int
  layers: tuple

  @property
  def nbytes(self) -> int:
    return int(sum(a.nbytes for layer in self.layers for a in layer.values()))


class PrefixCache:
  """Snapshots keyed by block-chain keys, LRU under a byte budget (see the module docstring).

  Args:
    budget_bytes: >= 0; 0 turns the cache off.

  Raises:
    ValueError: a negative budget.
  """

  def __init__(self, budget_bytes: int):
    if int(budget_bytes) < 0:
      raise ValueError(f"prefix_cache_bytes must be >= 0, got {budget_bytes}")
    self.budget_bytes = int(budget_bytes)
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
