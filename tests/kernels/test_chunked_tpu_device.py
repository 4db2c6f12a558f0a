"""The KDA training op's `pallas_tpu` implementation compiled for the TPU this runs on: its value and
gradients against the XLA op's (`kda_chunked(implementation="xla")`, the float64-exact training op of
tests/ops/test_chunked_training.py) on the same chip.

Runs only where jax's default backend is a TPU (tools/bench/tpu_device_check.sh runs it on a lent chip;
everywhere else it is skipped; tests/kernels/test_chunked_tpu.py checks the same code in interpret
mode against the float64 oracle). The 0.4B model's KDA shape at 2 rows: B=2, T=1024, H=8, K=V=128,
lane-dense, documents starting inside chunks and one ending at a chunk edge, Kimi's softplus gate and
q/k L2 norm in the op. Tolerances: float32 1e-4 of the largest element (the kernel's float32 bound,
tests/kernels/test_inference_numerics.py); bfloat16 two bf16 ulps (2^-7), as the interpret test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_plugin.ops.chunked import kda_chunked

pytestmark = pytest.mark.skipif(jax.default_backend() != "tpu",
                                reason="needs a TPU (tools/bench/tpu_device_check.sh)")

B, T, H, KD = 2, 1024, 8, 128
NAMES = ("q", "k", "v", "g_raw", "beta", "a_log", "dt_bias")


def _seg():
  row0 = np.concatenate([np.full(n, i + 1) for i, n in enumerate((300, 212, 512))])   # 512: a chunk edge
  row1 = np.concatenate([np.full(1000, 1), np.zeros(24)])
  return jnp.asarray(np.stack([row0, row1]), jnp.int32)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 2.0 ** -7)])
def test_train_op_device_matches_the_xla_op(dtype, tol):
  rng = np.random.default_rng(0)
  dt = jnp.dtype(dtype)
  q, k, v, g_raw = (jnp.asarray(rng.normal(size=(B, T, H * KD)), dt) for _ in range(4))
  beta = jnp.asarray(rng.uniform(size=(B, T, H)), jnp.float32)
  a_log = jnp.asarray(np.log(rng.uniform(1, 16, H)), jnp.float32)
  dt_bias = jnp.asarray(rng.normal(size=(H * KD,)) - 4.0, jnp.float32)
  wo = jnp.asarray(rng.normal(size=(B, T, H * KD)), jnp.float32)
  seg = _seg()

  def run(impl):
    def loss(*a):
      o, _ = kda_chunked(*a[:5], segment_ids=seg, max_num_segments=3, a_log=a[5], dt_bias=a[6],
                         use_qk_l2norm=True, num_heads=H, implementation=impl)
      return jnp.sum(o.astype(jnp.float32) * wo), o
    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7)), has_aux=True))(
        q, k, v, g_raw, beta, a_log, dt_bias)

  (_, o_x), g_x = run("xla")
  (_, o_p), g_p = run("pallas_tpu")
  rel = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                           / jnp.max(jnp.abs(b.astype(jnp.float32))))
  assert rel(o_p, o_x) <= tol
  for name, a, want in zip(NAMES, g_p, g_x):
    assert bool(jnp.all(jnp.isfinite(a.astype(jnp.float32)))), name
    assert rel(a, want) <= tol, f"{name}: relative difference {rel(a, want):.2e}"
