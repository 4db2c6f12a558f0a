"""The project's parameter checkpoint: one self-contained directory per set of model parameters.

Layout of a checkpoint directory `DIR` (what `load_parameters_path=DIR` points at)::

  DIR/config.json       the model config (`model.config.checkpoint_json`: the model section of
                        configs/base.py; tool, training and mesh keys are not stored);
                        `tokenizer_path` is stored relative to DIR, `load_parameters_path` as "".
  DIR/params/           an Orbax checkpoint (orbax.checkpoint v1 API, OCDBT + zarr3) of the model's
                        parameter tree: `nnx.to_pure_dict(nnx.state(model))`, i.e. nested dicts
                        `{"model": {"embed_tokens": {"embedding": ...}, "layers": {0: {...}, ...},
                        "norm": {...}}, "lm_head": {"kernel": ...}}` of arrays; every nnx Variable is
                        included (`nnx.Param` and the router's `RouterBias`). Names and shapes are the
                        model's own (see model/nn/kda.py, model/nn/mla.py, model/nn/moe.py docstrings).
  DIR/checksums.json    one CRC-32 (zlib's, of the C-order bytes in the stored dtype) per parameter,
                        `{"format": 1, "algorithm": "crc32", "parameters": {name: {"crc32": "1a2b3c4d",
                        "dtype": "float32", "shape": [..]}}}`; written with params/, inside the same
                        atomic rename. Loading verifies it (`check_parameters`); a checkpoint written
                        before checksums were recorded has none and loads with a one-line notice.
                        A "files" section lists the other files the checkpoint carries, the same
                        way per file: `{"tokenizer/tiktoken.model": {"crc32": ..., "bytes": n}, ...}`
                        (the tokenizer and hf_config.json); loading verifies them too.
  DIR/tokenizer.model   a copy of a sentencepiece tokenizer file, when one was given (optional); or
  DIR/tokenizer/        a Kimi (tiktoken) tokenizer directory's files, byte for byte: tiktoken.model,
                        tokenizer_config.json (with the chat template), generation_config.json, ...
                        (`model.checkpoint.tokenizer_files`); config.json's tokenizer_path is then
                        "tokenizer", so every tool finds tokenizer and chat template from DIR alone.

Saving goes through `ParameterWriter`, which writes into a hidden temporary sibling of DIR and renames
it into place only when everything is written, so a failure or interrupt never leaves a partial DIR.
It can write the tree in pieces (one layer at a time, e.g. from the checkpoint converter), so host
memory is bounded by the largest piece rather than the model (Orbax "partial save").

Reading: `read_config(DIR, overrides)` rebuilds the config from `DIR/config.json` (read once) with
key=value overrides on top, validated once; `restore_parameters(DIR, abstract_state, shardings)`
restores arrays into given shardings (each host reads only its shards). This module knows the
on-disk format only and imports no model: building a model from a checkpoint is
`model.loading.load`. Stored arrays are cast to the abstract dtype on restore, so a float32
checkpoint loads with `weight_dtype=bfloat16`.
"""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import sys
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from model.atomic import atomic_directory, check_writable, remove_tree
from model.checkpoint.checksums import (CHECKSUMS_FILE, check_files, checksum_entry, crc32, file_entry, non_finite,
                                        read_checksums, read_file_checksums, write_checksums_file)
from model.checkpoint.tokenizer_files import TOKENIZER_DIR, TOKENIZER_FILE, is_tokenizer_dir, tokenizer_dir_files
from model.checkpoint.orbax_logs import held_absl_warnings, quiet_orphaned_reads
from model.errors import CheckpointError
from model.config import ConfigError, apply_overrides, checkpoint_json, config_from_json, set_value, validate_config

CONFIG_FILE = "config.json"
PARAMS_DIR = "params"
# Chunks of at most this many bytes in the stored zarr arrays, so that a sharded restore reads
# about its own shard rather than whole multi-GB tensors.
_CHUNK_BYTES = 64 * 2**20


def _ocp():
  # Imported lazily: orbax pulls in a lot, and most importers of model/ only read configs.
  from orbax.checkpoint.experimental import v1 as ocp
  return ocp


