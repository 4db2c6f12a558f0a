"""Shared builders for the model tests: tiny models with a non-zero router bias, jitted entry points."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.config import load_config
from model.nn.kimi_linear import KimiLinearForCausalLM
from model.nn.moe import RouterBias


@functools.lru_cache(maxsize=None)
def build(*overrides: str):
  """(model, graphdef, state) of the tiny config with `overrides`; router biases set non-zero
  (random init leaves them zero, which would hide a biased/unbiased mix-up)."""
  cfg = load_config(["tiny", *overrides])
  model = KimiLinearForCausalLM(cfg)
  rng = np.random.default_rng(7)
  for _, var in nnx.iter_graph(model):
    if isinstance(var, RouterBias):
      var.set_value(jnp.asarray(rng.normal(0.0, 0.3, var.get_value().shape), jnp.float32))
  graphdef, state = nnx.split(model)
  return model, graphdef, state


@functools.lru_cache(maxsize=None)
def forward_fn(graphdef, mode: str, num_slots: int):
  return jax.jit(lambda state, ids, seg: nnx.merge(graphdef, state)(ids, seg, mode=mode, max_num_segments=num_slots))


@functools.lru_cache(maxsize=None)
def prefill_fn(graphdef, num_slots: int, cache_length: int):
  def f(state, ids, seg, cache):
    return nnx.merge(graphdef, state).prefill(ids, seg, cache=cache, num_slots=num_slots, cache_length=cache_length)
  return jax.jit(f)


@functools.lru_cache(maxsize=None)
def decode_fn(graphdef):
  return jax.jit(lambda state, tok, cache: nnx.merge(graphdef, state).decode(tok, cache))


def rel_rms(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))
