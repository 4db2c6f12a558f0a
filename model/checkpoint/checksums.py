"""A checkpoint's integrity data: `checksums.json` (one CRC-32 per parameter and per carried file, such as
the tokenizer's) and the finite-value check.

The file's format is in model/checkpoint/format.py's docstring; `format.check_parameters` verifies
a checkpoint against it and `format.ParameterWriter` writes it.
"""

from __future__ import annotations

import json
import os
import pathlib
import zlib
from collections.abc import Iterable, Mapping

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


def file_entry(path: str | os.PathLike) -> dict:
  """`{"crc32": ..., "bytes": n}` of a file's bytes, as checksums.json's "files" section stores it."""
  crc, size = 0, 0
  with open(path, "rb") as f:
    while block := f.read(1 << 20):
      crc, size = zlib.crc32(block, crc), size + len(block)
  return {"crc32": f"{crc & 0xFFFFFFFF:08x}", "bytes": size}


def write_checksums_file(directory: pathlib.Path, entries: Mapping[str, dict],
                         files: Mapping[str, dict] | None = None) -> None:
  """Writes `directory/checksums.json` atomically (a temporary file renamed into place); `files`:
  `{relative path: file_entry(...)}` of the files the checkpoint carries besides params/ (omitted when empty)."""
  data = {"format": 1, "algorithm": "crc32", "parameters": dict(sorted(entries.items()))}
  if files:
    data["files"] = dict(sorted(files.items()))
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


def read_file_checksums(path: str | os.PathLike) -> dict[str, dict] | None:
  """`{relative path: {"crc32", "bytes"}}` of the files checkpoint `path` carries besides params/ (its
  tokenizer, hf_config.json), `{}` when checksums.json lists none, None when there is no checksums.json.

  Raises:
    CheckpointError: a checksums.json whose "files" is not an object of such entries.
  """
  f = pathlib.Path(path) / CHECKSUMS_FILE
  if not f.is_file():
    return None
  try:
    files = json.loads(f.read_text()).get("files", {})
    if not isinstance(files, dict) or not all(isinstance(v, dict) and "crc32" in v for v in files.values()):
      raise ValueError("\"files\" must be {path: {\"crc32\": ..., \"bytes\": ...}}")
    return files
  except (ValueError, AttributeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{f}: not a valid checksums file ({type(e).__name__}: {e})") from None


def check_files(path: str | os.PathLike, names: Iterable[str] | None = None) -> int:
  """Verifies the carried files of checkpoint `path` (all listed in checksums.json, or only `names`)
  against their recorded CRC-32 and size; returns how many were checked (0 without checksums.json).

  Raises:
    CheckpointError: a listed file that is missing or whose bytes differ (named, both CRCs), or a name
      in `names` that checksums.json does not list.
  """
  files = read_file_checksums(path)
  if files is None:
    return 0
  p = pathlib.Path(path)
  todo = sorted(files) if names is None else list(names)
  for name in todo:
    if name not in files:
      raise CheckpointError(f"load_parameters_path={os.fspath(p)}: {CHECKSUMS_FILE} lists no checksum of {name}: "
                            f"the checkpoint is corrupt")
    f = p / name
    if not f.is_file():
      raise CheckpointError(f"load_parameters_path={os.fspath(p)}: {name} is missing (listed in {CHECKSUMS_FILE}): "
                            f"the checkpoint is incomplete; restore it from a good copy")
    got, want = file_entry(f), files[name]
    if got["crc32"] != want.get("crc32") or got["bytes"] != want.get("bytes", got["bytes"]):
      raise CheckpointError(f"load_parameters_path={os.fspath(p)}: {name} does not match its checksum (crc32 "
                            f"recorded {want.get('crc32')}, read {got['crc32']}; {got['bytes']} bytes): the file is "
                            f"corrupt or was edited; restore the checkpoint from a good copy (verify_checksums=false "
                            f"loads it anyway)")
  return len(todo)
