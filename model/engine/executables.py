"""The process's one cache of compiled executables: engine steps, Generator functions, scoring windows.

A key starts with `model_key` (the model's graph and tree structure, the mesh and the partitioning
rules, never its parameters: the cache keeps no weights alive; and jax's matmul precision, which a
trace records in the program: the `matmul_precision` key), so engines over an equal model, e.g.
the same checkpoint loaded again or a second engine with the prefix cache on, reuse the executables.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import jax

from model import partitioning

T = TypeVar("T")

_CACHE: dict = {}


def model_key(graphdef, treedef, mesh=None, rules=None) -> tuple:
  """The part of a key that names the model, its placement and the matmul precision in effect now
  (`jax_default_matmul_precision`, set by a job's `model.config.matmul_precision`): an executable
  traced at another precision is another program."""
  return (graphdef, treedef, mesh, None if rules is None else repr(partitioning.as_rules(rules)),
          jax.config.jax_default_matmul_precision)


def get(key: tuple, build: Callable[[], T]) -> tuple[T, float]:
  """`(build(), seconds it took)` the first time `key` is asked for, then `(that value, 0.0)`."""
  if key in _CACHE:
    return _CACHE[key], 0.0
  t0 = time.perf_counter()
  _CACHE[key] = build()
  return _CACHE[key], time.perf_counter() - t0


def lookup(key: tuple):
  """The value stored under `key`, or None."""
  return _CACHE.get(key)


def put(key: tuple, value, seconds: float = 0.0) -> None:
  """Stores `value` under `key` (built elsewhere, e.g. compiled on a thread by
  `model.engine.runner.ModelRunner.compile_all`); the first value stored stays."""
  _CACHE.setdefault(key, value)


def clear() -> None:
  """Drops every stored executable, so that those no engine or Generator still holds are freed with
  their machine code (on XLA:CPU each compiled program keeps its own memory mappings until freed)."""
  _CACHE.clear()
