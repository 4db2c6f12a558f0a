"""The slot pool: a fixed `ModelCache` of S sequences (decode layout) that every engine step updates.

Slot s holds one running request: per KDA layer its float32 state and conv windows, per MLA layer
its latents `[max_model_len, latent_width]` (rows >= lengths[s] are stale and masked), and `lengths[s]`.
Slots absent from a step come back bit-unchanged, so idle and finished slots need no masking. For
the prefix cache, `take`, `take_mid` and `put` copy one slot's state into a `Snapshot` and back, device
to device: a snapshot lives in device memory (HBM on an accelerator), so saving one never waits for
the step and restoring one moves no bytes over the host link. Its MLA latents keep `snapshot_rows`
rows, one of a few sizes (one executable per size and transfer, compiled by `compile_transfers`).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from model import partitioning
from model.engine.prefix_cache import BLOCK, Snapshot
from model.nn import cache as cache_lib


def _fields(layer) -> tuple[str, ...]:
  return tuple(layer.__dataclass_fields__)


def snapshot_rows(num_tokens: int, cache_rows: int) -> int:
  """MLA latent rows a snapshot after `num_tokens` (> 0) tokens keeps: BLOCK times the least power of
  two that covers them, at most the slot's `cache_rows`. Powers of two bound the sizes (so the
  executables) to about log2(cache_rows / BLOCK) + 1 and waste at most half of a snapshot's latents;
  rows past `num_tokens` are stale and never read (the restored slot's length bounds every read)."""
  blocks = -(-int(num_tokens) // BLOCK)
  return min(int(cache_rows), BLOCK * (1 << (blocks - 1).bit_length()))


def _take_rows(layer, s, rows: int) -> dict:
  """Slot `s` of one layer's cache: every field, the MLA latent's first `rows` rows only."""
  if "latent" in _fields(layer):
    return {"latent": jax.lax.dynamic_slice_in_dim(layer.latent[s], 0, rows, axis=0)}
  return {f: getattr(layer, f)[s] for f in _fields(layer)}


# The transfers' programs (jitted per pool: `put` pins the pool's shardings; `rows` is static).
def take_slot(cache, s, rows: int) -> tuple:
  """Slot `s`'s per-layer state (`_take_rows`): a snapshot's arrays."""
  return tuple(_take_rows(layer, s, rows) for layer in cache.layers)


def take_mid_slot(cache, mid, p, s, rows: int) -> tuple:
  """As `take_slot`, the KDA layers' fields from entry `p` of a split step's `mid` instead."""
  return tuple({f: getattr(m, f)[p] for f in _fields(m)} if m is not None else _take_rows(layer, s, rows)
               for layer, m in zip(cache.layers, mid))


def put_slot(cache, s, layers, length):
  """`cache` with slot `s` holding `layers` (a snapshot's arrays; MLA latents: its first rows) and
  length `length`."""
  new = []
  for layer, src in zip(cache.layers, layers):
    fields = {}
    for f in _fields(layer):
      dst, val = getattr(layer, f), src[f].astype(getattr(layer, f).dtype)
      fields[f] = (jax.lax.dynamic_update_slice(dst, val[None], (s,) + (0,) * val.ndim) if f == "latent"
                   else dst.at[s].set(val))
    new.append(type(layer)(**fields))
  return cache_lib.ModelCache(tuple(new), cache.lengths.at[s].set(length))


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

  def devices(self) -> list:
    """The devices the pool lives on."""
    return sorted(jax.tree.leaves(self.cache)[0].devices(), key=lambda d: d.id)

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

  def transfer_sizes(self) -> list[int]:
    """Every MLA latent size (`snapshot_rows`) a snapshot of this pool can have, ascending."""
    return sorted({snapshot_rows(n, self.cache_rows) for n in range(BLOCK, self.cache_length + 1, BLOCK)})

  def compile_transfers(self, mids=()) -> None:
    """Compiles `take` and `put` now, for every size in `transfer_sizes`, by copying free slot 0 out
    and back, and `take_mid` for each example `mid` in `mids`; only while every slot is free.

    Raises:
      ValueError: a slot is in use.
    """
    if self.num_free != self.num_slots:
      raise ValueError(f"compile_transfers needs every slot free ({self.num_free} of {self.num_slots} are)")
    for rows in self.transfer_sizes():
      self.put(0, Snapshot(0, self.take(0, rows).layers))   # length 0, as a free slot's was
      for mid in mids:
        self.take_mid(mid, 0, 0, rows)

  def take(self, slot: int, num_tokens: int) -> Snapshot:
    """A device copy of slot `slot`'s state, which must have seen exactly `num_tokens` tokens (> 0);
    dispatched, not waited for."""
    if self._take is None:
      self._take = jax.jit(take_slot, static_argnums=2)
    with self._context():
      layers = self._take(self.cache, jnp.int32(slot), snapshot_rows(num_tokens, self.cache_rows))
    return Snapshot(int(num_tokens), layers)

  def take_mid(self, mid, entry: int, slot: int, num_tokens: int) -> Snapshot:
    """A device `Snapshot` of slot `slot` after `num_tokens` tokens, its KDA states and conv windows
    from entry `entry` of a split step's first-stage output `mid` (the slot went on past them in the
    same step), its MLA latents from the slot's rows (those past `num_tokens` are never read)."""
    if self._take_mid is None:
      self._take_mid = jax.jit(take_mid_slot, static_argnums=4)
    with self._context():
      layers = self._take_mid(self.cache, mid, jnp.int32(entry), jnp.int32(slot),
                              snapshot_rows(num_tokens, self.cache_rows))
    return Snapshot(int(num_tokens), layers)

  def put(self, slot: int, snapshot: Snapshot) -> None:
    """Writes `snapshot` into slot `slot` (KDA states and convs, MLA latent rows, length); dispatched,
    not waited for (the next step reads the pool after it)."""
    if self._put is None:
      self._put = jax.jit(put_slot, donate_argnums=(0,), out_shardings=self.shardings)
    with self._context():
      self.cache = self._put(self.cache, jnp.int32(slot), snapshot.layers, jnp.int32(snapshot.num_tokens))
