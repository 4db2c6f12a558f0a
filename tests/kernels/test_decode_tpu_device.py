"""The decode-step Mosaic kernel compiled for the TPU this runs on, against the float64 step of
tests/ops/test_decode.py, at the serving shapes (H=24, K=V=128, B=1/32/128: one and several grid
steps), bfloat16 inputs and float32 state, and beside the XLA step.

Runs only where jax's default backend is a TPU; everywhere else it is skipped (the kernel's math is
checked in interpret mode by tests/ops/test_decode.py). On the lent chip:
    python -m pytest -q tests/kernels/test_decode_tpu_device.py
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kda_plugin.ops.decode import kda_decode_step, resolve_implementation
from tests.ops.test_decode import _inputs, _np_step

pytestmark = pytest.mark.skipif(jax.default_backend() != "tpu",
                                reason="needs a TPU (tools/bench/tpu_device_check.sh)")


@pytest.mark.parametrize("batch", [1, 32, 128])
def test_decode_kernel_on_device_matches_float64(batch):
  assert resolve_implementation("auto") == "pallas_tpu"
  h, kd, vd = 24, 128, 128
  rng = np.random.default_rng(batch)
  state = rng.standard_normal((batch, h, kd, vd)).astype(np.float32)
  want_s = state.astype(np.float64)
  s = jnp.asarray(state)
  step = jax.jit(functools.partial(kda_decode_step, implementation="pallas_tpu"), donate_argnums=(5,))
  for _ in range(2):
    x = _inputs(rng, batch, h, kd, vd, ml_dtypes.bfloat16)
    want_o, want_s = _np_step(want_s, **x, scale=kd ** -0.5)
    args = [jnp.asarray(x[n], jnp.bfloat16 if n != "g" else jnp.float32) for n in ("q", "k", "v", "g", "beta")]
    o, s = step(*args, s)
    np.testing.assert_allclose(np.asarray(s, np.float64), want_s, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(o.astype(jnp.float32), np.float64), want_o, rtol=2 ** -8,
                               atol=2 ** -6)


def test_decode_kernel_on_device_matches_the_xla_step():
  rng = np.random.default_rng(7)
  b, h, kd, vd = 8, 24, 128, 128
  x = _inputs(rng, b, h, kd, vd, np.float32)
  args = [jnp.asarray(x[n], jnp.float32) for n in ("q", "k", "v", "g", "beta")]
  state = jnp.asarray(rng.standard_normal((b, h, kd, vd)), jnp.float32)
  o1, s1 = jax.jit(functools.partial(kda_decode_step, implementation="xla"))(*args, state)
  o2, s2 = jax.jit(functools.partial(kda_decode_step, implementation="pallas_tpu"))(*args, state)
  np.testing.assert_allclose(o2, o1, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(s2, s1, rtol=1e-5, atol=1e-5)
