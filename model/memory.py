"""The memory a model's parameters take against the memory the machine has.

`model/loading.py` runs `check_parameters_fit` before it allocates a model (random init or restore),
so a config too large for the machine is one line naming the parameter count and bytes instead of a
kernel OOM kill minutes later; `available_memory_bytes` is also the train step's budget
(`model/training/steps.py`). Imports nothing of the model: it reads `jax.ShapeDtypeStruct` trees.
"""

from __future__ import annotations

import math
import os
import re

import jax

from model.errors import ConfigError


_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# libtpu's compile-time OOM (E1000 CompileTimeHbmOom): "... the total memory required for HLO
# temporaries (33.05G) exceeds available HBM (15.75G) ..."; units are binary (2.00T for 2**41 bytes).
_AVAILABLE_RE = re.compile(r"exceeds available HBM \(([0-9.]+)\s*([KMGT]?)i?B?\)")
_REQUIRED_RE = re.compile(r"memory required for [^(]*\(([0-9.]+)\s*([KMGT]?)i?B?\)")


def _size(match) -> int | None:
  return None if match is None else int(round(float(match.group(1)) * _UNITS[match.group(2)]))


def is_compile_oom(e: BaseException) -> bool:
  """True when `e` is libtpu refusing a program for memory (RESOURCE_EXHAUSTED at compile)."""
  return isinstance(e, jax.errors.JaxRuntimeError) and str(e).lstrip().startswith("RESOURCE_EXHAUSTED")


def oom_bytes(e: BaseException) -> tuple[int | None, int | None]:
  """`(required, available)` bytes per device from libtpu's compile-time OOM text (None: not stated).

  libtpu prints both rounded to two decimals of its unit (e.g. 33.05G), so each is exact to +- 0.005 GiB.
  """
  text = str(e)
  return _size(_REQUIRED_RE.search(text)), _size(_AVAILABLE_RE.search(text))


class ModelTooLargeError(ConfigError):
  """The parameters of the model about to be built do not fit the device's or host's memory."""


def available_memory_bytes(device) -> tuple[int | None, bool]:
  """`(bytes, arguments_resident)` a step may use on `device`: an accelerator's `bytes_limit` (its
  whole memory: the step's arguments must fit in it too), or on CPU the host's available memory
  (MemAvailable of /proc/meminfo, else free pages by os.sysconf), where the train state already lives.
  `(None, False)` when the device reports nothing."""
  if device.platform != "cpu":
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    return (int(limit) if limit else None), False
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024, True
  except OSError:
    pass
  try:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), True
  except (ValueError, OSError):
    return None, True


def parameter_bytes(state, devices=None) -> tuple[int, int, dict]:
  """`(parameter count, total bytes, {device: bytes it holds})` of a state of `jax.ShapeDtypeStruct`s
  (or arrays).

  A leaf with a `sharding` counts its shard (`shard_shape`) on each device of `devices` that holds
  one; without one (or with one over an abstract mesh) it counts whole on `devices[0]`. `devices`
  None: every leaf whole, under key None.
  """
  count = total = 0
  held: dict = {}
  for leaf in jax.tree.leaves(state):
    n = math.prod(leaf.shape)
    item = jax.numpy.dtype(leaf.dtype).itemsize
    count += n
    total += n * item
    sharding = getattr(leaf, "sharding", None)
    if isinstance(getattr(sharding, "mesh", None), jax.sharding.AbstractMesh):
      # Traced inside a mesh context (e.g. `loading.create` called under `partitioning.mesh_context`):
      # an abstract mesh names no devices, and the eager model it describes lands whole on one device.
      sharding = None
    if devices is None or sharding is None:
      key = None if devices is None else devices[0]
      held[key] = held.get(key, 0) + n * item
      continue
    shard = math.prod(sharding.shard_shape(leaf.shape)) * item
    for d in sharding.device_set:
      if d in devices:
        held[d] = held.get(d, 0) + shard
  return count, total, held


def _gb(n: int) -> str:
  return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def check_parameters_fit(state, *, name: str, devices, allow: bool = False) -> None:
  """Raises ModelTooLargeError when the parameters of `state` (`jax.ShapeDtypeStruct`s, nothing
  allocated) exceed the memory that will hold them.

  On an accelerator: the busiest device's share of the parameters against its `bytes_limit`. On CPU
  (every device of this host shares its memory): all of this host's shards against MemAvailable.
  Nothing is checked when the device reports no figure.

  Args:
    state: the model's abstract state (leaves with a `sharding` when it goes onto a mesh).
    name: the model, for the message. devices: the devices that will hold it (a mesh's devices, or
      the one default device). allow: skip the check (`allow_large_model=true`).

  Raises:
    ModelTooLargeError: one line with the parameter count, their bytes and the memory figure.
  """
  if allow:
    return
  devices = list(devices)
  local = [d for d in devices if d.process_index == jax.process_index()] or devices
  have, _ = available_memory_bytes(local[0])
  if have is None:
    return
  count, total, held = parameter_bytes(state, local)
  cpu = local[0].platform == "cpu"
  if cpu:
    need = sum(held.values())
    where = f"this host has {_gb(have)} available (MemAvailable)"
  else:
    need = max(held.values(), default=0)
    where = f"a {local[0].device_kind} has {_gb(have)} (bytes_limit)"
  if need <= have:
    return
  share = "" if need == total else f", {_gb(need)} of them on {'this host' if cpu else 'one device'}"
  raise ModelTooLargeError(
      f"model {name} has {count:,} parameters, {_gb(total)}{share}, but {where}: building it would run out "
      f"of memory; pass allow_large_model=true to build it anyway, or pick a smaller config (e.g. tiny)")
