"""The one base class of every error a user can cause and fix (a bad key, value, file or checkpoint).

Every tool prints a `UserError` as a single `error: <message>` line on stderr and exits with status 2
(`tools/cli.py`); anything else is a bug and keeps its traceback. Each layer raises its own subclass
(`ConfigError`, `CheckpointError`, `DataFormatError`, ...), whose message names the argument, file or
key at fault and what was expected. The subclasses also derive from `ValueError` (via this base), so
code that caught `ValueError` before keeps working.
"""

from __future__ import annotations

import sys


class UserError(ValueError):
  """Bad input from the user: the message names what is wrong and what was expected."""


class UsageError(UserError):
  """A command line that names no, or contradictory, inputs (the message names the keys)."""


class ConfigError(UserError):
  """A configuration that cannot be loaded or does not describe a valid model (or mesh)."""


class CheckpointError(UserError):
  """A checkpoint that is missing, incomplete, corrupt, or does not match the model; or an output
  path that already exists. The message names the path (and the parameter, when one is at fault)."""


def out_of_memory(e: BaseException) -> str | None:
  """The first line of `e` when it is XLA's RESOURCE_EXHAUSTED (an allocation the device, or the host
  on CPU, cannot make: e.g. "RESOURCE_EXHAUSTED: Out of memory allocating 2662825103120 bytes."),
  else None."""
  jax = sys.modules.get("jax")  # not imported here: without jax loaded, `e` cannot be an XLA error
  if jax is not None and isinstance(e, jax.errors.JaxRuntimeError) and str(e).lstrip().startswith("RESOURCE_EXHAUSTED"):
    return str(e).strip().splitlines()[0]
  return None


def out_of_memory_message(e: BaseException, advice: str | None = None) -> str | None:
  """`out of memory (<XLA's first line>): <advice>` when `e` is XLA's RESOURCE_EXHAUSTED
  (`out_of_memory`), else None: the one wording every tool prints after `error: `; `advice` says
  what to change, e.g. `lower batch_size or seq_len` (omitted when None or empty)."""
  oom = out_of_memory(e)
  if oom is None:
    return None
  return f"out of memory ({oom})" + (f": {advice}" if advice else "")
