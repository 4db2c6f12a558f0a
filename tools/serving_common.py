"""Plumbing shared by `tools.generate` and `tools.perplexity`: argument handling, model and tokenizer
loading, the one-line error contract and atomic JSON output.

Error contract: every expected failure (bad key or value, missing checkpoint or tokenizer, unreadable
or malformed input) is raised as one of `EXPECTED_ERRORS`; `run_tool` prints it as a single
`error: ...` line on stderr and exits with status 2, with no traceback and no partial output file.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
from collections.abc import Callable, Sequence

from configs import base
from model.config import ConfigError, apply_overrides
from model.input_pipeline import DataFormatError
from model.registry import UnknownBackendError
from model.scoring import ScoringError
from model.serving import GenerationError
from model.tokenizer import TokenizerError, check_tokenizer_fits, load_tokenizer
from tools.atomic_file import atomic_writer


class UsageError(ValueError):
  """A command line that names no or contradictory inputs (the message names the keys)."""


def _checkpoint_error():
  from model.checkpointing import CheckpointError
  return CheckpointError


EXPECTED_ERRORS = (UsageError, ConfigError, DataFormatError, GenerationError, TokenizerError, FileNotFoundError,
                   IsADirectoryError, UnknownBackendError, ScoringError)


def parse_args(argv: Sequence[str]) -> tuple[list[str], object]:
  """Checks `key=value` arguments against configs/base.py.

  Returns:
    `(overrides, tool_config)`: the override strings (for the checkpoint's config) and the base
    config with them applied (tool keys such as `prompt` are read from it, never from the
    checkpoint's stored config).

  Raises:
    UsageError: a positional model-config name (the model comes from the checkpoint) or a missing
      load_parameters_path. ConfigError: an unknown key or a value of the wrong type.
  """
  argv = list(argv)
  if argv and "=" not in argv[0]:
    raise UsageError(f"got {argv[0]!r}: the model config comes from the checkpoint (load_parameters_path=DIR); "
                     f"write every setting as key=value (see --help)")
  cfg = apply_overrides(base.get_config(), argv)
  if not cfg.load_parameters_path:
    raise UsageError("load_parameters_path is required: the checkpoint directory to serve (a converted or "
                     "trained checkpoint with config.json and params/)")
  return argv, cfg


def given_keys(argv: Sequence[str]) -> set[str]:
  """Keys written on the command line (so `prompt=` given empty differs from no prompt at all)."""
  return {a.split("=", 1)[0].strip().lstrip("-") for a in argv if "=" in a}


def read_model_config(tool_config, overrides: Sequence[str], extra: Sequence[str] = ()):
  """The checkpoint's config with the command-line overrides (then `extra`) applied, read from
  config.json alone (no parameters restored, nothing compiled): for checks that must come before the
  model loads. Raises CheckpointError / ConfigError."""
  from model.checkpointing import read_config
  path = os.path.abspath(tool_config.load_parameters_path)
  return read_config(path, list(overrides) + [f"load_parameters_path={path}"] + list(extra))


def load(tool_config, overrides: Sequence[str], extra: Sequence[str] = ()):
  """`(model, model_config)`: the checkpoint's config with the command-line overrides (then
  `extra`) applied, and its parameters. Raises CheckpointError / ConfigError."""
  from model.checkpointing import load_model
  # Absolute path: Orbax refuses relative checkpoint paths.
  path = os.path.abspath(tool_config.load_parameters_path)
  return load_model(path, list(overrides) + [f"load_parameters_path={path}"] + list(extra))


# The mesh belongs to the job, not to the checkpoint: these keys come from the command line (or the
# base defaults), whatever the run that wrote the checkpoint used.
_JOB_KEYS = ("ici_data_parallelism", "ici_fsdp_parallelism", "ici_expert_parallelism", "ici_tensor_parallelism",
             "logical_axis_rules", "distributed_init", "coordinator_address", "num_processes", "process_id")


def load_on_mesh(tool_config, overrides: Sequence[str], extra: Sequence[str] = ()):
  """`(model, model_config, mesh)`: as `load`, but when the job has more than one device the
  parameters are restored straight into their shardings on the mesh of the `ici_*_parallelism` keys
  (`model.sharding`; multi-host jobs start with `distributed_init=true`). `mesh` is None on one
  device. Raises CheckpointError / ConfigError (e.g. a mesh that does not fit the devices)."""
  import jax
  from model import checkpointing, sharding
  path = os.path.abspath(tool_config.load_parameters_path)
  job = [f"{k}={_as_override(tool_config[k])}" for k in _JOB_KEYS]
  keys = job + list(overrides) + [f"load_parameters_path={path}"] + list(extra)
  stored = checkpointing.read_config(path, keys)
  sharding.initialize_distributed(stored)  # before any device is touched
  if sharding.job_mesh(stored) is None:  # one device; an impossible mesh fails here, before the load
    return (*checkpointing.load_model(path, keys), None)
  return sharding.load_sharded(path, keys)


def _as_override(value) -> str:
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, (list, tuple)):
    return "[" + ",".join(map(str, value)) + "]"
  return str(value)


def tokenizer_for(model_config, *, required_for: str | None = None):
  """The tokenizer of `model_config.tokenizer_path`, or an ids-only one when it is empty.

  Raises:
    TokenizerError: a missing or invalid file, one that does not fit the model (more pieces than
      vocab_size, bos/eos/pad ids unlike the config's: `check_tokenizer_fits`); or no tokenizer
      when `required_for` names a use that needs text.
  """
  path = model_config.tokenizer_path
  if not path and required_for:
    raise TokenizerError(f"{required_for} needs a tokenizer: pass tokenizer_path=FILE (the checkpoint has none)")
  vocab = int(model_config.vocab_size)
  special = lambda i: int(i) if 0 <= int(i) < vocab else None
  tok = load_tokenizer(path or None, vocab_size=vocab, bos_id=special(model_config.bos_token_id),
                       eos_id=special(model_config.eos_token_id), pad_id=special(model_config.pad_token_id))
  if path:
    check_tokenizer_fits(tok, model_config, name=f"tokenizer_path={path!r}")
  return tok


def check_output_path(path: str | os.PathLike, key: str = "output_json", *, overwrite: bool = False) -> pathlib.Path:
  """The parent directory of output file `path` (the value of `key`), checked before any work.

  Args:
    path: the output file. key: the argument that named it (for the message). overwrite: accept an
      existing file at `path` (it is replaced when the tool writes); the `overwrite=true` key.

  Raises:
    UsageError naming `key`: the parent directory does not exist, `path` is a directory, or `path`
      exists and `overwrite` is false (tools.convert_checkpoint's rule for its output, too).
  """
  path = pathlib.Path(path)
  parent = path.parent if str(path.parent) else pathlib.Path(".")
  if not parent.is_dir():
    raise UsageError(f"{key}={str(path)!r}: directory {str(parent)!r} does not exist")
  if path.is_dir():
    raise UsageError(f"{key}={str(path)!r} is a directory; expected a file path")
  if not overwrite and (path.exists() or path.is_symlink()):
    raise UsageError(f"{key}={str(path)!r} already exists; pass overwrite=true to replace it")
  return parent


def write_json_atomic(path: str | os.PathLike, data, key: str = "output_json", *, overwrite: bool = False) -> None:
  """Writes `data` as JSON to `path` through a temporary file in the same directory, then renames it
  (readers never see a half-written file; NaN/infinite floats are written as null). The file gets
  the permissions of a plain `open()` (0o666 less the umask).

  Raises:
    UsageError: the parent directory does not exist, `path` is a directory, or `path` exists and
      `overwrite` is false (see `check_output_path`; tools call that first, before any work, and this
      checks again: a file that appeared meanwhile is not replaced without overwrite).
  """
  check_output_path(path, key, overwrite=overwrite)
  path = pathlib.Path(path)
  with atomic_writer(path) as f:  # the umask's mode, as a plain open() gives (not mkstemp's 0600)
    json.dump(_finite(data), f, indent=1, allow_nan=False)
    f.write("\n")


def _finite(data):
  """`data` with every NaN / infinite float replaced by None: JSON has no NaN (a strict reader rejects it)."""
  if isinstance(data, float):
    return data if math.isfinite(data) else None
  if isinstance(data, dict):
    return {k: _finite(v) for k, v in data.items()}
  if isinstance(data, (list, tuple)):
    return [_finite(v) for v in data]
  return data


def out_of_memory(e: BaseException) -> str | None:
  """The first line of `e` when it is XLA's RESOURCE_EXHAUSTED (an allocation the device, or the host
  on CPU, cannot make: e.g. "RESOURCE_EXHAUSTED: Out of memory allocating 2662825103120 bytes."),
  else None."""
  import jax
  if isinstance(e, jax.errors.JaxRuntimeError) and str(e).lstrip().startswith("RESOURCE_EXHAUSTED"):
    return str(e).strip().splitlines()[0]
  return None


def out_of_memory_message(e: BaseException, advice: str | None = None) -> str | None:
  """`out of memory (<XLA's first line>): <advice>` when `e` is XLA's RESOURCE_EXHAUSTED
  (`out_of_memory`), else None. The one wording every tool prints after `error: ` (run_tool for
  generate/perplexity, tools.train, tools.convert_checkpoint); `advice` says what to change, e.g.
  `lower batch_size or seq_len` (omitted when None or empty)."""
  oom = out_of_memory(e)
  if oom is None:
    return None
  return f"out of memory ({oom})" + (f": {advice}" if advice else "")


def run_tool(main: Callable[[list[str]], int], doc: str, argv: Sequence[str] | None = None, *,
             memory_keys: str | None = None) -> int:
  """Runs `main(argv)` with `--help` and the one-line error contract; returns the exit status.

  Expected errors (`EXPECTED_ERRORS`, CheckpointError, a missing backend module) print one `error:`
  line and give 2; so does XLA's RESOURCE_EXHAUSTED, as `error: out of memory (<XLA's first line>):
  lower <memory_keys>`, where `memory_keys` (default: the tool module's `MEMORY_KEYS`) names the
  keys that size the computation. Ctrl-C prints `interrupted` on a line of its own and gives 130.
  """
  if memory_keys is None:
    memory_keys = getattr(sys.modules.get(getattr(main, "__module__", ""), None), "MEMORY_KEYS", None)
  argv = list(sys.argv[1:] if argv is None else argv)
  if any(a in ("-h", "--help", "help") for a in argv):
    print(doc.strip())
    return 0
  try:
    return main(argv)
  except EXPECTED_ERRORS + (_checkpoint_error(),) as e:
    msg = str(e) or type(e).__name__
    print(f"error: {msg}", file=sys.stderr)
    return 2
  except ImportError as e:  # an attention backend whose op is not installed on this machine
    print(f"error: a module the chosen attention backend needs is missing ({e}); try another attention=",
          file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    return 130
  except Exception as e:
    msg = out_of_memory_message(e, f"lower {memory_keys}" if memory_keys else None)
    if msg is None:
      raise
    print(f"error: {msg}", file=sys.stderr)
    return 2
