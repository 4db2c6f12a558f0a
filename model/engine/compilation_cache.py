"""JAX's persistent compilation cache for the serving tools: a restart loads its executables from disk.

On the lent TPU v5e one engine step of the 0.9B test model compiles in 12-35 s and loads from this
cache in 3-4 s (issue 35), so a server's second start skips nearly all of its start-up compilation.

The directory (`compilation_cache_dir`, a job key of configs/base.py; `--compilation-cache-dir` in the
benchmarks) is resolved by `resolve_dir`:
  - "" (the default): $KDA_COMPILATION_CACHE_DIR when set, else `DEFAULT_DIR`
    (~/.cache/kda_plugin/jax, under $XDG_CACHE_HOME when that is set);
  - "none" / "off": no persistent cache (every start compiles);
  - anything else: that directory (created when missing).
An explicit `JAX_COMPILATION_CACHE_DIR` (jax's own variable) is respected as it is: `enable` then
leaves jax's setting alone.

Thresholds: jax writes an entry only when its compilation took at least
`jax_persistent_cache_min_compile_time_secs` (default 1 s) and is at least
`jax_persistent_cache_min_entry_size_bytes` (default 0). `enable` sets the time threshold to
`MIN_COMPILE_TIME_S` (0: every engine executable is written, also the sub-second ones of a small
model on a CPU, so that a restart finds all of them) and the size threshold to 0.

The cache is trusted code: do not share its directory with users you do not trust (jax's warning).
Entries are keyed by the program, the compile options, the jax/jaxlib version and the device kind,
so one directory serves several models and machines; it is never pruned here (delete the directory
to reclaim the space).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import threading

import jax

from model.errors import UsageError

ENV = "KDA_COMPILATION_CACHE_DIR"
OFF = ("none", "off", "false", "0")
MIN_COMPILE_TIME_S = 0.0
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_MISS_EVENT = "/jax/compilation_cache/cache_misses"
_REQUEST_EVENT = "/jax/compilation_cache/compile_requests_use_cache"


def default_dir() -> pathlib.Path:
  """~/.cache/kda_plugin/jax ($XDG_CACHE_HOME/kda_plugin/jax when XDG_CACHE_HOME is set)."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "kda_plugin" / "jax"


def resolve_dir(value: str | None) -> pathlib.Path | None:
  """The cache directory `value` names (see the module docstring), or None for "off"."""
  value = (value or "").strip()
  if not value:
    value = os.environ.get(ENV, "").strip()
    if not value:
      return default_dir()
  if value.lower() in OFF:
    return None
  return pathlib.Path(os.path.expanduser(value)).absolute()


def enable(value: str | None = "") -> str:
  """Turns jax's persistent compilation cache on in the directory `value` names (`resolve_dir`), or
  off for "none"; call it before the first compilation of the process. Returns a one-line
  description for a start-up log ("compilation cache: DIR" or "... off").

  Raises:
    UsageError: the directory cannot be created or written (names `compilation_cache_dir`).
  """
  if os.environ.get("JAX_COMPILATION_CACHE_DIR") and not (value or "").strip():
    path = pathlib.Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
  else:
    path = resolve_dir(value)
  if path is None:
    jax.config.update("jax_enable_compilation_cache", False)
    _reset()
    return "compilation cache: off (every start compiles)"
  try:
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".probe-{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()
  except OSError as e:
    raise UsageError(f"compilation_cache_dir={str(path)!r}: cannot write there ({e.strerror or e}); "
                     f"give another directory, or compilation_cache_dir=none to turn the cache off") from None
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  _reset()
  return f"compilation cache: {path}"


def _reset() -> None:
  """Makes jax read the settings again (it reads them once, at the first compilation)."""
  try:
    from jax._src import compilation_cache as cc   # noqa: PLC0415  (private; present in 0.10.2 and 0.12)
  except ImportError:   # pragma: no cover
    return
  cc.reset_cache()


def directory() -> str | None:
  """The directory jax writes entries to now, or None when the persistent cache is off."""
  if not jax.config.jax_enable_compilation_cache:
    return None
  return jax.config.jax_compilation_cache_dir or None


class _Events:
  """Per-thread counts of jax's persistent-cache events (jax records them in the compiling thread)."""

  def __init__(self):
    self.local = threading.local()
    self.lock = threading.Lock()
    self.installed = False

  def listener(self, event: str, **kwargs) -> None:
    counts = getattr(self.local, "counts", None)
    if counts is not None and event in (_HIT_EVENT, _REQUEST_EVENT):
      counts[event] = counts.get(event, 0) + 1

  def install(self) -> None:
    with self.lock:
      if not self.installed:
        jax.monitoring.register_event_listener(self.listener)
        self.installed = True


_EVENTS = _Events()


@contextlib.contextmanager
def watch():
  """`with watch() as seen:` counts, for compilations in this thread inside the block, how many went
  through the persistent cache (`seen["requests"]`) and how many were loaded from it (`seen["hits"]`)."""
  _EVENTS.install()
  counts: dict = {}
  previous = getattr(_EVENTS.local, "counts", None)
  _EVENTS.local.counts = counts
  seen = {"requests": 0, "hits": 0}
  try:
    yield seen
  finally:
    seen["requests"] = counts.get(_REQUEST_EVENT, 0)
    seen["hits"] = counts.get(_HIT_EVENT, 0)
    _EVENTS.local.counts = previous
