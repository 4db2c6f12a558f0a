"""`kda_decode_step` against a float64 NumPy step written here, for both implementations: `xla` and
`pallas_tpu` (the Mosaic kernel in Pallas interpret mode on this CPU; compiled on the chip by
tests/kernels/test_tpu_device.py, compiled for TPU ahead of time by tests/aot/test_tpu_decode_compile.py).

Shapes cover one grid step (B=1, H=24, the serving shape's head count), several steps (B=4: the
kernel's block of sequences divides B), head counts that are not multiples of 8 and head dims below
128 lanes (the demo and tiny configs), float32 and bfloat16 inputs, and steps carried over several
tokens (the new state written over the old one).
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kda_plugin.ops import decode_pallas_tpu
from kda_plugin.ops.decode import kda_decode_step, resolve_implementation

IMPLS = [pytest.param(("xla", False), id="xla"), pytest.param(("pallas_tpu", True), id="pallas_tpu_interpret")]


def _np_step(state, q, k, v, g, beta, scale):
  """One token of the recurrence in float64 (docs/kda.md 'Token recurrence')."""
  s = state * np.exp(g)[..., None]
  pred = np.einsum("bhkv,bhk->bhv", s, k)
  delta = beta[..., None] * (v - pred)
  s = s + k[..., :, None] * delta[..., None, :]
  return np.einsum("bhkv,bhk->bhv", s, q * scale), s


def _inputs(rng, b, h, kd, vd, dtype):
  cast = lambda x: np.asarray(x.astype(np.float32).astype(dtype), np.float64)  # what the op sees
  k = rng.standard_normal((b, h, kd))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  return dict(q=cast(rng.standard_normal((b, h, kd))), k=cast(k), v=cast(rng.standard_normal((b, h, vd))),
              g=-rng.uniform(0, 1.0, (b, h, kd)).astype(np.float32).astype(np.float64),
              beta=cast(rng.uniform(0, 1, (b, h))))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("b,h,kd,vd", [(1, 24, 128, 128), (4, 24, 128, 128), (3, 5, 64, 32), (2, 3, 8, 16)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_steps_match_float64(impl, b, h, kd, vd, dtype):
  name, interpret = impl
  dt = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
  rng = np.random.default_rng(b * 1000 + h)
  state = rng.standard_normal((b, h, kd, vd)).astype(np.float32)
  want_s = state.astype(np.float64)
  s = jnp.asarray(state)
  scale = kd ** -0.5
  step = jax.jit(functools.partial(kda_decode_step, implementation=name, interpret=interpret))
  for _ in range(3):  # three tokens: the state each step writes is the next step's input
    x = _inputs(rng, b, h, kd, vd, dt)
    want_o, want_s = _np_step(want_s, **x, scale=scale)
    args = [jnp.asarray(x[n], dt if n != "g" else np.float32) for n in ("q", "k", "v", "g", "beta")]
    o, s = step(*args, s)
    assert o.dtype == jnp.dtype(dt) and o.shape == (b, h, vd) and s.dtype == jnp.float32
    # float32 arithmetic over K terms of size ~1: a few float32 ulps of the largest term
    np.testing.assert_allclose(np.asarray(s, np.float64), want_s, rtol=1e-5, atol=1e-5)
    o_tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=2 ** -8, atol=2 ** -8 * 4)
    np.testing.assert_allclose(np.asarray(o.astype(jnp.float32), np.float64), want_o, **o_tol)


def test_pallas_and_xla_agree_with_a_time_axis():
  rng = np.random.default_rng(5)
  x = _inputs(rng, 2, 4, 128, 128, np.float32)
  state = jnp.asarray(rng.standard_normal((2, 4, 128, 128)), jnp.float32)
  args = [jnp.asarray(x[n], jnp.float32)[:, None] for n in ("q", "k", "v", "g", "beta")]
  o1, s1 = kda_decode_step(*args, state, implementation="xla")
  o2, s2 = kda_decode_step(*args, state, implementation="pallas_tpu", interpret=True)
  assert o1.shape == o2.shape == (2, 1, 4, 128)
  np.testing.assert_allclose(o2, o1, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(s2, s1, rtol=1e-5, atol=1e-5)


def test_auto_is_xla_off_tpu():
  assert jax.default_backend() != "tpu"
  assert resolve_implementation("auto") == "xla"


def test_unknown_implementation_is_a_value_error():
  with pytest.raises(ValueError, match="unknown implementation 'mosaic'"):
    resolve_implementation("mosaic")


def test_pallas_tpu_off_tpu_without_interpret_is_a_runtime_error():
  z = jnp.zeros((1, 2, 8))
  with pytest.raises(RuntimeError, match="needs a TPU"):
    kda_decode_step(z, z, z, z, jnp.zeros((1, 2)), jnp.zeros((1, 2, 8, 8)), implementation="pallas_tpu")


def test_backend_decode_passes_the_configured_implementation_through():
  """The plugin's decode route honours the config's kernel choice: "pallas_tpu" reaches the kernel
  (here, off a TPU, its RuntimeError), "xla" and "pallas_gpu" the XLA step (equal to the default)."""
  from kda_plugin.plugin import kda_native  # noqa: PLC0415
  be = kda_native()
  rng = np.random.default_rng(0)
  q, k, v, g = (jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.float32) for _ in range(4))
  beta = jnp.asarray(rng.uniform(size=(2, 3)), jnp.float32)
  state = jnp.asarray(rng.standard_normal((2, 3, 8, 8)), jnp.float32)
  kw = dict(a_log=jnp.zeros((3,)), dt_bias=jnp.zeros((3 * 8,)), lower_bound=None)
  with pytest.raises(RuntimeError, match="needs a TPU"):
    be.kda_decode(q, k, v, g, beta, state, implementation="pallas_tpu", **kw)
  want = be.kda_decode(q, k, v, g, beta, state, **kw)
  for impl in ("xla", "pallas_gpu"):
    got = be.kda_decode(q, k, v, g, beta, state, implementation=impl, **kw)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_state_beyond_the_vmem_plan_is_a_value_error():
  with pytest.raises(ValueError, match="MiB of VMEM for H=24, K=1024, V=1024"):
    decode_pallas_tpu.check_limits(1, 24, 1024, 1024)


@pytest.mark.parametrize("b,h,want", [(1, 24, 1), (32, 24, 2), (128, 24, 4), (7, 3, 1), (13, 24, 1)])
def test_sequences_per_step_divides_the_batch(b, h, want):
  """The block of sequences divides B (no partial block) and sets about sqrt(2 x state bytes /
  (HBM bandwidth x step overhead)) steps: 16 at B=32, 32 at B=128 (H=24, K=V=128)."""
  bb = decode_pallas_tpu.seqs_per_step(b, h, 128, 128)
  assert b % bb == 0 and bb == want
