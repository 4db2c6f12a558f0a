"""model/engine/executables.py: the one cache of compiled executables is keyed by model structure and
shared by every user (engines, the Generator, the scorer)."""

from __future__ import annotations

import jax
from flax import nnx

from model.config import load_config
from model.engine import executables
from model.nn.kimi_linear import KimiLinearForCausalLM


def test_get_builds_once_per_key():
  calls = []
  key = ("test_executables", object())
  value, seconds = executables.get(key, lambda: calls.append(1) or "built")
  again, seconds_again = executables.get(key, lambda: calls.append(1) or "other")
  assert (value, again, calls) == ("built", "built", [1])
  assert seconds >= 0.0 and seconds_again == 0.0


def test_an_equal_model_has_an_equal_key():
  """Two models built from the same config have equal structure keys (so a checkpoint loaded again
  reuses the executables); the key holds no parameter array."""
  cfg = load_config(["tiny"])
  keys = []
  for _ in range(2):
    graphdef, state = nnx.split(KimiLinearForCausalLM(cfg))
    keys.append(executables.model_key(graphdef, jax.tree.structure(state)))
  assert keys[0] == keys[1] and hash(keys[0]) == hash(keys[1])
  assert not any(isinstance(x, jax.Array) for x in keys[0])


def test_a_matmul_precision_is_a_key_of_its_own():
  """The same model traced at another matmul precision is another program: a job run with
  matmul_precision=highest in a process that compiled the model at the default (or the other way)
  compiles its own executables instead of reusing those."""
  from model.config import matmul_precision
  graphdef, state = nnx.split(KimiLinearForCausalLM(load_config(["tiny"])))
  key = lambda: executables.model_key(graphdef, jax.tree.structure(state))
  plain = key()
  with matmul_precision("default"):
    assert key() == plain
  with matmul_precision("highest"):
    highest = key()
  with matmul_precision("high"):
    high = key()
  assert len({plain, high, highest}) == 3 and plain[:-1] == high[:-1] == highest[:-1]
  assert key() == plain
