"""The slot pool: a fixed `ModelCache` of S sequences (decode layout) that every engine step updates.

Slot s holds one running request: per KDA layer its float32 state and conv windows, per MLA layer
its latents `[max_model_len, latent_width]` (rows >= lengths[s] are stale and masked), and `lengths[s]`.
Slots absent from a step come back bit-unchanged, so idle and finished slots need no masking. For
the prefix cache, `take`, `take_mid` and `put` move one slot's state to and from the host (each one
executable, compiled on first use).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from model import partitioning
from model.engine.prefix_cache import Snapshot
from model.nn import cache as cache_lib


def _fields(layer) -> tuple[str, ...]:
  return tuple(layer.__dataclass_fields__)


class SlotPool:
  """S slots of per-request state on the device, and the free list.

  Args:
    model: the `KimiLinearForCausalLM` (only `init_cache` is used).
    num_slots: S = max_num_seqs. cache_length: L = max_model_len (MLA latent rows per slot).
    mesh, rules: place the pool on this mesh (`model.nn.cache.shardings`: slots on the data axes,
      KDA heads on tensor; undividable dimensions replicated); None: one device.

  Attributes:
    cache: the current `ModelCache` (replaced after every step: the step donates the old one).
    shardings: the pool's per-leaf shardings (pinned as the step's cache output shardings, so one
      executable per bucket serves every step), or None on one device.
  """

  def __init__(self, model, num_slots: int, cache_length: int, *, mesh=None, rules=None):
    self.num_slots, self.cache_length = int(num_slots), int(cache_length)
    self.mesh, self._rules = mesh, rules
    # Distinct buffers per leaf (init_cache shares one zero array between the conv windows; steps donate).
    cache = jax.tree.map(lambda a: jnp.array(a, copy=True), model.init_cache(1, self.num_slots, self.cache_length))
    self.cache_rows = cache.cache_length or self.cache_length   # MLA slots: rounded up (`cache_lib.mla_rows`)
    # Committed, as every step's output is, so the transfers compile once.
    if mesh is not None:
      self.shardings = cache_lib.shardings(cache, mesh, rules)
      cache = jax.device_put(cache, self.shardings)
    else:
      self.shardings = None
      cache = jax.device_put(cache, jax.devices()[0])
    self.cache = cache
    self._free = list(range(self.num_slots))
    self._take = self._put = self._take_mid = None

  # --- free list ------------------------------------------------------------------------------------
  @property
  def num_free(self) -> int:
    return len(self._free)

  def acquire(self) -> int:
    """The lowest free slot (raises IndexError when none is free)."""
    self._free.sort()
    return self._free.pop(0)

  def release(self, slot: int) -> None:
    """Returns `slot` to the free list (its stale state is reset when the next request starts)."""
    if slot in self._free:
      raise ValueError(f"slot {slot} is already free")
    self._free.append(slot)

  # --- prefix-cache transfers -------------------------------------------------------------------------
  def _context(self):
    return partitioning.mesh_context(self.mesh, self._rules) if self.mesh is not None else contextlib.nullcontext()

  def compile_transfers(self, mids=()) -> None:
    """Compiles `take` and `put` now by copying free slot 0 out and back, and `take_mid` for each
    example `mid` in `mids`; only while every slot is free.

    Raises:
      ValueError: a slot is in use.
    """
    if self.num_free != self.num_slots:
      raise ValueError(f"compile_transfers needs every slot free ({self.num_free} of {self.num_slots} are)")
    self.put(0, self.take(0, 0))
    for mid in mids:
      self.take_mid(mid, 0, 0, 0)

  def take(self, slot: int, num_tokens: int) -> Snapshot:
    """A host copy of slot `slot`'s state, which must have seen exactly `num_tokens` tokens."""
    if self._take is None:
      def take(cache, s):
        return tuple({f: getattr(layer, f)[s] for f in _fields(layer)} for layer in cache.layers)
      with self._context():
        self._take = jax.jit(take)
    return self._snapshot(self._take(self.cache, jnp.int32(slot)), num_tokens)

  def take_mid(self, mid, entry: int, slot: int, num_tokens: int) -> Snapshot:
    """A host `Snapshot` of slot `slot` after `num_tokens` tokens, its KDA states and conv windows from
    entry `entry` of a split step's first-stage output `mid` (the slot went on past them in the same
    step), its MLA latents from the slot's first `num_tokens` rows."""
    if self._take_mid is None:
      def take_mid(cache, mid, p, s):
        return tuple({f: getattr(m, f)[p] for f in _fields(m)} if m is not None
                     else {f: getattr(layer, f)[s] for f in _fields(layer)}
                     for layer, m in zip(cache.layers, mid))
      with self._context():
        self._take_mid = jax.jit(take_mid)
    return self._snapshot(self._take_mid(self.cache, mid, jnp.int32(entry), jnp.int32(slot)), num_tokens)

  @staticmethod
  def _snapshot(layers, num_tokens: int) -> Snapshot:
    out = []
    for layer in jax.device_get(layers):
      if "latent" in layer:   # MLA: only the prefix rows (the rest of the slot's row is stale)
        layer = {"latent": np.array(layer["latent"][:num_tokens])}
      out.append({k: np.asarray(v) for k, v in layer.items()})
    return Snapshot(int(num_tokens), tuple(out))

  def put(self, slot: int, snapshot: Snapshot) -> None:
    """Writes `snapshot` into slot `slot` (KDA states and convs, MLA latent prefix, length)."""
    if self._put is None:
      def put(cache, s, layers, length):
        new = []
        for layer, src in zip(cache.layers, layers):
          new.append(type(layer)(**{f: getattr(layer, f).at[s].set(src[f].astype(getattr(layer, f).dtype))
                                   for f in _fields(layer)}))
        return cache_lib.ModelCache(tuple(new), cache.lengths.at[s].set(length))
      with self._context():
        self._put = jax.jit(put, donate_argnums=(0,), out_shardings=self.shardings)
    layers = []
    for layer in snapshot.layers:
      if "latent" in layer:   # padded to the slot's full row so that one executable fits every length
        lat = layer["latent"]
        full = np.zeros((self.cache_rows,) + lat.shape[1:], lat.dtype)
        full[:lat.shape[0]] = lat
        layer = {"latent": full}
      layers.append(layer)
    with self._context():
      self.cache = self._put(self.cache, jnp.int32(slot), tuple(layers), jnp.int32(snapshot.num_tokens))
