"""The Mosaic kernel compiled for the TPU this runs on, at the seed shape, against the float64 oracle.

Runs only where jax's default backend is a TPU (tools/bench/tpu_device_check.sh runs it on a lent chip;
everywhere else it is skipped). B=1, T=8192, H=8, K=V=128, documents of 4079 and 4113 tokens (a
boundary inside a chunk), the bounded gate and q/k L2 norm inside the kernel, final states; both
layouts ([B, T, H*K] lane-dense and [B, T, H, K] read in place), bfloat16 and float32. Tolerances as
tests/kernels/test_inference_numerics.py: float32 max abs 1e-4, bfloat16 relative L2 5e-3; the two
layouts give the same output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kda_plugin.ops.inference import kda_inference
from tests.kernels._cases import oracle

pytestmark = pytest.mark.skipif(jax.default_backend() != "tpu",
                                reason="needs a TPU (tools/bench/tpu_device_check.sh)")

B, T, H, KD = 1, 8192, 8, 128
LENGTHS = (4079, 4113)
LOWER_BOUND = -5.0


@functools.lru_cache(maxsize=None)
def _inputs_and_oracle():
  rng = np.random.default_rng(0)
  x = dict(q=rng.standard_normal((B, T, H, KD)), k=rng.standard_normal((B, T, H, KD)),
           v=rng.standard_normal((B, T, H, KD)), g=rng.standard_normal((B, T, H, KD)) * 2.0,
           beta=rng.uniform(0, 1, (B, T, H)), a_log=rng.uniform(-1.0, 0.5, (H,)),
           dt_bias=rng.standard_normal((H * KD,)) * 0.5)
  seg = np.concatenate([np.full(n, i + 1, np.int32) for i, n in enumerate(LENGTHS)])
  return x, seg


@functools.lru_cache(maxsize=None)
def _oracle(dtype):
  x, seg = _inputs_and_oracle()
  cast = lambda a: np.asarray(a.astype(np.float32 if dtype == "float32" else ml_dtypes.bfloat16),
                              np.float64)
  return oracle(cast(x["q"]), cast(x["k"]), cast(x["v"]), x["g"].astype(np.float32), cast(x["beta"]),
                seg, None, KD ** -0.5, a_log=x["a_log"], dt_bias=x["dt_bias"],
                lower_bound=LOWER_BOUND, l2norm=True)


def _run(dtype, layout):
  x, seg = _inputs_and_oracle()
  dt = jnp.dtype(dtype)
  lane = layout == "lane_dense"
  shape = lambda a: a.reshape(B, T, -1) if lane else a
  q, k, v = (jnp.asarray(shape(x[n]), dt) for n in ("q", "k", "v"))
  g = jnp.asarray(shape(x["g"]), jnp.float32)
  o, s = kda_inference(q, k, v, g, jnp.asarray(x["beta"], dt), segment_ids=jnp.asarray(seg),
                       output_final_state=True, max_num_segments=len(LENGTHS), use_qk_l2norm=True,
                       a_log=jnp.asarray(x["a_log"], jnp.float32),
                       dt_bias=jnp.asarray(x["dt_bias"], jnp.float32), lower_bound=LOWER_BOUND,
                       num_heads=H if lane else None, implementation="pallas_tpu")
  return np.asarray(o, np.float64).reshape(B, T, H, KD), np.asarray(s, np.float64)


@pytest.mark.parametrize("layout", ["lane_dense", "heads"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_seed_shape_on_the_chip_matches_float64(dtype, layout):
  ref_o, ref_s = _oracle(dtype)
  with jax.default_matmul_precision("highest"):
    o, s = _run(dtype, layout)
  assert np.all(np.isfinite(o)) and np.all(np.isfinite(s))
  if dtype == "float32":
    np.testing.assert_allclose(o, ref_o, rtol=0, atol=1e-4)
    np.testing.assert_allclose(s, ref_s, rtol=0, atol=1e-4)
  else:
    for got, want in ((o, ref_o), (s, ref_s)):
      rel = np.linalg.norm(got - want) / np.linalg.norm(want)
      assert rel <= 5e-3, f"relative L2 {rel:.2e} > 5e-3"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layouts_agree_on_the_chip(dtype):
  o1, s1 = _run(dtype, "lane_dense")
  o2, s2 = _run(dtype, "heads")
  np.testing.assert_array_equal(o1, o2)
  np.testing.assert_array_equal(s1, s2)
