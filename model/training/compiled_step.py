"""A train step compiled ahead of time, in a file: written by `kda-aot-compile ... mode=train
compiled_trainstep_file=PATH`, run by `kda-train ... compiled_trainstep_file=PATH` (MaxText's key).

A large model's step compiles for minutes (the 0.4B test model: about six on one core); libtpu compiles
it as well on a CPU host for the target's topology (`model.aot`), and the chip's job then loads the
executable in seconds. The file holds the serialized executable (`jax.experimental.serialize_executable`)
and what it was compiled for: jax and jaxlib versions, device kind and count, mesh, and every config
key that shapes the step (`program_config`). Loading checks all of them against the run, so a file
never runs a program other than the one the run would compile; jax checks the arguments' shapes and
dtypes at the first call.

Format (FORMAT 1): MAGIC, the header's length (8 bytes, little-endian), the header as UTF-8 JSON (read
and checked without touching the rest), then the executable: an lzma-compressed pickle of
{"payload", "in_tree", "out_tree"} (the 0.4B step: 412 MB of executable, 33 MB in the file; lzma
takes about three minutes to write it and seconds to read it). Like jax's persistent compilation
cache, the executable is code: load only files you made or trust.
"""

from __future__ import annotations

import json
import lzma
import os
import pathlib
import pickle
import struct
import tempfile

import jax
import jaxlib

from model.errors import UsageError

FORMAT = 1
MAGIC = b"kda_plugin compiled train step\n"
KEY = "compiled_trainstep_file"

# Config keys that do not shape the train step's program (data, run directory, logging, evaluation,
# export, initialisation, loading, and the other tools' keys): they may differ between the compile
# and the run. Every other key must be equal.
NOT_IN_THE_STEP = frozenset({
    KEY, "model_name", "init_seed", "train_seed", "data_seed", "load_parameters_path", "tokenizer_path",
    "allow_non_finite", "verify_checksums", "allow_large_model", "compilation_cache_dir",
    "train_data", "train_data_format", "heldout_fraction", "split_long", "output_dir", "checkpoint_every",
    "checkpoint_keep", "resume", "stop_at_step", "eval_every", "eval_batch_size", "eval_max_windows",
    "log_every", "export_every", "export_dtype", "output_json", "overwrite",
    "distributed_init", "coordinator_address", "num_processes", "process_id",
    # tools.generate, tools.perplexity, tools.serve
    "prompt", "prompts_file", "prompt_ids", "chat", "system", "messages", "messages_file", "max_new_tokens",
    "decode_sampling_strategy", "decode_sampling_temperature", "decode_sampling_top_k",
    "decode_sampling_nucleus_p", "seed", "decode_stop_at_eos", "generate_add_bos", "generate_batch_size",
    "prefill_length_multiple", "eval_data", "eval_format", "max_target_length", "eval_add_bos",
    "eval_add_eos", "compare_attention", "compare_tolerance", "dump_logprobs", "engine", "max_num_seqs",
    "max_model_len", "max_num_batched_tokens", "max_num_partial_prefills", "max_waiting",
    "prefix_cache_bytes", "min_bucket_tokens", "host", "port", "uds", "max_cache_length",
})


def program_config(cfg) -> dict:
  """The config keys that shape the train step (all but `NOT_IN_THE_STEP`), as plain values."""
  return {k: _plain(v) for k, v in sorted(cfg.items()) if k not in NOT_IN_THE_STEP}


def _plain(v):
  if isinstance(v, (list, tuple)):
    return [_plain(x) for x in v]
  return v


def header(cfg, device_kind: str, num_devices: int, mesh: dict) -> dict:
  """What a step is compiled for: checked by `load` against the run."""
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "device_kind": device_kind,
          "num_devices": int(num_devices), "mesh": {a: int(s) for a, s in mesh.items()},
          "config": program_config(cfg)}


def save(path, compiled, head: dict, *, overwrite: bool = False) -> int:
  """Writes `compiled` (a `jax.stages.Compiled` of the train step) with `head` to `path` atomically
  (a temporary file beside it, then a rename: a failed write leaves nothing). Returns the bytes written.

  Raises:
    UsageError: `path` exists and not `overwrite`, or its directory does not exist.
  """
  from jax.experimental.serialize_executable import serialize  # noqa: PLC0415  (jax's, only when writing)
  path = pathlib.Path(path)
  if path.exists() and not overwrite:
    raise UsageError(f"{KEY}={path} exists: pass overwrite=true to replace it, or another path")
  if not path.parent.is_dir():
    raise UsageError(f"{KEY}={path}: directory {path.parent} does not exist")
  payload, in_tree, out_tree = serialize(compiled)
  body = lzma.compress(pickle.dumps({"payload": payload, "in_tree": in_tree, "out_tree": out_tree},
                                    protocol=pickle.HIGHEST_PROTOCOL))
  text = json.dumps({"format": FORMAT, **head}, sort_keys=True).encode()
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(MAGIC + struct.pack("<Q", len(text)) + text + body)
    os.replace(tmp, path)
  except BaseException:
    pathlib.Path(tmp).unlink(missing_ok=True)
    raise
  return len(MAGIC) + 8 + len(text) + len(body)


