"""kda_inference equals the float64 token recurrence on every hard packed-sequence case.

Backends: pallas_tpu (TPU semantics simulated on CPU with pltpu.InterpretParams), pallas_gpu in
interpret mode, xla, and pallas_gpu compiled on a real GPU (skipped without one).
Tolerances: float32 max abs <= 1e-4; bfloat16 relative L2 (= relative RMS) <= 5e-3;
padding outputs exactly 0.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_plugin.ops.inference import kda_inference
from kda_plugin.ops.reference import kda_reference
from tests.kernels._cases import CASES, PACKED, Case, make_inputs, oracle

# jax 0.12 flags the Pallas Triton lowering as deprecated (Mosaic GPU is its successor); the kernel
# targets it deliberately (runs on any CUDA GPU, not only Hopper).
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

HAS_GPU = jax.default_backend() == "gpu"
HAS_XLA_PATH = importlib.util.find_spec("kda_plugin.ops.inference_xla") is not None

BACKENDS = [
    pytest.param(("pallas_tpu", True), id="pallas_tpu_interpret"),
    pytest.param(("pallas_gpu", True), id="pallas_gpu_interpret"),
    pytest.param(("xla", False), id="xla", marks=pytest.mark.skipif(
        not HAS_XLA_PATH, reason="kda_plugin.ops.inference_xla has not landed yet")),
    pytest.param(("pallas_gpu", False), id="pallas_gpu_device", marks=pytest.mark.skipif(
        not HAS_GPU, reason="needs a CUDA GPU (run tools/device_check.sh on a GPU machine)")),
    pytest.param(("pallas_tpu", False), id="pallas_tpu_device", marks=pytest.mark.skipif(
        jax.default_backend() != "tpu", reason="needs a TPU (tools/bench/tpu_device_check.sh)")),
]


def _run(case: Case, backend, interpret, x):
  seg = None if case.seg is None else jnp.asarray(case.seg)
  h0 = jnp.asarray(x["h0"])
  if case.seg is None:
    h0 = h0[:, 0]
  kw = {}
  if case.gate is not None:
    kw = dict(a_log=jnp.asarray(x["a_log"], jnp.float32), dt_bias=jnp.asarray(x["dt_bias"], jnp.float32),
              lower_bound=-4.0 if case.gate == "bounded" else None)
  return kda_inference(
      jnp.asarray(x["q"]), jnp.asarray(x["k"]), jnp.asarray(x["v"]), jnp.asarray(x["g"]),
      jnp.asarray(x["beta"]), segment_ids=seg, initial_state=h0 if case.with_h0 else None,
      output_final_state=True, use_qk_l2norm=case.l2norm, max_num_segments=case.num_segments,
      implementation=backend, interpret=interpret, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_float64_recurrence(case, backend):
  name, interpret = backend
  x = make_inputs(case)
  t = x["q"].shape[1]
  seg = case.seg if case.seg is not None else np.ones(t, np.int32)
  scale = case.key_dim ** -0.5
  ref_o, ref_s = oracle(x["q"], x["k"], x["v"], x["g"], x["beta"], seg, x["h0"], scale,
                        a_log=x.get("a_log"), dt_bias=x.get("dt_bias"),
                        lower_bound=-4.0 if case.gate == "bounded" else None, l2norm=case.l2norm)
  o, final = _run(case, name, interpret, x)
  assert o.dtype == jnp.dtype(case.dtype) and o.shape == ref_o.shape
  o = np.asarray(o, np.float64)
  final = np.asarray(final, np.float64)
  if case.seg is None:
    final = final[:, None]
  assert final.shape == ref_s.shape
  assert np.all(np.isfinite(o)) and np.all(np.isfinite(final))
  pad = np.broadcast_to(seg == 0, o.shape[:2])
  assert np.all(o[pad] == 0.0), "padding outputs must be exactly 0"
  if case.dtype == "float32":
    np.testing.assert_allclose(o, ref_o, rtol=0, atol=1e-4)
    np.testing.assert_allclose(final, ref_s, rtol=0, atol=1e-4)
  else:
    for got, want in ((o, ref_o), (final, ref_s)):
      rel = np.linalg.norm(got - want) / np.linalg.norm(want)
      assert rel <= 5e-3, f"relative L2 error {rel:.2e} > 5e-3"
  if case.seg is not None:
    present = np.unique(case.seg[case.seg > 0]) - 1
    absent = np.setdiff1d(np.arange(case.num_segments), present)
    np.testing.assert_array_equal(final[:, absent], x["h0"][:, absent])


def test_oracle_equals_kda_reference():
  """The in-test oracle and the project's definition agree (keeps the oracle honest)."""
  case = Case("packed_h0", PACKED[:130], num_segments=10)
  x = make_inputs(case, seed=3)
  ref_o, ref_s = oracle(x["q"], x["k"], x["v"], x["g"], x["beta"], case.seg, x["h0"], 16 ** -0.5)
  o, s = kda_reference(jnp.asarray(x["q"]), jnp.asarray(x["k"]), jnp.asarray(x["v"]),
                       jnp.asarray(x["g"]), jnp.asarray(x["beta"]), initial_state=jnp.asarray(x["h0"]),
                       output_final_state=True, segment_ids=jnp.asarray(case.seg), max_num_segments=10)
  np.testing.assert_allclose(np.asarray(o), ref_o, atol=1e-5, rtol=0)
  np.testing.assert_allclose(np.asarray(s), ref_s, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_document_split_matches_unsplit():
  """Splitting one document and passing the final state on gives the unsplit result (TPU kernel)."""
  case = Case("one_doc", np.ones(100, np.int32), num_segments=1)
  x = make_inputs(case, seed=5)
  args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")]
  kw = dict(output_final_state=True, implementation="pallas_tpu", interpret=True)
  o_all, s_all = kda_inference(*args, initial_state=jnp.asarray(x["h0"][:, 0]), **kw)
  cut = 37
  o1, s1 = kda_inference(*[a[:, :cut] for a in args], initial_state=jnp.asarray(x["h0"][:, 0]), **kw)
  o2, s2 = kda_inference(*[a[:, cut:] for a in args], initial_state=s1, **kw)
  np.testing.assert_allclose(np.concatenate([o1, o2], axis=1), o_all, atol=1e-5, rtol=0)
  np.testing.assert_allclose(s2, s_all, atol=1e-5, rtol=0)


def _random_layout(rng, t, n):
  """Random packing of up to n documents: run lengths 1..90 (many of length 1), padding gaps,
  labels drawn without replacement from 1..n (so gaps in the labels and empty slots)."""
  seg = np.zeros(t, np.int32)
  labels = rng.permutation(np.arange(1, n + 1))
  pos, i = int(rng.integers(0, 3)), 0
  while pos < t and i < n:
    length = int(rng.choice([1, 1, 2, 5, 17, 40, 64, 90]))
    seg[pos:pos + length] = labels[i]
    pos += length + int(rng.choice([0, 0, 0, 1, 64]))
    i += 1
  return seg


def test_random_layouts_tpu_kernel():
  """Three random packings (one compilation: the segment map is traced) against the oracle."""
  rng = np.random.default_rng(11)
  for trial in range(3):
    case = Case(f"random_{trial}", _random_layout(rng, 200, 10), num_segments=10)
    x = make_inputs(case, seed=100 + trial)
    ref_o, ref_s = oracle(x["q"], x["k"], x["v"], x["g"], x["beta"], case.seg, x["h0"], 16 ** -0.5)
    o, s = _run(case, "pallas_tpu", True, x)
    np.testing.assert_allclose(np.asarray(o), ref_o, atol=1e-4, rtol=0, err_msg=str(case.seg))
    np.testing.assert_allclose(np.asarray(s), ref_s, atol=1e-4, rtol=0, err_msg=str(case.seg))
    assert np.all(np.asarray(o)[:, case.seg == 0] == 0.0)


@pytest.mark.parametrize("implementation", [("pallas_tpu", True), ("xla", False)], ids=["pallas_tpu_interpret", "xla"])
def test_lane_dense_layout(implementation):
  """q, k, v, g as `[B, T, H*D]` with num_heads (the projections' layout, K = V = 128 and T a multiple
  of 64: the TPU kernel's no-copy path; 3 chunks, so the last beta / segment row is half padding)
  give the oracle's result in `[B, T, H*V]`."""
  name, interpret = implementation
  case = Case("lane_dense", _random_layout(np.random.default_rng(4), 192, 4), num_segments=4,
              key_dim=128, value_dim=128, gate="bounded", l2norm=True)
  x = make_inputs(case, seed=9)
  b, t, h = x["beta"].shape
  ref_o, ref_s = oracle(x["q"], x["k"], x["v"], x["g"], x["beta"], case.seg, x["h0"], 128 ** -0.5,
                        a_log=x["a_log"], dt_bias=x["dt_bias"], lower_bound=-4.0, l2norm=True)
  flat = lambda a: jnp.asarray(a).reshape(b, t, -1)
  o, s = kda_inference(flat(x["q"]), flat(x["k"]), flat(x["v"]), flat(x["g"]), jnp.asarray(x["beta"]),
                       segment_ids=jnp.asarray(case.seg), initial_state=jnp.asarray(x["h0"]),
                       output_final_state=True, max_num_segments=4, a_log=jnp.asarray(x["a_log"]),
                       dt_bias=jnp.asarray(x["dt_bias"]), lower_bound=-4.0, use_qk_l2norm=True,
                       num_heads=h, implementation=name, interpret=interpret)
  assert o.shape == (b, t, h * 128)
  np.testing.assert_allclose(np.asarray(o).reshape(ref_o.shape), ref_o, atol=1e-4, rtol=0)
  np.testing.assert_allclose(np.asarray(s), ref_s, atol=1e-4, rtol=0)
  assert np.all(np.asarray(o)[:, case.seg == 0] == 0.0)


def test_per_row_segment_maps_tpu_kernel():
  """A `[B, T]` map with a different packing per row (the TPU kernel then reads one chunk-table row
  per batch row; a shared `[T]` map uses one row for all) against the oracle."""
  rng = np.random.default_rng(21)
  seg = np.stack([_random_layout(rng, 200, 10) for _ in range(3)])
  case = Case("per_row", seg[0], batch=3, num_segments=10)
  x = make_inputs(case, seed=31)
  ref_o, ref_s = oracle(x["q"], x["k"], x["v"], x["g"], x["beta"], seg, x["h0"], 16 ** -0.5)
  o, s = kda_inference(*(jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")),
                       segment_ids=jnp.asarray(seg), initial_state=jnp.asarray(x["h0"]),
                       output_final_state=True, max_num_segments=10, implementation="pallas_tpu",
                       interpret=True)
  np.testing.assert_allclose(np.asarray(o), ref_o, atol=1e-4, rtol=0)
  np.testing.assert_allclose(np.asarray(s), ref_s, atol=1e-4, rtol=0)
  assert np.all(np.asarray(o)[seg == 0] == 0.0)


@pytest.mark.parametrize("decay", ["none", pytest.param("steepest", marks=pytest.mark.slow)])
def test_bf16_nearly_parallel_keys_tpu_kernel(decay):
  """The bfloat16 kernel's hard case for its bf16 UT inverse: K = V = 128, nearly parallel keys
  (every key 0.97 of one direction), beta = 1, and either almost no decay (the inverse's entries
  reach their largest, the cancellation case) or the steepest the bound allows (every g at the
  bounded gate's lower bound -4: the factored diagonal blocks' factors at their extremes), two
  documents split off the 64 grid with initial states. bfloat16 tolerance: relative L2 <= 5e-3."""
  rng = np.random.default_rng(5)
  t, h, d = 192, 2, 128
  seg = np.where(np.arange(t) < 77, 1, 2).astype(np.int32)
  case = Case("parallel_bf16", seg, heads=h, key_dim=d, value_dim=d, num_segments=2,
              gate="bounded", l2norm=True, dtype="bfloat16")
  x = make_inputs(case, seed=6)
  base = rng.standard_normal((1, 1, h, d))
  import ml_dtypes  # noqa: PLC0415
  k = 0.97 * base + 0.09 * rng.standard_normal((1, t, h, d))
  x["k"] = k.astype(ml_dtypes.bfloat16)
  x["beta"] = np.ones_like(x["beta"])
  # bounded gate lb * sigmoid(a (g + dt)): g -> -inf gives no decay, g -> +inf gives lb per token
  x["g"] = np.full_like(x["g"], -40.0 if decay == "none" else 40.0)
  ref_o, ref_s = oracle(x["q"], x["k"], x["v"], x["g"], x["beta"], seg, x["h0"], d ** -0.5,
                        a_log=x["a_log"], dt_bias=x["dt_bias"], lower_bound=-4.0, l2norm=True)
  o, final = _run(case, "pallas_tpu", True, x)
  o, final = np.asarray(o, np.float64), np.asarray(final, np.float64)
  assert np.all(np.isfinite(o)) and np.all(np.isfinite(final))
  for got, want in ((o, ref_o), (final, ref_s)):
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel <= 5e-3, f"relative L2 error {rel:.2e} > 5e-3"


@pytest.mark.parametrize("dtype,heads", [
    pytest.param("float32", 8, marks=pytest.mark.slow), ("bfloat16", 8),
    pytest.param("bfloat16", 16, marks=pytest.mark.slow)])  # ~1 min each in interpret mode
def test_head_major_inputs_read_in_place_tpu_kernel(dtype, heads):
  """`[B, T, H, K]` inputs with H a multiple of 8, K = V = 128 and T a multiple of 64 are read in
  place by the TPU kernel (no relayout copy before the call): with all heads in one step (H = 8)
  as strided rows of `[B, T*H, K]`, with a head group per step (H = 16) as sublanes of
  `[C, 8, K]` blocks. The oracle's result, per-row maps, initial states."""
  from kda_plugin.ops.pallas_tpu import heads_layout_ok  # noqa: PLC0415

  rng = np.random.default_rng(8)
  seg = np.stack([_random_layout(rng, 192, 4) for _ in range(2)])
  case = Case("head_major", seg[0], batch=2, heads=heads, key_dim=128, value_dim=128, num_segments=4,
              gate="bounded", l2norm=True, dtype=dtype)
  x = make_inputs(case, seed=12)
  assert heads_layout_ok(heads, 128, 128, x["q"].dtype)
  ref_o, ref_s = oracle(x["q"], x["k"], x["v"], x["g"], x["beta"], seg, x["h0"], 128 ** -0.5,
                        a_log=x["a_log"], dt_bias=x["dt_bias"], lower_bound=-4.0, l2norm=True)
  o, s = kda_inference(*(jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")),
                       segment_ids=jnp.asarray(seg), initial_state=jnp.asarray(x["h0"]),
                       output_final_state=True, max_num_segments=4, a_log=jnp.asarray(x["a_log"]),
                       dt_bias=jnp.asarray(x["dt_bias"]), lower_bound=-4.0, use_qk_l2norm=True,
                       implementation="pallas_tpu", interpret=True)
  assert o.shape == ref_o.shape and o.dtype == jnp.dtype(dtype)
  o, s = np.asarray(o, np.float64), np.asarray(s, np.float64)
  assert np.all(o[seg == 0] == 0.0)
  if dtype == "float32":
    np.testing.assert_allclose(o, ref_o, atol=1e-4, rtol=0)
    np.testing.assert_allclose(s, ref_s, atol=1e-4, rtol=0)
  else:
    for got, want in ((o, ref_o), (s, ref_s)):
      rel = np.linalg.norm(got - want) / np.linalg.norm(want)
      assert rel <= 5e-3, f"relative L2 error {rel:.2e} > 5e-3"
