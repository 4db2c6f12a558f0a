"""The training form of `kda_chunked` (gate and q/k L2 norm inside the op, scan step rematerialised)
against the float64 oracle: outputs, final states and gradients.

Gradients are checked as directional derivatives: for a random direction u of each input, `<grad, u>`
of the float32 op against a central difference of the float64 oracle (tests/oracles.py: the token
recurrence with its own gate and L2 norm) in float64, whose error (~eps^2 and 1e-16/eps relative) is
far below float32 rounding. Cases: packed rows (documents starting inside chunks, runs of length 1,
padding) with a steep softplus gate (rates up to 40 nats per token, so decays underflow inside a
document) beside mild channels, and the bounded gate.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_plugin.ops.chunked import kda_chunked
from tests.oracles import gate_f64, kda_recurrence_f64, l2norm_f64

B, T, H, K, V, N = 2, 130, 2, 16, 8, 6
FD_EPS = 1e-6
# |<grad, u> - directional difference| <= REL_TOL * sum_i |grad_i u_i| (float32 rounding of the terms;
# the observed ratio is at most 6e-7, for a_log, on the steep case).
REL_TOL = 5e-6


def _row(*runs):
  row = np.concatenate([np.full(n, lab, np.int32) for lab, n in runs])
  return np.pad(row, (0, T - row.size))


SEG = np.stack([_row((1, 5), (2, 1), (3, 1), (4, 60), (5, 1), (6, 60)),
                _row((2, 40), (0, 3), (3, 1), (1, 80))])


def _inputs(seed, steep):
  rng = np.random.default_rng(seed)
  q, k, g_raw = (rng.normal(size=(B, T, H, K)) for _ in range(3))
  v = rng.normal(size=(B, T, H, V))
  beta = rng.uniform(0.0, 1.0, size=(B, T, H))
  if steep:  # head 0: rate 40 (softplus ~1-4 per token: 40-160 nats), head 1: rate 0.05 (mild)
    a_log = np.log(np.array([40.0, 0.05]))
  else:
    a_log = rng.uniform(-1.0, 1.0, size=(H,))
  dt_bias = rng.normal(size=(H * K,))
  h0 = 0.5 * rng.normal(size=(B, N, H, K, V))
  wo = rng.normal(size=(B, T, H, V))
  wf = rng.normal(size=(B, N, H, K, V))
  return (q, k, v, g_raw, beta, a_log, dt_bias, h0), (wo, wf)


def _oracle(args, weights, lower_bound):
  q, k, v, g_raw, beta, a_log, dt_bias, h0 = args
  g = gate_f64(g_raw, a_log, dt_bias, lower_bound)
  o, final = kda_recurrence_f64(l2norm_f64(q), l2norm_f64(k), v, g, beta, SEG, h0)
  return o, final, float(np.sum(o * weights[0]) + np.sum(final * weights[1]))


def _op(lower_bound):
  def run(q, k, v, g_raw, beta, a_log, dt_bias, h0):
    return kda_chunked(q, k, v, g_raw, beta, segment_ids=SEG, initial_state=h0, output_final_state=True,
                       max_num_segments=N, a_log=a_log, dt_bias=dt_bias, lower_bound=lower_bound,
                       use_qk_l2norm=True)
  return run


NAMES = ("q", "k", "v", "g_raw", "beta", "a_log", "dt_bias", "initial_state")


@pytest.fixture(params=["loop", "doubling"])
def inverse_form(request, monkeypatch):
  """The chunked op's unit-lower inverse as a CPU ("loop") or a TPU / GPU ("doubling") traces it."""
  import kda_plugin.ops.chunked as chunked
  monkeypatch.setattr(chunked, "inverse_form", lambda: request.param)  # a static argument of the op's jit
  return request.param


@pytest.mark.parametrize("lower_bound,steep", [(None, True), (-5.0, False)], ids=["softplus_steep", "bounded"])
def test_training_form_gradients_match_float64_oracle(lower_bound, steep, inverse_form):
  args, weights = _inputs(11, steep)
  run = _op(lower_bound)
  f32 = [jnp.asarray(a, jnp.float32) for a in args]
  o, final = jax.jit(run)(*f32)
  ro, rf, _ = _oracle(args, weights, lower_bound)
  assert np.max(np.abs(np.asarray(o, np.float64) - ro)) <= 2e-5
  assert np.max(np.abs(np.asarray(final, np.float64) - rf)) <= 2e-5
  if steep:  # the steep head's decay underflows inside documents: the case the direct sums are for
    g = gate_f64(args[3], args[5], args[6])
    assert np.min(g[..., 0, :]) < -104.0

  def loss(*a):
    o, final = run(*a)
    return jnp.sum(o * weights[0]) + jnp.sum(final * weights[1])

  grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*f32)
  rng = np.random.default_rng(12)
  for name, x, gr in zip(NAMES, args, grads):
    gr = np.asarray(gr, np.float64)
    assert np.all(np.isfinite(gr)), f"non-finite gradient for {name}"
    u = rng.normal(size=np.shape(x))
    step = [a if i != NAMES.index(name) else a + FD_EPS * u for i, a in enumerate(args)]
    back = [a if i != NAMES.index(name) else a - FD_EPS * u for i, a in enumerate(args)]
    want = (_oracle(step, weights, lower_bound)[2] - _oracle(back, weights, lower_bound)[2]) / (2 * FD_EPS)
    got = float(np.sum(gr * u))
    scale = float(np.sum(np.abs(gr * u)))
    assert abs(got - want) <= REL_TOL * scale, f"{name}: <grad, u> {got} vs float64 {want} (scale {scale})"


def test_the_inverse_form_follows_the_platform_traced_for():
  # a CPU inverts by the loop; under an abstract TPU mesh (the ahead-of-time compile for a TPU from
  # this host) kda_chunked traces the doubling form, a static argument of its jit
  from jax._src import mesh as mesh_lib
  import kda_plugin.ops.chunked as chunked
  assert chunked.inverse_form() == "loop"
  seen = []
  real = chunked._unit_lower_inverse

  def spy(lmat, form="loop"):
    seen.append(form)
    return real(lmat, form)

  device = mesh_lib.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
  sds = jax.ShapeDtypeStruct
  shapes = [sds((B, T, H, K), jnp.float32)] * 2 + [sds((B, T, H, V), jnp.float32), sds((B, T, H, K), jnp.float32),
                                                   sds((B, T, H), jnp.float32)]
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(chunked, "_unit_lower_inverse", spy)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
      assert chunked.inverse_form() == "doubling"
      run = jax.jit(lambda *a: chunked.kda_chunked(*a, segment_ids=SEG, max_num_segments=N)[0])
      jax.export.export(run, platforms=["tpu"])(*shapes)
  assert seen and set(seen) == {"doubling"}, seen