def read(path) -> dict:
  """The file's header (`header`'s dict, with "format"), without reading the executable.

  Raises:
    UsageError: no such file, or not a compiled train step of this FORMAT.
  """
  path = pathlib.Path(path)
  if path.is_dir():
    raise UsageError(f"{KEY}={path} is a directory: expected a file written by kda-aot-compile ... mode=train {KEY}=FILE")
  if not path.is_file():
    raise UsageError(f"{KEY}={path}: no such file (write one with kda-aot-compile ... mode=train {KEY}={path})")
  with open(path, "rb") as f:
    magic = f.read(len(MAGIC))
    size = f.read(8)
    if magic != MAGIC or len(size) != 8:
      raise UsageError(f"{KEY}={path} is not a compiled train step (written by kda-aot-compile ... mode=train "
                       f"{KEY}=...)")
    length = struct.unpack("<Q", size)[0]
    if length > path.stat().st_size:   # a damaged length: never read (or allocate) more than the file
      raise UsageError(f"{KEY}={path} is not a compiled train step: its header length {length} exceeds the file")
    try:
      head = json.loads(f.read(length))
    except ValueError as e:   # a truncated file
      raise UsageError(f"{KEY}={path} is not a compiled train step: its header does not parse ({e})") from None
  if not isinstance(head, dict) or head.get("format") != FORMAT:
    got = head.get("format") if isinstance(head, dict) else type(head).__name__
    raise UsageError(f"{KEY}={path} is a compiled train step of format {got!r}, not {FORMAT}: compile it again")
  kinds = {"jax": str, "jaxlib": str, "device_kind": str, "num_devices": int, "mesh": dict, "config": dict}
  bad = [k for k, kind in kinds.items() if not isinstance(head.get(k), kind)]
  if bad:
    raise UsageError(f"{KEY}={path} is not a compiled train step: its header lacks or mistypes {', '.join(bad)}")
  return head


def check(path, head: dict, want: dict) -> None:
  """Refuses a file compiled for something else than this run (`want`, a `header` of the run).

  Raises:
    UsageError: names the file and each difference (up to six keys), and what to do.
  """
  diffs = [f"{k} (file {head[k]!r}, this run {want[k]!r})" for k in ("jax", "jaxlib", "device_kind",
                                                                       "num_devices", "mesh") if head[k] != want[k]]
  a, b = head["config"], want["config"]
  keys = sorted(set(a) | set(b))
  diffs += [f"{k}={a.get(k)!r} in the file, {b.get(k)!r} in this run" for k in keys if a.get(k) != b.get(k)]
  if diffs:
    more = f" and {len(diffs) - 6} more" if len(diffs) > 6 else ""
    raise UsageError(f"{KEY}={path} was compiled for another step: " + "; ".join(diffs[:6]) + more
                     + f"; compile it again with this run's keys (kda-aot-compile ... mode=train {KEY}=...) "
                     f"or drop {KEY}")


def deserialize(path, device_kind: str):
  """The executable in the file at `path` loaded on this process's devices: called as the jitted step
  is, `(state, inputs, targets, loss_mask, segment_ids) -> (new_state, metrics)`.

  Raises:
    UsageError: the executable is damaged, or jax could not load it here (its message).
  """
  from jax.experimental.serialize_executable import deserialize_and_load  # noqa: PLC0415  (only when loading)
  with open(path, "rb") as f:
    f.seek(len(MAGIC))
    f.seek(struct.unpack("<Q", f.read(8))[0], os.SEEK_CUR)
    try:
      data = pickle.loads(lzma.decompress(f.read()))
    except (lzma.LZMAError, EOFError, pickle.UnpicklingError) as e:   # truncated or damaged
      raise UsageError(f"{KEY}={path}: the executable is damaged ({type(e).__name__}: {e})") from None
  try:
    return deserialize_and_load(data["payload"], data["in_tree"], data["out_tree"])
  except Exception as e:  # XLA's own error: the executable does not load here
    first = str(e).splitlines()[0] if str(e) else ""
    raise UsageError(f"{KEY}={path} does not load on this {device_kind}: {type(e).__name__}: {first}") from None


def load(path, want: dict):
  """`read`, `check` against `want` (the run's `header`), then `deserialize`."""
  check(path, read(path), want)
  return deserialize(path, want["device_kind"])
