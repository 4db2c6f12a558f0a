"""kda_inference rejects what it cannot do with errors that name the limit."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from kda_plugin.ops.inference import estimate_peak_memory, kda_inference, resolve_implementation


def _inputs(b=1, t=8, h=1, k=16, v=16):
  z = lambda *s: jnp.zeros(s, jnp.float32)
  return z(b, t, h, k), z(b, t, h, k), z(b, t, h, v), z(b, t, h, k), z(b, t, h)


def test_unknown_backend():
  with pytest.raises(ValueError, match="unknown implementation .cuda_magic."):
    kda_inference(*_inputs(), implementation="cuda_magic")


def test_auto_on_cpu_is_xla():
  assert resolve_implementation("auto") == "xla"


@pytest.mark.parametrize("backend,need", [("pallas_tpu", "needs a TPU"), ("pallas_gpu", "needs a CUDA GPU")])
def test_pallas_backend_on_cpu_without_interpret(backend, need):
  with pytest.raises(RuntimeError, match=need):
    kda_inference(*_inputs(), implementation=backend)


@pytest.mark.parametrize("backend,k,limit", [("pallas_tpu", 300, "up to 256"), ("pallas_gpu", 192, "up to 128")])
def test_key_dim_beyond_backend_limit(backend, k, limit):
  with pytest.raises(ValueError, match=f"implementation .{backend}. supports K and V {limit}"):
    kda_inference(*_inputs(k=k), implementation=backend, interpret=True)


def test_gate_parameters_need_a_log():
  with pytest.raises(ValueError, match="need a_log"):
    kda_inference(*_inputs(), lower_bound=-2.0, implementation="pallas_tpu", interpret=True)


def test_lower_bound_range():
  with pytest.raises(ValueError, match="lower_bound must lie in"):
    kda_inference(*_inputs(), a_log=jnp.zeros(1), lower_bound=-7.0, implementation="pallas_gpu", interpret=True)


def test_interpret_with_xla_is_rejected():
  with pytest.raises(ValueError, match="Pallas kernels only"):
    kda_inference(*_inputs(), implementation="xla", interpret=True)


def test_positive_g_is_rejected_without_a_log():
  q, k, v, g, beta = _inputs()
  with pytest.raises(ValueError, match="g is the log-space decay"):
    kda_inference(q, k, v, g + 1.0, beta, implementation="pallas_tpu", interpret=True)


def test_peak_memory_formula_within_ten_percent_of_io():
  """B=1, H=8, K=V=128, bf16 in the lane-dense layout: inputs + outputs + <= 10 % (the compiled
  figures are checked against the formula in tests/aot/test_tpu_kernel_compile.py); the
  `[B, T, H, K]` layout is read in place (H = 8, K = V = 128) and adds only o's relayout buffer,
  with K = 64 (padded to 128) the padded copies of q, k, g, v as well."""
  for t in (512, 8192):
    x = [jnp.zeros((1, t, 8 * 128), jnp.bfloat16)] * 4 + [jnp.zeros((1, t, 8), jnp.bfloat16)]
    seg = jnp.ones((t,), jnp.int32)
    est = estimate_peak_memory(*x, segment_ids=seg, max_num_segments=2, num_heads=8,
                               implementation="pallas_tpu")
    io = 5 * t * 8 * 128 * 2 + t * 8 * 2 + t * 4
    assert io <= est <= 1.10 * io, (t, est, io)
    split = [a.reshape(1, t, 8, 128) for a in x[:4]] + [x[4]]
    est4 = estimate_peak_memory(*split, segment_ids=seg, max_num_segments=2, implementation="pallas_tpu")
    assert est4 - est == t * 8 * 128 * 2, (t, est4, est)
    narrow = [jnp.zeros((1, t, 8, 64), jnp.bfloat16)] * 4 + [x[4]]
    est64 = estimate_peak_memory(*narrow, segment_ids=seg, max_num_segments=2,
                                 implementation="pallas_tpu")
    assert est64 >= 5 * t * 8 * 128 * 2, (t, est64)


def test_implementation_keyword_and_retired_backend():
  """`implementation=` names the kernel; the retired `backend=` alias is an unknown keyword."""
  x = _inputs()
  o, _ = kda_inference(*x, implementation="xla")
  assert o.shape == x[2].shape
  with pytest.raises(TypeError, match="backend"):
    kda_inference(*x, backend="xla")
  with pytest.raises(ValueError, match="unknown implementation"):
    kda_inference(*x, implementation="bogus")


def test_validates_once_per_call(monkeypatch):
  """The XLA path does not re-run the contract checks kda_inference already ran."""
  from kda_plugin.ops import _contract, inference
  calls = []
  real = _contract.check_kda_inputs
  monkeypatch.setattr(inference, "check_kda_inputs", lambda *a, **k: calls.append(1) or real(*a, **k))
  import kda_plugin.ops.inference_xla as ix
  monkeypatch.setattr(ix, "check_kda_inputs", lambda *a, **k: calls.append(2) or real(*a, **k))
  kda_inference(*_inputs(), implementation="xla")
  assert calls == [1]


def test_lane_dense_width_must_split_into_heads():
  z = lambda *s: jnp.zeros(s, jnp.float32)
  with pytest.raises(ValueError, match=r"with num_heads=3, q must have shape \[B, T, H\*K\]"):
    kda_inference(z(1, 8, 16), z(1, 8, 16), z(1, 8, 16), z(1, 8, 16), z(1, 8, 3), num_heads=3,
                  implementation="xla")


# pallas_gpu's own limits (kda_plugin.ops.pallas_gpu.check_limits), checked before any kernel is built.
@pytest.mark.parametrize("k,v,segments,limit", [(16, 192, 1, "K and V up to 128"),
                                                 (16, 16, 70_000, "at most 65535 segments")])
def test_pallas_gpu_limits_raise_before_lowering(monkeypatch, k, v, segments, limit):
  from kda_plugin.ops import pallas_gpu

  def no_kernel(*a, **kw):
    raise AssertionError("pallas_call reached: the limit must be checked before lowering")

  monkeypatch.setattr(pallas_gpu.pl, "pallas_call", no_kernel)
  with pytest.raises(ValueError, match=f"'pallas_gpu' supports {limit}"):
    pallas_gpu.check_limits(k, v, segments)
  q, kk, vv, g, beta = _inputs(k=k, v=v)
  seg = jnp.ones((1, 8), jnp.int32)
  with pytest.raises(ValueError, match=limit):
    kda_inference(q, kk, vv, g, beta, segment_ids=seg, max_num_segments=segments,
                  implementation="pallas_gpu", interpret=True)


def test_dispatch_table_modules_share_one_interface():
  """Every implementation of the table owns check / run / peak_memory_bytes, and "auto" is not one."""
  import importlib

  from kda_plugin.ops import inference
  assert inference.IMPLEMENTATIONS == ("auto", *inference.IMPLEMENTATION_MODULES)
  for name, module in inference.IMPLEMENTATION_MODULES.items():
    if name == "pallas_gpu":
      pytest.importorskip("jax.experimental.pallas.triton")
    m = importlib.import_module(module)
    assert all(callable(getattr(m, f, None)) for f in ("check", "run", "peak_memory_bytes")), name


def test_only_the_chosen_implementation_is_imported():
  """The GPU wrapper (and Triton's Pallas lowering with it) is imported only when chosen."""
  import subprocess
  import sys
  code = ("import sys, jax.numpy as jnp\n"
          "from kda_plugin.ops import kda_inference\n"
          "z = lambda *s: jnp.zeros(s, jnp.float32)\n"
          "kda_inference(z(1, 8, 1, 16), z(1, 8, 1, 16), z(1, 8, 1, 16), z(1, 8, 1, 16), z(1, 8, 1),"
          " implementation='xla')\n"
          "print(sorted(m for m in sys.modules if m.startswith('kda_plugin.ops.inference_') or"
          " m == 'kda_plugin.ops.pallas_gpu'))\n")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                     env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.strip() == "['kda_plugin.ops.inference_xla']", r.stdout
