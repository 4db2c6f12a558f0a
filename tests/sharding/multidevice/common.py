"""Shared set-up of the 8-device checks (run by tests/sharding/test_multidevice.py in a subprocess
with `XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu`).

The tiny config has 8 KDA heads, 8 MLA heads and 8 experts so that every mesh of the acceptance
list divides them; 2 layers (KDA + dense FFN, MLA + MoE) keep compilation short. The KDA backend is
`kda_reference` (cheapest to compile): the sharding code is backend-independent, since every
backend's kernel runs under the same per-head-shard `shard_map`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.config import load_config
from model.nn.kimi_linear import last_token_logits

DEVICES = 8


def require_devices() -> None:
  """Skips the calling test module unless the process has 8 devices (not at import: a multi-process
  job must call jax.distributed.initialize before anything touches a device)."""
  if jax.device_count() != DEVICES:
    pytest.skip(f"needs {DEVICES} devices (run through tests/sharding/test_multidevice.py, which sets "
                "XLA_FLAGS=--xla_force_host_platform_device_count=8)", allow_module_level=True)

BASE = ("tiny", "kda_num_heads=8", "kda_head_dim=4", "num_attention_heads=8", "qk_nope_head_dim=4",
        "qk_rope_head_dim=4", "v_head_dim=4", "kv_lora_rank=8", "num_experts=8", "num_experts_per_tok=2",
        "moe_intermediate_size=8", "intermediate_size=32", "num_hidden_layers=2", "kda_layers=[1]",
        "full_attn_layers=[2]", "attention=kda_reference", "max_num_segments=3", "max_cache_length=16")
SIZES = {  # data, fsdp, expert, tensor
    "one_device": (1, 1, 1, 1),
    "data8": (8, 1, 1, 1),
    "fsdp2_tensor2_data2": (2, 2, 1, 2),
    "tensor8": (1, 1, 1, 8),
    "expert4_data2": (2, 1, 4, 1),
}
# Every mesh key given, so that they also override a checkpoint's stored mesh.
MESHES = {name: tuple(f"ici_{axis}_parallelism={n}" for axis, n in zip(("data", "fsdp", "expert", "tensor"), sizes))
          for name, sizes in SIZES.items()}
ONE_DEVICE = MESHES.pop("one_device")
B, T, N, CACHE = 8, 12, 3, 16
DECODE_STEPS = 4


def config(*overrides):
  return load_config(list(BASE) + list(overrides))


def packed_batch(seed: int = 0):
  """ids, segment_ids `[B, T]`: three documents of random lengths per row, 0-2 padding tokens."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(3, 64, (B, T)).astype(np.int32)
  seg = np.zeros((B, T), np.int32)
  for b in range(B):
    c1, c2 = sorted(rng.choice(np.arange(1, T - 2), 2, replace=False))
    seg[b, :c1], seg[b, c1:c2], seg[b, c2:T - b % 3] = 1, 2, 3
  return ids, seg


def loss_fn(graphdef, params, rest, ids, seg):
  """Mean next-token cross entropy within documents (float32)."""
  logits = nnx.merge(graphdef, params, rest)(ids, seg, mode="train", max_num_segments=N).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits[:, :-1])
  nll = -jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
  mask = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
  return jnp.sum(nll * mask) / jnp.sum(mask)


@functools.lru_cache(maxsize=None)
def programs(graphdef):
  """Fresh jitted (train, prefill, decode) for one graphdef; traced anew under each mesh context."""
  train = jax.jit(lambda p, r, i, s: jax.value_and_grad(functools.partial(loss_fn, graphdef))(p, r, i, s))

  def prefill(state, ids, seg):
    logits, cache = nnx.merge(graphdef, state).prefill(ids, seg, num_slots=N, cache_length=CACHE)
    return logits, cache, jnp.argmax(last_token_logits(logits, seg, N), -1).astype(jnp.int32)

  def decode(state, tok, cache):
    logits, cache = nnx.merge(graphdef, state).decode(tok, cache)
    return jnp.argmax(logits, -1).astype(jnp.int32), cache

  return train, jax.jit(prefill), jax.jit(decode)


def run_all(graphdef, state, ids, seg):
  """Loss, gradients, packed prefill logits and cache, greedy tokens `[DECODE_STEPS + 1, B*N]`."""
  train, prefill, decode = programs(graphdef)
  params, rest = state.split(nnx.Param, ...)
  loss, grads = train(params, rest, ids, seg)
  logits, cache, tok = prefill(state, ids, seg)
  prefill_cache = cache
  toks = [tok]
  for _ in range(DECODE_STEPS):
    tok, cache = decode(state, tok, cache)
    toks.append(tok)
  return dict(loss=loss, grads=grads, logits=logits, cache=prefill_cache, tokens=jnp.stack(toks))


def assert_close(actual, expected, name: str, tol: float = 1e-5):
  """|actual - expected| <= tol * (1 + |expected|) elementwise (float64 comparison)."""
  a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert a.shape == e.shape, f"{name}: shape {a.shape} != {e.shape}"
  err = np.abs(a - e) / (1.0 + np.abs(e))
  worst = np.unravel_index(np.argmax(err), err.shape) if err.size else ()
  assert err.size == 0 or err.max() <= tol, (
      f"{name}: max scaled error {err.max():.3g} > {tol} at {worst} (got {a[worst]!r}, want {e[worst]!r})")
