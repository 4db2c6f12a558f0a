"""A train step compiled ahead of time, in a file: written by `kda-aot-compile ... mode=train
compiled_trainstep_file=PATH`, run by `kda-train ... compiled_trainstep_file=PATH` (MaxText's key).

A large model's step compiles for minutes (the 0.4B test model: about six on one core); libtpu compiles
it as well on a CPU host for the target's topology (`model.aot`), and the chip's job then loads the
executable in seconds. The file holds the serialized executable (`jax.experimental.serialize_executable`)
and what it was compiled for: jax and jaxlib versions, device kind and count, mesh, and every config
key that shapes the step (`program_config`). Loading checks all of them against the run, so a file
never runs a program other than the one the run would compile; jax checks the arguments' shapes and
dtypes at the first call.

Format: one pickle of a dict {"format", "header", "payload", "in_tree", "out_tree"} (FORMAT). Like
jax's persistent compilation cache, it is code: load only files you made or trust.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import tempfile

import jax
import jaxlib

from model.errors import UsageError

FORMAT = 1
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
  from jax.experimental.serialize_executable import serialize  # noqa: PLC0415
  path = pathlib.Path(path)
  if path.exists() and not overwrite:
    raise UsageError(f"{KEY}={path} exists: pass overwrite=true to replace it, or another path")
  if not path.parent.is_dir():
    raise UsageError(f"{KEY}={path}: directory {path.parent} does not exist")
  payload, in_tree, out_tree = serialize(compiled)
  blob = pickle.dumps({"format": FORMAT, "header": head, "payload": payload, "in_tree": in_tree,
                       "out_tree": out_tree}, protocol=pickle.HIGHEST_PROTOCOL)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(blob)
    os.replace(tmp, path)
  except BaseException:
    pathlib.Path(tmp).unlink(missing_ok=True)
    raise
  return len(blob)


def read(path) -> dict:
  """The file's dict (see the module docstring).

  Raises:
    UsageError: no such file, or not a compiled train step of this FORMAT.
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise UsageError(f"{KEY}={path}: no such file (write one with kda-aot-compile ... mode=train {KEY}={path})")
  try:
    with open(path, "rb") as f:
      data = pickle.load(f)
  except Exception as e:  # a truncated or foreign file
    raise UsageError(f"{KEY}={path} is not a compiled train step: {type(e).__name__}: {e}") from None
  if not isinstance(data, dict) or data.get("format") != FORMAT:
    got = data.get("format") if isinstance(data, dict) else type(data).__name__
    raise UsageError(f"{KEY}={path} is not a compiled train step of format {FORMAT} (got {got!r})")
  return data


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


def deserialize(path, data: dict, device_kind: str):
  """The executable of a `read` file loaded on this process's devices: called as the jitted step is,
  `(state, inputs, targets, loss_mask, segment_ids) -> (new_state, metrics)`.

  Raises:
    UsageError: jax could not load it here (its message).
  """
  from jax.experimental.serialize_executable import deserialize_and_load  # noqa: PLC0415
  try:
    return deserialize_and_load(data["payload"], data["in_tree"], data["out_tree"])
  except Exception as e:  # XLA's own error: the executable does not load here
    first = str(e).splitlines()[0] if str(e) else ""
    raise UsageError(f"{KEY}={path} does not load on this {device_kind}: {type(e).__name__}: {first}") from None


def load(path, want: dict):
  """`read`, `check` against `want` (the run's `header`), then `deserialize`."""
  data = read(path)
  check(path, data["header"], want)
  return deserialize(path, data, want["device_kind"])
