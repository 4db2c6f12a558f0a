"""Atomic file output shared by the tools: a temporary file in the target's directory, renamed over
the target when complete, with the permissions a plain `open(path, "w")` would give."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading

_umask_lock = threading.Lock()


def default_mode() -> int:
  """0o666 masked by the process umask: the mode `open()` gives a new file (e.g. 0o644 under umask
  022). Python has no umask getter; `os.umask` is set and restored at once (under a lock)."""
  with _umask_lock:
    mask = os.umask(0o022)
    os.umask(mask)
  return 0o666 & ~mask


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, mode: str = "w", **open_kwargs):
  """Yields a file object open on a hidden temporary sibling of `path` (`mode` "w" or "wb"); when
  the block succeeds the file gets `default_mode()` permissions (mkstemp creates 0o600) and is
  renamed over `path`; on any exception it is removed and `path` is untouched.

  Raises:
    ValueError: `mode` is not "w" / "wb". OSError: the directory is not writable (nothing is left).
  """
  if mode not in ("w", "wb"):
    raise ValueError(f"atomic_writer: mode must be 'w' or 'wb', got {mode!r}")
  path = os.fspath(path)
  fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                             dir=os.path.dirname(os.path.abspath(path)))
  try:
    with os.fdopen(fd, mode, **open_kwargs) as f:
      yield f
      os.fchmod(f.fileno(), default_mode())
    os.replace(tmp, path)
  except BaseException:
    if os.path.lexists(tmp):
      os.unlink(tmp)
    raise
