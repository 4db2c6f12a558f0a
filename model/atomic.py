"""Atomic output: a file or a directory appears whole at its path, or not at all.

`atomic_writer` (one file) and `atomic_directory` (a directory, e.g. a checkpoint) write into a
hidden temporary sibling of the target (same filesystem, so the final rename is atomic) and rename
it into place only when the block succeeds; on any exception the sibling is removed and the target
is untouched.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile
import threading
import uuid

from model.errors import CheckpointError

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


def remove_tree(path: pathlib.Path | None) -> None:
  """rm -rf `path` if it exists (no error when it does not)."""
  if path is not None and (path.exists() or path.is_symlink()):
    if path.is_dir() and not path.is_symlink():
      shutil.rmtree(path, ignore_errors=True)
    else:
      path.unlink()


def _check_creatable(path: pathlib.Path) -> None:
  """CheckpointError unless a directory can be made where `path` will be (its nearest existing
  ancestor is a directory in which a temporary directory can be created), before any work."""
  ancestor = path.absolute().parent
  while not ancestor.exists():
    ancestor = ancestor.parent
  if not ancestor.is_dir():
    raise CheckpointError(f"output_path {os.fspath(path)!r}: {os.fspath(ancestor)!r} is a file, not a directory")
  try:
    os.rmdir(tempfile.mkdtemp(dir=ancestor, prefix=".kda-write-check-"))
  except OSError as e:
    raise CheckpointError(f"output_path {os.fspath(path)!r}: cannot create a directory in "
                          f"{os.fspath(ancestor)!r} ({e.strerror or e})") from None


def check_writable(path: str | os.PathLike, overwrite: bool, replaceable, what: str) -> None:
  """Raises CheckpointError unless `path` is absent, or overwrite is set and `path` is an empty
  directory or one that `replaceable(path)` accepts (never a file or someone else's directory)."""
  path = pathlib.Path(path)
  if not path.exists() and not path.is_symlink():
    _check_creatable(path)
    return
  if not overwrite:
    raise CheckpointError(f"output_path {os.fspath(path)!r} already exists; pass overwrite=true to replace it")
  if path.is_dir() and not path.is_symlink() and (not any(path.iterdir()) or replaceable(path)):
    return
  raise CheckpointError(f"output_path {os.fspath(path)!r} exists and is not {what} directory; refusing to "
                        f"replace it even with overwrite (remove it yourself)")


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, overwrite: bool, replaceable, what: str):
  """Yields an empty temporary directory that becomes `path` when the block succeeds.

  The temporary directory is a hidden sibling of `path` (same filesystem, so the final `os.rename`
  is atomic). On any exception it is removed and `path` is untouched. With `overwrite`, an existing
  `path` that `replaceable` accepts (or an empty directory) is moved aside, replaced, then deleted.

  Raises:
    CheckpointError: `path` exists and may not be replaced (checked before and after the block).
  """
  path = pathlib.Path(path).absolute()
  check_writable(path, overwrite, replaceable, what)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:12]}"
  tmp.mkdir()
  try:
    yield tmp
    old = None
    if path.exists():
      check_writable(path, overwrite, replaceable, what)  # someone may have created it meanwhile
      old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:12]}"
      os.rename(path, old)
    try:
      os.rename(tmp, path)
    except OSError:
      if old is not None:
        os.rename(old, path)
      raise
    remove_tree(old)
  finally:
    remove_tree(tmp)
