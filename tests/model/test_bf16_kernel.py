"""bf16 prefill of the whole model through the Mosaic kernel (issue 35, item 1), on the CPU.

`attention=kda_native kda_implementation=pallas_tpu` routes every KDA layer's prefill to the TPU
kernel, which runs here in Pallas interpret mode (the model passes no `interpret`, so the test
wraps the plugin's `kda_inference` to add it: the kernel's code path, simulated). The mixer hands it
q, k, v and the raw gate lane-dense `[B, T, H*K]` (model/nn/kda.py). Its logits must agree with the
training op (`attention=kda_chunked`) in bfloat16: the bf16 tolerance of
tests/model/test_model.py::test_backends_agree_bfloat16 is a relative RMS of 5e-3 over valid tokens
from the token recurrence (`kda_reference`) in bf16 (bf16 keeps 8 mantissa bits: each rounding is up
to 2**-9 ~ 2e-3 relative, and a 4-layer model rounds its activations many times). Both the kernel
and kda_chunked must be within it, hence within 1e-2 of each other (triangle inequality). In float32
the kernel path matches the recurrence to 2e-5.

Shape kept small for interpret mode: K = V = 128 (the kernel's lane width: no padding, the
in-place read the chip takes), 2 heads, two rows of 64 tokens with three documents in row 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.model import helpers

BF16 = ("dtype=bfloat16", "weight_dtype=bfloat16")
SHAPE = ("kda_head_dim=128", "v_head_dim=8", "hidden_size=64")
T = 64
BF16_REL_RMS = 5e-3  # the documented bf16 tolerance (module docstring)


def _rows():
  rng = np.random.default_rng(35)
  ids = rng.integers(3, 64, (2, T)).astype(np.int32)
  seg = np.zeros((2, T), np.int32)
  seg[0, :20], seg[0, 20:45], seg[0, 45:60] = 1, 2, 3   # three documents, then padding
  seg[1, :] = 1
  return jnp.asarray(ids), jnp.asarray(seg)


def _prefill(attention, *extra):
  _, gd, st = helpers.build(f"attention={attention}", *SHAPE, *extra)
  ids, seg = _rows()
  logits, cache = helpers.prefill_fn(gd, 3, T)(st, ids, seg, None)
  return np.asarray(logits, np.float32), cache


@pytest.fixture
def interpreted_kernel(monkeypatch):
  """kda_plugin's kda_inference with `interpret=True` (the Mosaic kernel simulated on the CPU); the
  list records each call's implementation and q shape."""
  from kda_plugin import plugin
  calls = []
  real = plugin.kda_inference

  @functools.wraps(real)
  def interpreted(*args, **kwargs):
    calls.append((kwargs.get("implementation"), tuple(args[0].shape), kwargs.get("num_heads")))
    return real(*args, **kwargs, interpret=True)

  monkeypatch.setattr(plugin, "kda_inference", interpreted)
  helpers.prefill_fn.cache_clear()
  yield calls
  helpers.prefill_fn.cache_clear()


def test_bf16_prefill_through_the_kernel_agrees_with_chunked(interpreted_kernel):
  got, cache = _prefill("kda_native", "kda_implementation=pallas_tpu", *BF16)
  # Every KDA layer called the kernel with the lane-dense layout [B, T, H*K] and num_heads=H.
  assert interpreted_kernel == [("pallas_tpu", (2, T, 2 * 128), 2)] * 2, interpreted_kernel
  chunked, chunked_cache = _prefill("kda_chunked", *BF16)
  reference, _ = _prefill("kda_reference", *BF16)   # the token recurrence, same bf16 weights
  valid = np.asarray(_rows()[1]) > 0
  assert np.isfinite(got[valid]).all()
  errors = {"kernel-reference": helpers.rel_rms(got[valid], reference[valid]),
            "chunked-reference": helpers.rel_rms(chunked[valid], reference[valid]),
            "kernel-chunked": helpers.rel_rms(got[valid], chunked[valid])}
  # Each op within the bf16 tolerance of the recurrence, so within twice it of each other.
  assert errors["kernel-reference"] <= BF16_REL_RMS, errors
  assert errors["chunked-reference"] <= BF16_REL_RMS, errors
  assert errors["kernel-chunked"] <= 2 * BF16_REL_RMS, errors
  # The KDA states the kernel hands to decode (float32) agree with the chunked op's.
  for a, b in zip(cache.layers[::2], chunked_cache.layers[::2]):
    assert helpers.rel_rms(np.asarray(a.state), np.asarray(b.state)) <= 2 * BF16_REL_RMS


def test_float32_prefill_through_the_kernel_matches_the_reference(interpreted_kernel):
  got, _ = _prefill("kda_native", "kda_implementation=pallas_tpu")
  reference, _ = _prefill("kda_reference")
  valid = np.asarray(_rows()[1]) > 0
  np.testing.assert_allclose(got[valid], reference[valid], atol=2e-5, rtol=0)
  assert len(interpreted_kernel) == 2
