"""A checkpoint's integrity data: `checksums.json` (one CRC-32 per parameter) and the finite-value check.

The file's format is in model/checkpoint/format.py's docstring; `format.check_parameters` verifies
a checkpoint against it and `format.ParameterWriter` writes it.
"""

from __future__ import annotations

import json
import os
import pathlib
import zlib
from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx

from model.atomic import atomic_writer
from model.errors import CheckpointError

CHECKSUMS_FILE = "checksums.json"


def non_finite(array) -> str | None:
  """None when every value of `array` (a NumPy float array, bfloat16 included) is finite; else a
  phrase for an error line: '3 non-finite value(s) (the first, nan, at index (0, 5))'."""
  a = np.asarray(array)
  bad = ~np.isfinite(a)
  if not bad.any():
    return None
  first = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), a.shape))
  return f"{int(bad.sum())} non-finite value(s) (the first, {a[first]}, at index {first})"


def _host_bytes(array) -> np.ndarray:
  """The C-order bytes of `array` (NumPy or a jax.Array) as a flat uint8 view.

  A jax.Array that spans devices of other processes (a multi-host training export) is first
  gathered whole onto every process (`multihost_utils.process_allgather`, a collective: every
  process writes the same parameters in the same order, as Orbax's multi-host save requires too),
  one parameter at a time: the checksum is of the whole parameter's bytes, whatever the sharding,
  so it matches what a one-host load reads back. Cost: each parameter crosses the network once more.
  """
  if isinstance(array, nnx.Variable):
    array = array.get_value()
  if isinstance(array, jax.Array) and not array.is_fully_addressable:
    from jax.experimental import multihost_utils  # noqa: PLC0415 (multi-host only; keeps imports light)
    array = multihost_utils.process_allgather(array, tiled=True)
  return np.ascontiguousarray(np.asarray(array)).reshape(-1).view(np.uint8)


def crc32(array) -> str:
  """zlib's CRC-32 of `array`'s C-order bytes in its own dtype, as 8 hex digits."""
  return f"{zlib.crc32(_host_bytes(array)) & 0xFFFFFFFF:08x}"


def checksum_entry(array) -> dict:
  """`{"crc32": ..., "dtype": ..., "shape": [...]}` of one parameter, as checksums.json stores it."""
  a = array.get_value() if isinstance(array, nnx.Variable) else array
  return {"crc32": crc32(a), "dtype": str(np.dtype(a.dtype)), "shape": [int(d) for d in a.shape]}


def write_checksums_file(directory: pathlib.Path, entries: Mapping[str, dict]) -> None:
  """Writes `directory/checksums.json` atomically (a temporary file renamed into place)."""
  data = {"format": 1, "algorithm": "crc32", "parameters": dict(sorted(entries.items()))}
  with atomic_writer(directory / CHECKSUMS_FILE) as f:
    f.write(json.dumps(data, indent=1) + "\n")


def read_checksums(path: str | os.PathLike) -> dict[str, dict] | None:
  """`{name: {"crc32", "dtype", "shape"}}` of checkpoint `path`, or None when it has no checksums.json.

  Raises:
    CheckpointError: a checksums.json that is not the format `write_checksums_file` writes.
  """
  f = pathlib.Path(path) / CHECKSUMS_FILE
  if not f.is_file():
    return None
  try:
    data = json.loads(f.read_text())
    if data.get("algorithm") != "crc32" or not isinstance(data.get("parameters"), dict):
      raise ValueError("expected {\"algorithm\": \"crc32\", \"parameters\": {...}}")
    return data["parameters"]
  except (ValueError, AttributeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{f}: not a valid checksums file ({type(e).__name__}: {e})") from None