def _context():
  """Orbax options shared by every save: bounded chunks, no defensive host copies (the writer owns
  its arrays until the write finished), no compression (weights barely compress; it costs time)."""
  ctx = _ocp().Context()
  ctx.array.saving.storage_options.chunk_byte_size = _CHUNK_BYTES
  ctx.array.saving.use_compression = False
  ctx.memory.deepcopy_host_arrays = False
  return ctx


# ------------------------------------------------------------------------------------------------
# Paths and the config file
# ------------------------------------------------------------------------------------------------

def _keystr(path) -> str:
  """'model.layers.0.self_attn.q_proj.kernel' for a jax key path (dict keys, sequence indices)."""
  parts = []
  for k in path:
    for attr in ("key", "idx", "name"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return ".".join(parts)


def flatten(tree) -> dict[str, object]:
  """Nested dict / nnx.State -> {'model.layers.0.self_attn.q_proj.kernel': leaf} (dotted names)."""
  if isinstance(tree, nnx.State):
    tree = nnx.to_pure_dict(tree)
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {_keystr(p): v for p, v in leaves}


def is_checkpoint(path: str | os.PathLike) -> bool:
  """True when `path` holds `config.json` and a `params/` directory (no deeper check)."""
  p = pathlib.Path(path)
  return (p / CONFIG_FILE).is_file() and (p / PARAMS_DIR).is_dir()


def _check_dir(path: str | os.PathLike) -> pathlib.Path:
  p = pathlib.Path(path)
  if not str(path):
    raise CheckpointError("no checkpoint path given (load_parameters_path is empty)")
  if not p.exists():
    raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
  if not p.is_dir():
    raise CheckpointError(f"checkpoint {str(path)!r} is not a directory (expected {CONFIG_FILE} and "
                          f"{PARAMS_DIR}/ inside)")
  if not (p / CONFIG_FILE).is_file():
    raise CheckpointError(f"checkpoint {str(path)!r} has no {CONFIG_FILE} (not a parameter checkpoint of this "
                          f"project; convert a Hugging Face directory with `python -m tools.convert_checkpoint`)")
  if not (p / PARAMS_DIR).is_dir():
    if any(p.glob("*.safetensors")):
      raise CheckpointError(f"checkpoint {str(path)!r} is a Hugging Face directory (config.json + *.safetensors), not "
                            f"a checkpoint of this project: convert it first with `kda-convert hf_model_path="
                            f"{str(path)} output_path=DIR` and pass load_parameters_path=DIR")
    raise CheckpointError(f"checkpoint {str(path)!r} has no {PARAMS_DIR}/ directory (incomplete checkpoint)")
  return p.absolute()  # Orbax resolves relative paths against nothing useful: always hand it absolute ones


def read_config_text(path: pathlib.Path) -> str:
  """The text of `path/config.json` (the one read of that file per load)."""
  return (path / CONFIG_FILE).read_text()


def read_config(path: str | os.PathLike, overrides: Sequence[str] = ()):
  """The config stored in checkpoint `path`, with `key=value` overrides applied, locked.

  `load_parameters_path` is set to `path`; a stored relative `tokenizer_path` is resolved against
  `path` (an override of tokenizer_path wins).

  Raises:
    CheckpointError: no checkpoint at `path`, or an unreadable/invalid config.json (named).
    ConfigError: a bad override (named key and expected type).
  """
  p = _check_dir(path)
  try:
    # Validated once, below, after the overrides: the stored config alone need not be valid
    # for this job (e.g. its ici_* keys describe the mesh of the job that wrote it).
    cfg = config_from_json(read_config_text(p), validate=False)
  except (ConfigError, ValueError, OSError) as e:
    raise CheckpointError(f"{p / CONFIG_FILE}: not a valid model config: {e}") from None
  tok = cfg.tokenizer_path
  cfg = apply_overrides(cfg, ["load_parameters_path=" + os.fspath(p)])
  if tok and not os.path.isabs(tok):
    set_value(cfg, "tokenizer_path", os.fspath(p / tok))
  cfg = apply_overrides(cfg, list(overrides))
  validate_config(cfg)
  cfg.lock()
  return cfg


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------

def _to_host(x):
  """A leaf as something Orbax writes: np.ndarray or jax.Array (nnx Variables unwrapped)."""
  if isinstance(x, nnx.Variable):
    x = x.get_value()
  if isinstance(x, (np.ndarray, jax.Array)):
    return x
  return np.asarray(x)


class ParameterWriter:
  """Writes a checkpoint directory atomically, the parameter tree possibly in several pieces.

  Usage::

    with ParameterWriter(out_dir, config, tokenizer_path=tok, overwrite=False) as w:
      for piece in pieces:          # disjoint nested dicts of the pure parameter tree
        w.write(piece)              # written to disk before returning; the caller may free it
    # out_dir now holds config.json, params/ (and the tokenizer); on error nothing is left.

  Args:
    path: the checkpoint directory to create.
    config: the model's ConfigDict (stored as config.json; `load_parameters_path` cleared and
      `tokenizer_path` replaced by the copy's name, relative to the checkpoint).
    tokenizer_path: the tokenizer to copy in: a sentencepiece file (stored as `tokenizer.model`) or a
      Kimi tokenizer directory (its files stored in `tokenizer/`, `tokenizer_files.tokenizer_dir_files`);
      default `config.tokenizer_path` when that names an existing file or such a directory, else none.
    overwrite: replace an existing checkpoint at `path` (only a directory that is a checkpoint, or
      empty, is ever replaced; anything else is refused).

  Every copied file (and every `add_file`) gets its CRC-32 in checksums.json's "files" section.

  Raises:
    CheckpointError: `path` exists and overwrite is False (or it is not a checkpoint), or the
      tokenizer is missing or a directory without tiktoken.model; both before anything is written.
  """

  def __init__(self, path: str | os.PathLike, config, *, tokenizer_path: str | os.PathLike | None = None,
               overwrite: bool = False):
    self.path = pathlib.Path(path).absolute()
    check_writable(self.path, overwrite, is_checkpoint, "a checkpoint")
    self.overwrite = overwrite
    if tokenizer_path is None and config.get("tokenizer_path") and (
        os.path.isfile(config.tokenizer_path) or is_tokenizer_dir(config.tokenizer_path)):
      tokenizer_path = config.tokenizer_path
    self.tokenizer_files: list[tuple[str, str]] = []   # (source path, name inside the checkpoint)
    if tokenizer_path is not None:
      tokenizer_path = os.fspath(tokenizer_path)
      if os.path.isdir(tokenizer_path):
        try:
          names = tokenizer_dir_files(tokenizer_path)
        except FileNotFoundError as e:
          raise CheckpointError(f"tokenizer_path: {e}") from None
        self.tokenizer_files = [(os.path.join(tokenizer_path, n), f"{TOKENIZER_DIR}/{n}") for n in names]
      elif os.path.isfile(tokenizer_path):
        self.tokenizer_files = [(tokenizer_path, TOKENIZER_FILE)]
      else:
        raise CheckpointError(f"tokenizer_path {tokenizer_path!r} does not exist (expected a sentencepiece .model "
                              f"file or a Kimi tokenizer directory with tiktoken.model)")
    self.tokenizer_path = tokenizer_path
    self.config = config
    self.tmp: pathlib.Path | None = None
    self._written: set[str] = set()
    self._checksums: dict[str, dict] = {}
    self._file_checksums: dict[str, dict] = {}
    self.bytes_written = 0

  @property
  def stored_tokenizer_path(self) -> str:
    """config.json's tokenizer_path: relative to the checkpoint ("tokenizer.model", "tokenizer"), or ""."""
    if not self.tokenizer_files:
      return ""
    return TOKENIZER_FILE if self.tokenizer_files[0][1] == TOKENIZER_FILE else TOKENIZER_DIR

  def __enter__(self):
    self._atomic = atomic_directory(self.path, overwrite=self.overwrite, replaceable=is_checkpoint,
                                    what="a checkpoint")
    self.tmp = self._atomic.__enter__()
    try:
      stored = apply_overrides(self.config, ["load_parameters_path=", f"tokenizer_path={self.stored_tokenizer_path}"])
      (self.tmp / CONFIG_FILE).write_text(checkpoint_json(stored) + "\n")
      for src, name in self.tokenizer_files:
        (self.tmp / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, self.tmp / name)
        self._file_checksums[name] = file_entry(self.tmp / name)
    except BaseException:
      self._atomic.__exit__(*sys.exc_info())
      raise
    return self

  def add_file(self, name: str, data: bytes) -> None:
    """Writes `data` as the file `name` (relative, e.g. "hf_config.json") of the checkpoint, listed with
    its CRC-32 in checksums.json."""
    if self.tmp is None:
      raise RuntimeError("ParameterWriter.add_file outside its `with` block")
    if name in self._file_checksums or name in (CONFIG_FILE, CHECKSUMS_FILE) or name.split("/")[0] == PARAMS_DIR:
      raise CheckpointError(f"{self.path}: the file {name} is written twice or is the checkpoint's own")
    (self.tmp / name).parent.mkdir(parents=True, exist_ok=True)
    (self.tmp / name).write_bytes(data)
    self._file_checksums[name] = file_entry(self.tmp / name)

  def write(self, tree: Mapping) -> None:
    """Writes one piece of the pure parameter tree (nested dicts of arrays, or an nnx.State).

    Pieces must be disjoint (a parameter written twice raises CheckpointError). Blocks until the
    piece is on disk.
    """
    if self.tmp is None:
      raise RuntimeError("ParameterWriter.write outside its `with` block")
    if isinstance(tree, nnx.State):
      tree = nnx.to_pure_dict(tree)
    tree = jax.tree.map(_to_host, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
    names = flatten(tree)
    dup = sorted(set(names) & self._written)
    if dup:
      raise CheckpointError(f"parameter {dup[0]} written twice to {self.path}")
    if not names:
      return
    for name, leaf in names.items():
      self._checksums[name] = checksum_entry(leaf)
    with _context():
      _ocp().partial.save(self.tmp / PARAMS_DIR, tree)
    self._written |= set(names)
    self.bytes_written += sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in names.values())

  def __exit__(self, exc_type, exc, tb):
    partial = pathlib.Path(f"{self.tmp / PARAMS_DIR}.partial_save")
    try:
      if exc_type is None:
        if not self._written:
          raise CheckpointError(f"no parameters were written to {self.path}")
        with _context():
          _ocp().partial.finalize(self.tmp / PARAMS_DIR)
        write_checksums_file(self.tmp, self._checksums, self._file_checksums)
    except BaseException:
      remove_tree(partial)
      self._atomic.__exit__(*sys.exc_info())
      raise
    remove_tree(partial)
    return self._atomic.__exit__(exc_type, exc, tb)


def save_parameters(path: str | os.PathLike, model, config, *, tokenizer_path: str | os.PathLike | None = None,
                    overwrite: bool = False) -> pathlib.Path:
  """Saves `model`'s parameters and `config` as a checkpoint directory (atomically).

  Args:
    path: the directory to create.
    model: an `nnx.Module` (e.g. `KimiLinearForCausalLM`) or its `nnx.State`; every Variable
      (parameters and the router bias) is saved in its current dtype.
    config: the ConfigDict the model was built from (stored as config.json).
    tokenizer_path: tokenizer file to copy in (default: config.tokenizer_path if it is a file).
    overwrite: replace an existing checkpoint at `path`.

  Returns:
    `path` as an absolute `pathlib.Path`.

  Raises:
    CheckpointError: `path` exists (without overwrite), or a missing tokenizer file.
  """
  state = model if isinstance(model, nnx.State) else nnx.state(model)
  with ParameterWriter(path, config, tokenizer_path=tokenizer_path, overwrite=overwrite) as w:
    w.write(state)
  return w.path


# ------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------

def stored_parameters(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """`{'model.layers.0.self_attn.q_proj.kernel': (shape, dtype), ...}` read from the metadata only.

  Raises:
    CheckpointError: no checkpoint at `path`, or unreadable Orbax metadata (a truncated or corrupt
      params/: one line `load_parameters_path=DIR: params/ is corrupt or truncated (<TensorStore's
      first line>)`).
  """
  p = _check_dir(path)
  try:
    with quiet_orphaned_reads(p / PARAMS_DIR), held_absl_warnings() as held:
      meta = _ocp().metadata(p / PARAMS_DIR).metadata
      if meta is None:
        # Orbax logs the reason (e.g. a truncated file holding the arrays' zarr.json) and returns None.
        details = [r.getMessage().split("Error details:", 1)[1] for r in held if "Error details:" in r.getMessage()]
        cause = details[0].strip().splitlines()[0].split(" [tensorstore_spec=")[0] if details else "no array metadata"
        raise CheckpointError(f"load_parameters_path={os.fspath(p)}: params/ is corrupt or truncated ({cause})")
  except CheckpointError:
    raise
  except Exception as e:  # orbax raises many kinds; all mean "not a readable checkpoint"
    raise CheckpointError(f"{p / PARAMS_DIR}: cannot read the Orbax checkpoint metadata "
                          f"({type(e).__name__}: {e})") from None
  for record in held:  # the metadata was read after all: pass on what Orbax logged
    logging.getLogger(record.name).handle(record)
  return {k: (tuple(m.shape), np.dtype(m.dtype)) for k, m in flatten(meta).items()}


def read_parameters(path: str | os.PathLike, names: Sequence[str]) -> dict[str, np.ndarray]:
  """Reads only the named parameters (dotted names as `stored_parameters` gives) as NumPy arrays in
  their stored dtype; host memory is what these arrays need (tools stream a checkpoint this way).

  Raises:
    CheckpointError: an unknown name, or unreadable array data (one line naming the checkpoint and
      the first line of TensorStore's error; see `_read_error`).
  """
  p = _check_dir(path)
  return _read_named(p, stored_parameters(p), names)


def _read_named(p: pathlib.Path, stored: dict, names: Sequence[str]) -> dict[str, np.ndarray]:
  unknown = [n for n in names if n not in stored]
  if unknown:
    raise CheckpointError(f"{p}: no parameter(s) {unknown[:3]} in the checkpoint")
  abstract: dict = {}
  for n in names:
    node = abstract
    *parents, leaf = n.split(".")
    for k in parents:
      node = node.setdefault(k, {})
    shape, dtype = stored[n]
    node[leaf] = np.empty(shape, dtype)  # only the shape/dtype are used; pages are never touched
  ctx = _context()
  ctx.pytree.loading.partial_load = True
  try:
    with ctx, quiet_orphaned_reads(p / PARAMS_DIR):
      out = _ocp().load(p / PARAMS_DIR, abstract)
  except Exception as e:
    raise _read_error(p, e) from None
  return {k: np.asarray(v) for k, v in flatten(out).items()}


SCAN_PIECE_BYTES = 256 * 2**20  # parameters read per piece by `check_parameters` (bounded host memory)
_noticed: set[str] = set()  # checkpoints whose missing checksums.json was already reported


def check_parameters(path: str | os.PathLike, *, verify_checksums: bool = True,
                     allow_non_finite: bool = False) -> dict:
  """Reads every stored parameter once, piece by piece (host memory: about SCAN_PIECE_BYTES or the
  largest parameter), verifies its CRC-32 against checksums.json and refuses non-finite values: the
  load-time check of `model.loading.restore` and the work of `tools.verify_checkpoint`. Values are
  checked in their stored dtype. With both checks off nothing is read. The carried files checksums.json
  lists (the tokenizer, hf_config.json) are verified too (`checksums.check_files`).

  A checkpoint without checksums.json (written before checksums were recorded) is not an error:
  one line `note: ...` goes to stderr, once per checkpoint and process.

  Returns:
    `{"parameters": n, "bytes": bytes read, "checksums": True (verified) / False (none recorded) /
    None (not asked), "files": carried files verified}`.

  Raises:
    CheckpointError: one line naming the first parameter (in stored order) whose bytes do not match
      its checksum (stored and computed CRC-32), or which holds a NaN or an infinity (count and
      first index) unless `allow_non_finite`; a parameter missing from or extra in checksums.json;
      unreadable data.
  """
  p = _check_dir(path)
  stored = stored_parameters(p)
  sums = read_checksums(p) if verify_checksums else None
  if verify_checksums and sums is None and os.fspath(p) not in _noticed:
    _noticed.add(os.fspath(p))
    print(f"note: {p} has no {CHECKSUMS_FILE} (written before checksums were recorded): its parameters are "
          f"not verified; `python -m tools.verify_checkpoint load_parameters_path={p} record_checksums=true` "
          f"records them", file=sys.stderr)
  if sums is not None and set(sums) != set(stored):
    odd = sorted(set(sums) ^ set(stored))
    raise CheckpointError(f"load_parameters_path={os.fspath(p)}: {CHECKSUMS_FILE} does not list the same "
                          f"parameters as params/ (e.g. {odd[0]}): the checkpoint is corrupt")
  out = {"parameters": len(stored), "bytes": 0, "checksums": None if not verify_checksums else sums is not None,
         "files": check_files(p) if sums is not None else 0}
  if sums is None and allow_non_finite:
    return out
  for group in _pieces(stored):
    for name, arr in _read_named(p, stored, group).items():
      out["bytes"] += arr.nbytes
      if sums is not None:
        want, got = sums[name].get("crc32"), crc32(arr)
        if want != got:
          raise CheckpointError(f"load_parameters_path={os.fspath(p)}: parameter {name} does not match its "
                                f"checksum (crc32 recorded {want}, read {got}): params/ is corrupt; restore "
                                f"the checkpoint from a good copy (verify_checksums=false loads it anyway)")
      bad = None if allow_non_finite else non_finite(arr)
      if bad:
        raise CheckpointError(f"load_parameters_path={os.fspath(p)}: parameter {name} holds {bad}; refusing "
                              f"to load it (allow_non_finite=true loads it anyway, for debugging)")
  return out


def record_checksums(path: str | os.PathLike) -> int:
  """Computes and writes checksums.json for checkpoint `path` from the parameters stored now (for a
  checkpoint written before checksums were recorded; it blesses whatever params/ holds). Returns the
  number of parameters. Raises CheckpointError: unreadable data, or checksums.json exists already."""
  p = _check_dir(path)
  if (p / CHECKSUMS_FILE).exists():
    raise CheckpointError(f"{p / CHECKSUMS_FILE} exists already (verify it instead)")
  stored = stored_parameters(p)
  entries = {}
  for group in _pieces(stored):
    for name, arr in _read_named(p, stored, group).items():
      entries[name] = checksum_entry(arr)
  write_checksums_file(p, entries, {name: file_entry(p / name) for name in carried_files(p)})
  return len(entries)


def carried_files(path: str | os.PathLike) -> list[str]:
  """The files checkpoint `path` holds besides config.json, checksums.json and params/ (relative paths,
  sorted): its tokenizer (tokenizer.model, tokenizer/...) and hf_config.json."""
  p = pathlib.Path(path)
  skip = {CONFIG_FILE, CHECKSUMS_FILE, PARAMS_DIR}
  return sorted(f.relative_to(p).as_posix() for f in p.rglob("*")
                if f.is_file() and f.relative_to(p).parts[0] not in skip)


def _pieces(stored: dict):
  """Stored parameter names in consecutive groups of at most SCAN_PIECE_BYTES (a larger one alone)."""
  group, size = [], 0
  for name, (shape, dtype) in stored.items():
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if group and size + n > SCAN_PIECE_BYTES:
      yield group
      group, size = [], 0
    group.append(name)
    size += n
  if group:
    yield group


def _root_cause(e: BaseException) -> BaseException:
  """The innermost exception of `e`'s `__cause__` / `__context__` chain (Orbax wraps TensorStore's
  error, which names the file and the byte range, in a generic Exception)."""
  seen = {id(e)}
  while True:
    nxt = e.__cause__ or e.__context__
    if nxt is None or id(nxt) in seen:
      return e
    seen.add(id(nxt))
    e = nxt


def _read_error(path: pathlib.Path, e: BaseException) -> CheckpointError:
  """One-line CheckpointError for an Orbax load of `path/params` that raised `e`: the first line of
  the root cause (TensorStore's status, e.g. `OUT_OF_RANGE: ... not valid for value of size 1000`),
  never the multi-line TensorStore spec Orbax's own message embeds."""
  cause = _root_cause(e)
  lines = str(cause).strip().splitlines()
  first = f"{type(cause).__name__}: {lines[0] if lines else ''}".rstrip(": ")
  if "RESOURCE_EXHAUSTED" in first or isinstance(cause, MemoryError):
    what = "not enough memory to restore params/"
  elif "PERMISSION_DENIED" in first or isinstance(cause, PermissionError):
    what = "params/ is not readable"
  else:
    what = "params/ is corrupt or truncated"
  return CheckpointError(f"load_parameters_path={os.fspath(path)}: {what} ({first})")


def _default_sharding():
  return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _abstract_leaf(x, sharding):
  if isinstance(x, nnx.Variable):
    x = x.get_value()
  sharding = sharding or getattr(x, "sharding", None) or _default_sharding()
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def restore_parameters(path: str | os.PathLike, abstract_state, shardings=None):
  """Reads a checkpoint's parameters into arrays of the given shapes, dtypes and shardings.

  Args:
    path: the checkpoint directory (holding params/).
    abstract_state: what to restore: an `nnx.State` (e.g. `nnx.state(nnx.eval_shape(...))`) or the
      pure nested dict, whose leaves are `jax.ShapeDtypeStruct` / arrays. Every stored parameter
      must appear with the same shape; the dtype is the target's (stored values are cast).
    shardings: None, or a pytree of `jax.sharding.Sharding` matching the pure dict of
      `abstract_state`. Default: each leaf's own `.sharding` if it has one, else the first local
      device. With a `NamedSharding` each host reads only the chunks of its shards.

  Returns:
    The same kind as `abstract_state` (an nnx.State or a pure dict) holding `jax.Array`s.

  Raises:
    CheckpointError: missing checkpoint, a parameter missing from / unexpected in the checkpoint,
      a shape mismatch (each named), or unreadable array data (one line: `load_parameters_path=DIR:
      params/ is corrupt or truncated (...)`). The asyncio noise of Orbax's abandoned reads after
      such a failure is dropped (`orbax_logs.quiet_orphaned_reads`).
  """
  p = _check_dir(path)
  as_state = isinstance(abstract_state, nnx.State)
  pure = nnx.to_pure_dict(abstract_state) if as_state else abstract_state
  if shardings is None:
    target = jax.tree.map(lambda x: _abstract_leaf(x, None), pure, is_leaf=lambda x: isinstance(x, nnx.Variable))
  else:
    target = jax.tree.map(_abstract_leaf, pure, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
  _check_matches(p, stored_parameters(p), flatten(target))
  try:
    with quiet_orphaned_reads(p / PARAMS_DIR):
      restored = _ocp().load(p / PARAMS_DIR, target)
  except Exception as e:
    raise _read_error(p, e) from None
  if not as_state:
    return restored
  state = jax.tree.map(lambda x: x, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  nnx.replace_by_pure_dict(state, restored)
  return state


class CheckpointMismatchError(CheckpointError):
  """A readable checkpoint whose parameters (names or shapes) are not the model's: a config of another
  architecture, not a damaged checkpoint."""


def _check_matches(path, stored: dict, wanted: dict) -> None:
  missing = sorted(set(wanted) - set(stored))
  unexpected = sorted(set(stored) - set(wanted))
  if missing or unexpected:
    parts = []
    if missing:
      parts.append(f"{len(missing)} model parameter(s) missing from the checkpoint, e.g. {missing[:3]}")
    if unexpected:
      parts.append(f"{len(unexpected)} checkpoint parameter(s) the model does not have, e.g. {unexpected[:3]}")
    raise CheckpointMismatchError(f"{path}: the checkpoint does not match the model: {'; '.join(parts)} (was "
                                  f"the config overridden with a different architecture?)")
  for name, leaf in wanted.items():
    if tuple(stored[name][0]) != tuple(leaf.shape):
      raise CheckpointMismatchError(f"{path}: parameter {name} is stored with shape {stored[name][0]} but the "
                                    f"model expects {tuple(leaf.shape)} (was the config overridden with other "
                                    f"dimensions?)")
