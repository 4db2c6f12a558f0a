"""Attention-backend registry: register and look up backends by name.

Backends come from two places:
- explicit `register_backend(name, backend_or_factory)` calls (e.g. `kda_plugin.register()`), and
- the entry-point group `model.attention_backends` (importlib.metadata), so that an installed
  plugin works with no import in user code. Each entry point names a backend object, or a
  zero-argument factory returning one; it is loaded the first time a name is looked up.

A factory is called once; the resulting object is cached, so every module of a model shares one
backend instance per name.
"""

from __future__ import annotations

import importlib.metadata
import threading

from model.backend import AttentionBackend, check_backend
from model.errors import UserError

ENTRY_POINT_GROUP = "model.attention_backends"

_lock = threading.RLock()
_factories: dict[str, object] = {}
_instances: dict[str, object] = {}
_entry_points_loaded = False


class UnknownBackendError(UserError, KeyError):
  """An `attention=` name that no registered backend or entry point provides."""

  def __str__(self):  # KeyError would quote the message
    return self.args[0]


def register_backend(name: str, backend, *, overwrite: bool = False) -> None:
  """Registers `backend` (an object with the `model.backend.AttentionBackend` members, or a
  zero-argument callable returning one; checked at the first `get_backend`) under `name`.

  Raises:
    ValueError: `name` already registered with a different object and `overwrite` is False.
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f"backend name must be a non-empty string, got {name!r}")
  with _lock:
    old = _factories.get(name)
    if old is not None and old is not backend and not overwrite:
      if _same_target(old, backend):
        return
      raise ValueError(f"attention backend {name!r} is already registered ({old!r}); pass overwrite=True")
    _factories[name] = backend
    _instances.pop(name, None)


def _same_target(a, b) -> bool:
  # An entry point and an explicit register() may name the same factory function.
  return getattr(a, "__qualname__", None) == getattr(b, "__qualname__", object()) and \
      getattr(a, "__module__", None) == getattr(b, "__module__", object())


def _load_entry_points() -> None:
  global _entry_points_loaded
  with _lock:
    if _entry_points_loaded:
      return
    _entry_points_loaded = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
      if ep.name in _factories:
        continue
      try:
        _factories[ep.name] = ep.load()
      except Exception as e:  # a broken plugin must not hide the others
        _factories[ep.name] = _BrokenEntryPoint(ep, e)


class _BrokenEntryPoint:
  def __init__(self, ep, error):
    self.ep, self.error = ep, error

  def __call__(self):
    raise ImportError(f"attention backend {self.ep.name!r} (entry point {self.ep.value!r}) failed to "
                      f"load: {self.error!r}") from self.error


def registered_backends() -> list[str]:
  """Sorted names of every backend registered explicitly or through entry points."""
  _load_entry_points()
  with _lock:
    return sorted(_factories)


def get_backend(name: str, key: str = "attention"):
  """Returns the backend object registered as `name`, checked against `model.backend.AttentionBackend`.

  Args:
    name: the registry entry. key: the config key that named it (for the error message).

  Raises:
    UnknownBackendError: no backend has that name; the message names `key` and lists the registered ones.
    TypeError: the registered object (or what its factory returned) is not an `AttentionBackend`.
  """
  _load_entry_points()
  with _lock:
    if name in _instances:
      return _instances[name]
    if name not in _factories:
      raise UnknownBackendError(
          f"unknown attention backend {name!r} ({key}={name}); registered: {sorted(_factories)} (entry-point group "
          f"{ENTRY_POINT_GROUP!r}; is the plugin installed?)")
    obj = _factories[name]
    # A class or a plain function is a factory; an object that already has the protocol's
    # members is the backend itself (a backend object may be callable for reasons of its own).
    is_factory = isinstance(obj, type) or (callable(obj) and not isinstance(obj, AttentionBackend))
    backend = obj() if is_factory else obj
    check_backend(backend, name)
    _instances[name] = backend
    return backend
