"""Real TPU compiles of `kda_decode_step` from this CPU-only host, on both ends of the supported JAX
range (jax 0.10.2 + libtpu 0.0.42.1, the lent TPU's image, compiled for one chip of v5e:2x2; and the
newest jax for v5e:1x1).

Each case runs `tests/aot/compile_decode_tpu.py` in a libtpu venv (one compile per process) as a
server calls the step (own jit, state donated) and asserts on the compiled executable:
  - `auto` on a TPU runs the Mosaic kernel (one tpu_custom_call);
  - the new state is written over the donated state (`alias_bytes` = the state's bytes) and there
    are no temporaries: no relayout or defensive copy of the state around the kernel, nor any
    `[B, H, K]` reshape copy (the kernel takes the caller's layout);
  - `xla` compiles too, with no kernel;
  - the decode loop of tools/bench/kernel_device_time keeps the state in HBM (not VMEM) and in place.
Shapes: the serving rows of docs/performance.md (H=24, K=V=128, B=1/32/128, bf16 inputs), float32
inputs, and a small odd shape (H=3, K=8, V=16) like the tiny configs.
"""

from __future__ import annotations

import pytest

MODULE = "tests.aot.compile_decode_tpu"
CASES = [dict(batch=1), dict(batch=32), dict(batch=128), dict(batch=32, dtype="float32"),
         dict(batch=7, heads=3, key_dim=8, value_dim=16), dict(batch=32, implementation="xla")]


def _id(c):
  return "-".join(f"{k}{v}" for k, v in c.items())


def _run(runner, chip, c):
  args = ["--chip", chip]
  for key, value in c.items():
    args += [f"--{key.replace('_', '-')}", str(value)]
  return runner.run(MODULE, *args, timeout=300)


def _check(report, c):
  b, h = c["batch"], c.get("heads", 24)
  kd, vd = c.get("key_dim", 128), c.get("value_dim", 128)
  lanes = -(-vd // 128) * 128  # the state's V dim is tiled to 128 lanes in HBM
  rows = -(-kd // 8) * 8
  state = b * h * rows * lanes * 4
  assert report["kernels"] == (0 if c.get("implementation") == "xla" else 1), report
  assert report["alias_bytes"] == state, (report, state)
  assert report["temp_bytes"] == 0, report


@pytest.mark.aot
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_decode_step_compiles_on_jax_0_10_2(tpu_aot_jax0102, case):
  _check(_run(tpu_aot_jax0102, "v5e-2x2", case), case)


@pytest.mark.aot
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_decode_step_compiles_on_the_newest_jax(tpu_aot, case):
  _check(_run(tpu_aot, "v5e", case), case)


@pytest.mark.aot
@pytest.mark.parametrize("aot,implementation", [("tpu_aot_jax0102", "auto"), ("tpu_aot", "auto"), ("tpu_aot", "xla")])
def test_decode_benchmark_keeps_the_state_in_hbm(aot, implementation, request):
  """tools/bench/kernel_device_time's decode loop at B=32 (a 50 MB state, small enough for v5e's
  VMEM): no [B, H, K, V] buffer in VMEM (without DECODE_COMPILER_OPTIONS XLA keeps the loop carry
  there and times VMEM, not the HBM a server reads), and one state copy, the non-donated argument's
  on entry (the loop carries the state in place)."""
  runner = request.getfixturevalue(aot)
  chip = "v5e-2x2" if aot == "tpu_aot_jax0102" else "v5e"
  report = runner.run(MODULE, "--chip", chip, "--batch", "32", "--implementation", implementation,
                      "--bench-loop", timeout=300)
  assert report["state_in_vmem"] is False, report
  assert report["state_copies"] == 1, report
