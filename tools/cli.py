"""The one command-line contract of every tool: `--help`, `key=value` arguments, one `error:` line.

- Arguments are `key=value` strings, MaxText style. Model tools check them against
  configs/base.py (`model.config`: unknown keys get the closest valid names, values are parsed
  against the key's type); the others (convert, train_tokenizer, unigram_baseline) against their own
  key list with the same closest-name hints (`parse_key_values`).
- `run_tool(main, doc)` gives every tool the same behaviour: `--help` (or `-h`, `help`) prints the
  module docstring; any `model.errors.UserError` (bad key, value, file, checkpoint, ...) and the file
  errors of a path the user named print one `error: <message>` line on stderr with exit status 2 and
  no traceback; XLA's RESOURCE_EXHAUSTED prints `error: out of memory (<XLA's first line>): lower
  <the tool's MEMORY_KEYS>` with status 2; Ctrl-C prints `interrupted` and gives 130.
- `command(main, doc)` is that, as the zero-argument function the console commands of
  pyproject.toml (`kda-generate`, `kda-train`, ...) call; `python -m tools.X` runs the same function.

Loading a checkpoint goes through `model.loading` (config.json read once, validated once), with the
job's mesh keys taken from the command line, never from the run that wrote the checkpoint.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import pathlib
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence

from configs import base
from model import loading, registry
from model.config import apply_overrides
from model.errors import UsageError, UserError, out_of_memory, out_of_memory_message
from model.atomic import atomic_writer

__all__ = ["UsageError", "UserError", "checkpoint_config", "command", "load", "out_of_memory", "out_of_memory_message",
           "parse_args", "parse_key_values", "run_tool", "tool_main"]

HELP_FLAGS = ("-h", "--help", "help")


def wants_help(argv: Sequence[str]) -> bool:
  """Whether the arguments ask for the help text."""
  return any(a in HELP_FLAGS for a in argv)


def parse_key_values(argv: Sequence[str], known: Sequence[str], error: type[Exception] = UsageError) -> dict[str, str]:
  """Parses `key=value` strings against a fixed key list (tools whose keys are not model keys).

  Args:
    argv: the arguments, e.g. `sys.argv[1:]` without `--help`; a leading `--` on a key is tolerated.
    known: the accepted keys.
    error: the exception class raised (a `UserError` subclass, printed as one `error:` line).

  Returns:
    `{key: value}` with values as written.

  Raises:
    `error`: an argument without `=`, an unknown key (naming the closest known keys), or a key given twice.
  """
  known = list(known)
  out: dict[str, str] = {}
  for a in argv:
    if "=" not in a:
      raise error(f"arguments are key=value, got {a!r} (see --help)")
    k, v = a.split("=", 1)
    k = k.strip().lstrip("-")
    if k not in known:
      close = difflib.get_close_matches(k, known, n=3)
      hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(known)}"
      raise error(f"unknown argument {k!r}; {hint} (see --help)")
    if k in out:
      raise error(f"argument {k!r} given twice")
    out[k] = v
  return out


def parse_args(argv: Sequence[str]) -> tuple[list[str], object]:
  """Checks the `key=value` arguments of a checkpoint-serving tool against configs/base.py.

  Returns:
    `(overrides, tool_config)`: the override strings (for the checkpoint's config) and the base
    config with them applied (tool keys such as `prompt` are read from it, never from the
    checkpoint's stored config).

  Raises:
    UsageError: a positional model-config name (the model comes from the checkpoint) or a missing
      load_parameters_path. ConfigError: an unknown key or a value of the wrong type.
    UnknownBackendError: `attention=` names no registered backend.
  """
  argv = list(argv)
  if argv and "=" not in argv[0]:
    raise UsageError(f"got {argv[0]!r}: the model config comes from the checkpoint (load_parameters_path=DIR); "
                     f"write every setting as key=value (see --help)")
  cfg = apply_overrides(base.get_config(), argv)
  registry.get_backend(cfg.attention)  # an unknown attention= fails now, before the checkpoint is read
  if not cfg.load_parameters_path:
    raise UsageError("load_parameters_path is required: the checkpoint directory to serve (a converted or "
                     "trained checkpoint with config.json and params/)")
  return argv, cfg


def given_keys(argv: Sequence[str]) -> set[str]:
  """Keys written on the command line (so `prompt=` given empty differs from no prompt at all)."""
  return {a.split("=", 1)[0].strip().lstrip("-") for a in argv if "=" in a}


# The mesh belongs to the job, not to the checkpoint: these keys come from the command line (or the
# base defaults), whatever the run that wrote the checkpoint used.
_JOB_KEYS = ("ici_data_parallelism", "ici_fsdp_parallelism", "ici_expert_parallelism", "ici_tensor_parallelism",
             "dcn_data_parallelism", "dcn_fsdp_parallelism", "dcn_expert_parallelism", "dcn_tensor_parallelism",
             "logical_axis_rules", "distributed_init", "coordinator_address", "num_processes", "process_id")


def checkpoint_config(tool_config, overrides: Sequence[str], extra: Sequence[str] = ()):
  """The checkpoint's config (`load_parameters_path` of `tool_config`) with the job's mesh keys, the
  command-line overrides, then `extra` applied: config.json read and validated once, no parameters
  restored. Pass it to `load` afterwards. Raises CheckpointError / ConfigError."""
  path = os.path.abspath(tool_config.load_parameters_path)
  job = [f"{k}={_as_override(tool_config[k])}" for k in _JOB_KEYS]
  return loading.read_config(path, job + list(overrides) + [f"load_parameters_path={path}"] + list(extra))


def load(model_config, extra: Sequence[str] = ()) -> loading.Loaded:
  """`loading.load` of the checkpoint `model_config` came from (`checkpoint_config`), with `extra`
  overrides (e.g. another `attention=`): config.json is not read again; on several devices the
  parameters are restored straight into their shardings on the job's mesh (`loaded.mesh` is None on
  one device). Raises CheckpointError / ConfigError."""
  cfg = apply_overrides(model_config, list(extra)) if extra else model_config
  return loading.load(cfg.load_parameters_path, config=cfg)


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
  # imported here: the tokenizer needs tiktoken, which tools run in .venv-tpu-aot (tools.tpu_cost) lack
  from model.data.tokenizer import TokenizerError, check_tokenizer_fits, load_tokenizer  # noqa: PLC0415
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
    UsageError naming `key`: the parent directory does not exist or cannot be written (a temporary
      file is tried there), `path` is a directory, or `path` exists and `overwrite` is false
      (tools.convert_checkpoint's rule for its output, too).
  """
  path = pathlib.Path(path)
  parent = path.parent if str(path.parent) else pathlib.Path(".")
  if not parent.is_dir():
    what = "is a file, not a directory" if parent.exists() else "does not exist"
    raise UsageError(f"{key}={str(path)!r}: directory {str(parent)!r} {what}")
  if path.is_dir():
    raise UsageError(f"{key}={str(path)!r} is a directory; expected a file path")
  if not overwrite and (path.exists() or path.is_symlink()):
    raise UsageError(f"{key}={str(path)!r} already exists; pass overwrite=true to replace it")
  try:  # the write goes through a temporary file in `parent`: try one now, not after the work
    with tempfile.TemporaryFile(dir=parent):
      pass
  except OSError as e:
    raise UsageError(f"{key}={str(path)!r}: cannot write in directory {str(parent)!r} "
                     f"({e.strerror or e})") from None
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


# Besides `UserError`: the OS errors of a path the user named (a missing, unreadable or directory file).
USER_OS_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


def run_tool(main: Callable[[list[str]], int], doc: str, argv: Sequence[str] | None = None, *,
             memory_keys: str | None = None, memory_advice: Callable[[], str] | None = None,
             help_text: Callable[[], str] | None = None) -> int:
  """Runs `main(argv)` with `--help` and the one-line error contract; returns the exit status.

  Args:
    main: the tool's `main(argv) -> exit status`.
    doc: the help text (the tool's module docstring). help_text: more help, computed only when asked.
    argv: the arguments (default `sys.argv[1:]`).
    memory_keys: the keys that size the computation, named when XLA runs out of memory (default:
      the tool module's `MEMORY_KEYS`); memory_advice: what to say instead of "lower <keys>".

  Returns:
    `main`'s status; 2 after a user error (one `error:` line, see the module docstring) or XLA's
    RESOURCE_EXHAUSTED; 130 after Ctrl-C.
  """
  if memory_keys is None:
    memory_keys = getattr(sys.modules.get(getattr(main, "__module__", ""), None), "MEMORY_KEYS", None)
  argv = list(sys.argv[1:] if argv is None else argv)
  if wants_help(argv):
    print(doc.strip())
    if help_text is not None:
      print(help_text())
    return 0
  # Python hides DeprecationWarning outside __main__; a renamed config key must reach the user's stderr.
  warnings.filterwarnings("default", category=DeprecationWarning, message=r"config key .* is deprecated")
  try:
    return main(argv)
  except UserError as e:
    print(f"error: {str(e) or type(e).__name__}", file=sys.stderr)
    return 2
  except USER_OS_ERRORS as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except ImportError as e:  # an attention backend whose op is not installed on this machine
    print(f"error: a module the chosen attention backend needs is missing ({e}); try another attention=",
          file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    return 130
  except Exception as e:
    advice = memory_advice() if memory_advice is not None else f"lower {memory_keys}" if memory_keys else None
    msg = out_of_memory_message(e, advice)
    if msg is None:
      raise
    print(f"error: {msg}", file=sys.stderr)
    return 2


def tool_main(run: Callable[[list[str]], int], doc: str, **kwargs) -> Callable[..., int]:
  """A tool's `main(argv=None) -> exit status`: `run_tool(run, doc, argv, **kwargs)`, where `run`
  does the work and raises on bad input (kwargs: as `run_tool`; `memory_keys` default: the
  `MEMORY_KEYS` of `run`'s module)."""
  def main(argv: Sequence[str] | None = None) -> int:
    return run_tool(run, doc, argv, **kwargs)
  main.__doc__ = doc
  main.__module__ = run.__module__
  return main


def command(main: Callable[..., int]) -> Callable[[], None]:
  """The console command of a tool (pyproject `[project.scripts]`, and `python -m tools.X`): runs
  `main()` on `sys.argv[1:]` and exits with its status (a closed stdout pipe, e.g. `| head`, ends
  it quietly)."""
  def run() -> None:
    try:
      status = main()
    except BrokenPipeError:
      status = 0
    sys.exit(status)
  run.__doc__ = main.__doc__
  return run
