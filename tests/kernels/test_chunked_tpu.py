"""`kda_chunked(implementation="pallas_tpu")`: the Mosaic kernel's forward (simulated on CPU in
interpret mode) with the state entering every chunk, and the backward kernel of
`kda_plugin.ops.chunked_tpu_bwd`, against the float64 token recurrence of tests/oracles.py.

Gradients are checked as in tests/ops/test_chunked_training.py: `<grad, u>` for a random direction u of
each input against a central difference of the float64 oracle. Cases: packed rows with documents
starting inside chunks, runs of one row, a document ending exactly at a chunk edge, padding; Kimi's
softplus gate steep enough to underflow inside documents beside mild channels, and the bounded gate.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_plugin.ops import inference_tpu
from kda_plugin.ops.chunked import kda_chunked
from tests.oracles import gate_f64, kda_recurrence_f64, l2norm_f64

B, T, H, K, V, N = 2, 200, 2, 16, 8, 6
FD_EPS = 1e-6
REL_TOL = 5e-6  # as tests/ops/test_chunked_training.py (float32 rounding of the terms of <grad, u>)


def _row(*runs):
  row = np.concatenate([np.full(n, lab, np.int32) for lab, n in runs])
  return np.pad(row, (0, T - row.size))


# row 0: documents starting inside chunks, runs of one row, one ending exactly at row 127 (a chunk
# edge) followed by one starting at 128, trailing padding; row 1: padding inside, a carried document
SEG = np.stack([_row((1, 5), (2, 1), (3, 1), (4, 57), (5, 64), (6, 60)),
                _row((2, 40), (0, 3), (3, 1), (1, 150))])


def _inputs(seed, steep, gentle=False):
  rng = np.random.default_rng(seed)
  q, k, g_raw = (rng.normal(size=(B, T, H, K)) for _ in range(3))
  v = rng.normal(size=(B, T, H, V))
  beta = rng.uniform(0.0, 1.0, size=(B, T, H))
  a_log = np.log(np.array([40.0, 0.05])) if steep else rng.uniform(-1.0, 1.0, size=(H,))
  dt_bias = rng.normal(size=(H * K,))
  if gentle:  # a model's gate at initialisation: every row within GENTLE_LOG_DECAY (the factored blocks)
    g_raw, dt_bias = 0.3 * g_raw, 0.3 * dt_bias - 3.0
  wo = rng.normal(size=(B, T, H, V))
  return (q, k, v, g_raw, beta, a_log, dt_bias), wo


def _oracle(args, wo, lower_bound):
  q, k, v, g_raw, beta, a_log, dt_bias = args
  g = gate_f64(g_raw, a_log, dt_bias, lower_bound)
  o, _ = kda_recurrence_f64(l2norm_f64(q), l2norm_f64(k), v, g, beta, SEG)
  return o, float(np.sum(o * wo))


def _op(lower_bound, implementation="pallas_tpu"):
  def run(q, k, v, g_raw, beta, a_log, dt_bias):
    o, _ = kda_chunked(q, k, v, g_raw, beta, segment_ids=SEG, max_num_segments=N, a_log=a_log,
                       dt_bias=dt_bias, lower_bound=lower_bound, use_qk_l2norm=True,
                       implementation=implementation, interpret=implementation == "pallas_tpu")
    return o
  return run


NAMES = ("q", "k", "v", "g_raw", "beta", "a_log", "dt_bias")


# make test: Kimi's softplus gate (the model's), steep (the backward kernel's elementwise diagonal blocks)
# and gentle (its factored ones, a model's usual path); the bounded gate's case (~20 s in interpret mode) is
# `make test-slow` (its in-op activation is the XLA op's own, checked in tests/ops/test_chunked_training.py)
@pytest.mark.parametrize("lower_bound,steep,gentle", [
    pytest.param(None, True, False, id="softplus_steep"),
    pytest.param(None, False, True, id="softplus_gentle"),
    pytest.param(-5.0, False, False, id="bounded", marks=pytest.mark.slow)])
def test_gradients_match_float64_oracle(lower_bound, steep, gentle):
  args, wo = _inputs(11, steep, gentle)
  run = _op(lower_bound)
  f32 = [jnp.asarray(a, jnp.float32) for a in args]
  ro, _ = _oracle(args, wo, lower_bound)
  o = jax.jit(run)(*f32)
  assert np.max(np.abs(np.asarray(o, np.float64) - ro)) <= 2e-5
  if steep:  # the steep head's decay underflows inside documents
    assert np.min(gate_f64(args[3], args[5], args[6])[..., 0, :]) < -104.0
  if gentle:  # every chunk takes the factored diagonal blocks (the backward kernel's usual form)
    assert np.min(gate_f64(args[3], args[5], args[6])) > -8.0

  grads = jax.jit(jax.grad(lambda *a: jnp.sum(run(*a) * wo), argnums=tuple(range(len(args)))))(*f32)
  rng = np.random.default_rng(12)
  for i, (name, x, gr) in enumerate(zip(NAMES, args, grads)):
    gr = np.asarray(gr, np.float64)
    assert np.all(np.isfinite(gr)), f"non-finite gradient for {name}"
    u = rng.normal(size=np.shape(x))
    step = [a + FD_EPS * u if j == i else a for j, a in enumerate(args)]
    back = [a - FD_EPS * u if j == i else a for j, a in enumerate(args)]
    want = (_oracle(step, wo, lower_bound)[1] - _oracle(back, wo, lower_bound)[1]) / (2 * FD_EPS)
    got = float(np.sum(gr * u))
    scale = float(np.sum(np.abs(gr * u)))
    assert abs(got - want) <= REL_TOL * scale, f"{name}: <grad, u> {got} vs float64 {want} (scale {scale})"


def test_chunk_states_are_the_open_documents_states():
  """The kernel's `want_states` output: entering chunk c, the float64 state of the document open
  across the edge at row 64c (the oracle's final state over rows < 64c), zeros where none is."""
  args, _ = _inputs(3, False)
  q, k, v, g_raw, beta, a_log, dt_bias = args
  g = gate_f64(g_raw, a_log, dt_bias)
  qn, kn = l2norm_f64(q), l2norm_f64(k)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  _, _, states = inference_tpu.forward(
      f32(qn), f32(kn), f32(v), f32(g), f32(beta), jnp.asarray(SEG), None, None, num_heads=H,
      num_segments=N, scale=K ** -0.5, lower_bound=None, use_l2norm=False, want_final=False,
      want_states=True, interpret=True)
  nc = -(-T // 64)
  assert states.shape == (nc, B, H, K, V)
  for c in range(nc):
    edge = 64 * c
    for b in range(B):
      lab = SEG[b, edge - 1] if edge else 0
      want = np.zeros((H, K, V))
      if lab and SEG[b, edge] == lab:
        _, fin = kda_recurrence_f64(qn[b:b + 1, :edge], kn[b:b + 1, :edge], v[b:b + 1, :edge],
                                    g[b:b + 1, :edge], beta[b:b + 1, :edge], SEG[b:b + 1, :edge],
                                    np.zeros((1, N, H, K, V)))
        want = fin[0, lab - 1]
      np.testing.assert_allclose(np.asarray(states[c, b], np.float64), want, atol=2e-5,
                                 err_msg=f"chunk {c}, row {b}")
  # the row-1 document carried over every edge has a non-zero state there: the check is not vacuous
  assert float(jnp.max(jnp.abs(states[2, 1]))) > 0.1


def test_bf16_lane_dense_matches_the_xla_op():
  """The model's layout and dtype (lane-dense [B, T, H*K] bfloat16, 8 heads of 128): the value and
  every gradient equal the XLA op's within bf16 rounding. The kernel's bf16 MXU passes
  (`pallas_tpu.matmul_precision`) give outputs within 5e-3 relative (tests/kernels/
  test_inference_numerics.py); the backward kernel (`chunked_tpu_bwd`) starts from the kernel's
  chunk states and takes bf16 passes as the forward does (`_chunk_vjp`), so gradients carry that
  rounding once more. Bound: two bf16 ulps (2^-7) of the largest element."""
  rng = np.random.default_rng(5)
  b, t, h, kd = 1, 192, 8, 128
  seg = np.concatenate([np.full(70, 1), np.full(100, 2), np.zeros(22)]).astype(np.int32)[None]
  bf = lambda *s: jnp.asarray(rng.normal(size=s), jnp.bfloat16)
  q, k, v, g_raw = (bf(b, t, h * kd) for _ in range(4))
  beta = jnp.asarray(rng.uniform(size=(b, t, h)), jnp.float32)
  a_log = jnp.asarray(np.log(rng.uniform(1, 16, h)), jnp.float32)
  dt_bias = jnp.asarray(rng.normal(size=(h * kd,)) - 4.0, jnp.float32)
  wo = jnp.asarray(rng.normal(size=(b, t, h * kd)), jnp.float32)

  def loss(impl):
    def f(q, k, v, g_raw, beta, a_log, dt_bias):
      o, _ = kda_chunked(q, k, v, g_raw, beta, segment_ids=seg, max_num_segments=2, a_log=a_log,
                         dt_bias=dt_bias, use_qk_l2norm=True, num_heads=h, implementation=impl,
                         interpret=impl == "pallas_tpu")
      assert o.shape == q.shape and o.dtype == q.dtype
      return jnp.sum(o.astype(jnp.float32) * wo), o
    return jax.jit(jax.value_and_grad(f, argnums=tuple(range(7)), has_aux=True))

  args = (q, k, v, g_raw, beta, a_log, dt_bias)
  (_, o_x), g_x = loss("xla")(*args)
  (_, o_p), g_p = loss("pallas_tpu")(*args)
  rel = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                           / jnp.max(jnp.abs(b.astype(jnp.float32))))
  tol = 2.0 ** -7
  assert rel(o_p, o_x) <= tol
  for name, a, want in zip(NAMES, g_p, g_x):
    assert a.dtype == want.dtype, name
    assert rel(a, want) <= tol, f"{name}: relative difference {rel(a, want):.2e}"


def test_refusals_name_the_argument():
  args, _ = _inputs(1, False)
  q, k, v, g_raw, beta, a_log, dt_bias = (jnp.asarray(a, jnp.float32) for a in args)
  kw = dict(segment_ids=SEG, max_num_segments=N, a_log=a_log, dt_bias=dt_bias, use_qk_l2norm=True)
  with pytest.raises(ValueError, match="initial_state nor output_final_state"):
    kda_chunked(q, k, v, g_raw, beta, output_final_state=True, implementation="pallas_tpu", interpret=True, **kw)
  with pytest.raises(ValueError, match="initial_state nor output_final_state"):
    kda_chunked(q, k, v, g_raw, beta, initial_state=jnp.zeros((B, N, H, K, V)), implementation="pallas_tpu",
                interpret=True, **kw)
  with pytest.raises(RuntimeError, match="needs a TPU"):
    kda_chunked(q, k, v, g_raw, beta, implementation="pallas_tpu", **kw)
  with pytest.raises(ValueError, match="implementation must be one of"):
    kda_chunked(q, k, v, g_raw, beta, implementation="pallas_gpu", **kw)
  with pytest.raises(ValueError, match="interpret simulates the 'pallas_tpu' kernel"):
    kda_chunked(q, k, v, g_raw, beta, implementation="xla", interpret=True, **kw)
  lane = lambda x: x.reshape(x.shape[:2] + (-1,))
  with pytest.raises(TypeError, match="num_heads must be a Python int"):
    kda_chunked(*(lane(x) for x in (q, k, v, g_raw)), beta, num_heads=2.5, implementation="pallas_tpu",
                interpret=True, **kw)
  with pytest.raises(ValueError, match="num_heads=2 means lane-dense inputs"):
    kda_chunked(q, k, v, g_raw, beta, num_heads=2, implementation="pallas_tpu", interpret=True, **kw)


def test_kda_native_refuses_states_in_train_mode_on_the_kernel_route():
  """kda_native trains through kda_chunked[pallas_tpu], which has no states: a train-mode call that
  passes or asks for one is refused, not served by the XLA op instead."""
  from kda_plugin.plugin import kda_native
  args, _ = _inputs(1, False)
  q, k, v, g_raw, beta, a_log, dt_bias = (jnp.asarray(a, jnp.float32) for a in args)
  lane = lambda x: x.reshape(x.shape[:2] + (-1,))
  be = kda_native()
  assert be.describe("train", "pallas_tpu") == "kda_native -> kda_chunked[pallas_tpu]"
  with pytest.raises(ValueError, match="takes no initial_state and returns no final state"):
    be.kda(*(lane(x) for x in (q, k, v, g_raw)), beta, a_log=a_log, dt_bias=dt_bias, lower_bound=None,
           mode="train", segment_ids=SEG, initial_state=None, output_final_state=True, max_num_segments=N,
           implementation="pallas_tpu", num_heads=H)


def test_gradients_through_remat_in_interpret_mode():
  """The model trains under `jax.checkpoint` (remat): the op differentiates there too, in interpret
  mode on CPU (Pallas' generic interpreter), and equals the XLA op's gradients."""
  rng = np.random.default_rng(2)
  b, t, h, kd = 1, 96, 2, 16
  seg = np.concatenate([np.full(40, 1), np.full(56, 2)]).astype(np.int32)[None]
  q, k, v, g_raw = (jnp.asarray(rng.normal(size=(b, t, h, kd)), jnp.float32) for _ in range(4))
  beta = jnp.asarray(rng.uniform(size=(b, t, h)), jnp.float32)
  a_log = jnp.asarray(rng.uniform(-1, 1, h), jnp.float32)
  wo = jnp.asarray(rng.normal(size=(b, t, h, kd)), jnp.float32)

  def grads(impl):
    def loss(q, k):
      o, _ = kda_chunked(q, k, v, g_raw, beta, segment_ids=seg, max_num_segments=2, a_log=a_log,
                         use_qk_l2norm=True, implementation=impl, interpret=impl == "pallas_tpu")
      return jnp.sum(o * wo)
    return jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1)))(q, k)

  for a, want in zip(grads("pallas_tpu"), grads("xla")):
    np.testing.assert_allclose(np.asarray(a), np.asarray(want), rtol=0, atol=2e-6 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("lower_bound", [pytest.param(None, id="softplus"), pytest.param(-5.0, id="bounded")])
def test_bf16_gate_gradients_match_the_float32_op(lower_bound):
  """The gate's gradients (g_raw, a_log, dt_bias) with bfloat16 inputs against the op's own float32
  run on the same (bf16-valued) inputs: within two bf16 ulps (2^-7) of the largest element, as the
  other bf16 gradients. They are differences of the backward's products (dG = q dq - k dk, summed for
  a_log and dt_bias): with one-pass cotangent products they were off by up to 1.4e-1 (d a_log) and
  5.1e-2 (d dt_bias); three passes (`_chunk_vjp._cotangent_mode`) give ~4e-3, as the XLA op."""
  rng = np.random.default_rng(44)
  b, t, h, kd = 1, 200, 2, 16
  q, k, g_raw = (jnp.asarray(rng.normal(size=(b, t, h, kd)), jnp.bfloat16) for _ in range(3))
  v = jnp.asarray(rng.normal(size=(b, t, h, kd)), jnp.bfloat16)
  beta = jnp.asarray(rng.uniform(size=(b, t, h)), jnp.float32)
  a_log = jnp.asarray(rng.uniform(-1, 1, size=(h,)), jnp.float32)
  dt_bias = jnp.asarray(rng.normal(size=(h * kd,)), jnp.float32)
  wo = jnp.asarray(rng.normal(size=(b, t, h, kd)), jnp.float32)

  def grads(dtype):
    def loss(g_raw, a_log, dt_bias):
      o, _ = kda_chunked(q.astype(dtype), k.astype(dtype), v.astype(dtype), g_raw.astype(dtype), beta,
                         a_log=a_log, dt_bias=dt_bias, lower_bound=lower_bound, use_qk_l2norm=True,
                         implementation="pallas_tpu", interpret=True)
      return jnp.sum(o.astype(jnp.float32) * wo)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(g_raw, a_log, dt_bias)

  rel = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b)))
  for name, got, want in zip(("g_raw", "a_log", "dt_bias"), grads(jnp.bfloat16), grads(jnp.float32)):
    assert rel(got, want) <= 2.0 ** -7, f"{name}: relative difference {rel(got, want):.2e}"
