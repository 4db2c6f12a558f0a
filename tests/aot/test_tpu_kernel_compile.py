"""Real TPU compiles of `kda_inference(implementation="pallas_tpu")` from this CPU-only host.

Each case runs `tests/aot/compile_kda_tpu.py` in the libtpu venv, one compile per process (a Mosaic
CHECK failure aborts the process), and asserts on the compiled executable's `memory_analysis()`:
  - arguments and outputs are exactly the call's own arrays (no hidden operand in HBM);
  - at the seed shape (B=1, T=8192, H=8, K=V=128, two packed documents split at T/2-17, in-kernel
    gate and q/k L2 norm, final states; lane-dense `[B, T, H*K]` inputs) compiled temporaries are
    at most 10 % of arguments + outputs on v5e, v6e and TPU7x (no relayout copy around the kernel,
    no 1-wide padded beta / segment columns);
  - `estimate_peak_memory` (a closed form, nothing compiled) is within 10 % of arguments + outputs
    + temporaries.
`make test` runs the FAST cases and the `*_FAST` layouts below (about 10 s each); `make test-slow` adds
the whole lowering matrix (initial state x final state x gate family x dtype) on all three generations
and every layout at both ends of the JAX range.
"""

from __future__ import annotations

import itertools

import pytest

MODULE = "tests.aot.compile_kda_tpu"
SEED = dict(batch=1, seq_len=8192, heads=8, key_dim=128, value_dim=128, docs=2)


def _case(chip, dtype="bfloat16", gate="bounded", h0=False, final=True, **shape):
  return dict(chip=chip, dtype=dtype, gate=gate, h0=h0, final=final, **{**SEED, **shape})


def _id(c):
  shape = "" if all(c[k] == v for k, v in SEED.items()) else (
      f"-B{c['batch']}-K{c['key_dim']}-N{c.get('num_segments', c['docs'])}")
  return (f"{c['chip']}-{c['dtype']}-{c['gate']}{'-h0' if c['h0'] else ''}"
          f"{'' if c['final'] else '-nofinal'}{shape}")


# Each dtype and gate family once, with and without an initial state, on each generation; the rest
# of the matrix (and the K = V = 64 / 256 head sizes) is in SLOW. The bf16 bounded-gate lowering on
# TPU7x is compiled by the B=256 case (SMEM must not grow with B*T), so its seed shape is SLOW too.
FAST = ([_case("tpu7x", "float32", "softplus", True)]
        + [_case("tpu7x", batch=256, docs=16, num_segments=16)]
        + [_case("v5e", "bfloat16", "softplus"), _case("v6e", "bfloat16", "bounded")])
SLOW = [_case(chip, d, g, h, f) for chip in ("v5e", "v6e", "tpu7x")
        for h, f, g, d in itertools.product([False, True], [False, True],
                                            ["pre_activated", "softplus", "bounded"],
                                            ["float32", "bfloat16"])]
SLOW = ([c for c in SLOW if _id(c) not in {_id(f) for f in FAST}]
        + [_case("tpu7x", key_dim=64, value_dim=64), _case("tpu7x", key_dim=256, value_dim=256)])


def _compile(tpu_aot, c) -> dict:
  args = ["--chip", c["chip"], "--dtype", c["dtype"], "--gate", c["gate"], "--batch", str(c["batch"]),
          "--seq-len", str(c["seq_len"]), "--heads", str(c["heads"]), "--key-dim", str(c["key_dim"]),
          "--value-dim", str(c["value_dim"]), "--docs", str(c["docs"])]
  if "num_segments" in c:
    args += ["--num-segments", str(c["num_segments"])]
  if c["h0"]:
    args.append("--h0")
  if not c["final"]:
    args.append("--no-final")
  return tpu_aot.run(MODULE, *args, timeout=600)


def _expected_io(c) -> tuple[int, int]:
  """Bytes of the call's own arguments and outputs (the independent count memory_analysis must match)."""
  b, t, h, kd, vd = c["batch"], c["seq_len"], c["heads"], c["key_dim"], c["value_dim"]
  n = c.get("num_segments", c["docs"])
  item = 2 if c["dtype"] == "bfloat16" else 4
  g_item = 4 if c["gate"] == "pre_activated" else item
  state = b * n * h * kd * vd * 4
  final = b * n * h * kd * (-(-vd // 128) * 128) * 4  # [.., K, V] tiled: V padded to 128 lanes in HBM
  lanes = lambda x: -(-x // 128) * 128  # a 1-D array is tiled by at least 128 elements
  args = (b * t * h * (2 * kd * item + vd * item + kd * g_item + item) + lanes(t) * 4
          + (lanes(h) * 4 + lanes(h * kd) * 4 if c["gate"] != "pre_activated" else 0))
  if c["h0"]:
    args += state
  outs = b * t * h * vd * item + (final if c["final"] else 0)
  return args, outs


def _check(report, c, *, temp_limit):
  want_args, want_outs = _expected_io(c)
  args, outs, temps = report["argument_bytes"], report["output_bytes"], report["temp_bytes"]
  assert args == want_args, (args, want_args)
  # XLA adds the output tuple's index table to a multi-output executable (up to 512 bytes seen)
  assert want_outs <= outs <= want_outs + 1024, (outs, want_outs)
  if temp_limit is not None:
    assert temps <= temp_limit * (args + outs), (
        f"temporaries {temps / 1e6:.2f} MB > {temp_limit:.0%} of arguments + outputs "
        f"{(args + outs) / 1e6:.1f} MB")
  total = args + outs + temps
  est = report["estimate_bytes"]
  assert abs(est - total) <= 0.10 * total, (
      f"estimate_peak_memory {est / 1e6:.2f} MB vs compiled {total / 1e6:.2f} MB")


def _is_seed(c) -> bool:
  return all(c[k] == v for k, v in SEED.items())


@pytest.mark.aot
@pytest.mark.parametrize("case", FAST, ids=_id)
def test_tpu_kernel_compiles_lean(tpu_aot, case):
  report = _compile(tpu_aot, case)
  _check(report, case, temp_limit=0.10 if _is_seed(case) else None)


@pytest.mark.aot
@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=_id)
def test_tpu_kernel_lowering_matrix_compiles(tpu_aot, case):
  report = _compile(tpu_aot, case)
  _check(report, case, temp_limit=0.10 if _is_seed(case) else None)


@pytest.mark.aot
def test_call_larger_than_hbm_is_a_value_error_before_lowering(tpu_aot):
  """B=256 at the seed shape on v5e needs about 23 GiB of HBM buffers (estimate_peak_memory), more
  than the 15.75 GiB libtpu lets a v5e device use: kda_inference refuses it while tracing, naming
  the limit, instead of libtpu's RESOURCE_EXHAUSTED at compile (the same batch fits TPU7x: the
  large-batch case of test_tpu_kernel_compiles_lean)."""
  case = _case("v5e", batch=256)
  report = _compile(tpu_aot, case)
  assert "value_error" in report, report
  message = report["value_error"]
  assert "one TPU v5 lite device has 15.75 GiB" in message and "split the batch" in message, message
  need = float(message.split("needs about ")[1].split(" GiB")[0])
  assert 20 < need < 26, message


# Both ends of the supported JAX range, both layouts, bf16 and float32, the configs' head counts
# (8: the seed and the 0.9B test model; 32: Kimi-Linear-48B). The oldest end is the lent TPU's image
# (jax 0.10.2 + libtpu 0.0.42.1, whose Mosaic strides 32-bit data only: a bf16 strided load failed
# to compile there); its libtpu takes no v5e topology below 2x2, so one chip of v5e:2x2 is compiled.
# Head-major inputs are read in place: no relayout copy around the kernel (temporaries at most 10 %
# of arguments + outputs, the shared segment map's SMEM copies).
BOTH_ENDS = [dict(layout=layout, dtype=dtype, heads=heads)
             for layout in ("lane_dense", "heads") for dtype in ("bfloat16", "float32")
             for heads in (8, 32) if not (heads == 32 and dtype == "float32")]
# make test: each layout and dtype once per end (the bf16 strided load that failed on jax 0.10.2 included)
OLDEST_FAST = {"heads-bfloat16-H32", "lane_dense-float32-H8"}
# (lane-dense bf16 at the newest end is also test_tpu_kernel_compiles_lean's v5e case)
NEWEST_FAST = {"heads-float32-H8"}


def _ends(fast):
  name = lambda c: f"{c['layout']}-{c['dtype']}-H{c['heads']}"
  return [pytest.param(c, id=name(c), marks=() if name(c) in fast else pytest.mark.slow) for c in BOTH_ENDS]


def _layout_args(chip, c, precision=None):
  args = ["--chip", chip, "--dtype", c["dtype"], "--layout", c["layout"], "--heads", str(c["heads"]),
          "--seq-len", "2048"]
  return args + (["--matmul-precision", precision] if precision else [])


def _check_layout(report):
  io = report["argument_bytes"] + report["output_bytes"]
  assert report["temp_bytes"] <= 0.10 * io, (
      f"temporaries {report['temp_bytes'] / 1e6:.2f} MB > 10% of arguments + outputs {io / 1e6:.1f} MB: "
      "a relayout copy around the kernel")


@pytest.mark.aot
@pytest.mark.parametrize("case", _ends(OLDEST_FAST))
def test_kernel_compiles_on_jax_0_10_2(tpu_aot_jax0102, case):
  _check_layout(tpu_aot_jax0102.run(MODULE, *_layout_args("v5e-2x2", case), timeout=600))


@pytest.mark.aot
@pytest.mark.parametrize("case", _ends(NEWEST_FAST))
def test_kernel_compiles_on_the_newest_jax(tpu_aot, case):
  _check_layout(tpu_aot.run(MODULE, *_layout_args("v5e", case), timeout=600))


@pytest.mark.aot
@pytest.mark.parametrize("aot", ["tpu_aot_jax0102", pytest.param("tpu_aot", marks=pytest.mark.slow)])
def test_bf16_kernel_compiles_under_a_highest_precision_context(aot, request):
  """A caller's jax.default_matmul_precision('highest') must not reach the kernel's bf16 products
  (Mosaic refuses fp32 contract precision on bf16 operands)."""
  runner = request.getfixturevalue(aot)
  chip = "v5e-2x2" if aot == "tpu_aot_jax0102" else "v5e"
  case = dict(layout="heads", dtype="bfloat16", heads=8)
  _check_layout(runner.run(MODULE, *_layout_args(chip, case, "highest"), timeout=600))


# The KDA training op at the 0.4B train step's shape (8 x 2048 packed, 4 documents a row, H=8,
# K=V=128, lane-dense bf16, Kimi's softplus gate): `kda_chunked(implementation="pallas_tpu")`'s value
# and gradients compile with the kernel's forward and backward in the program (two Mosaic calls). Its
# temporaries are the saved chunk states (NC x B x H x K x V float32: 134 MB) and the backward
# kernel's operands, so a whole relaid-out copy of an operand (33.5 MB each) beyond them would show. Compiled: 207 MB at jax 0.10.2,
# 199 MB at jax 0.12 (the XLA op: 513 MB there; a first version of this backward that scanned over
# relaid-out copies took 396 / 469 MB).
STATE_BYTES = 32 * 8 * 8 * 128 * 128 * 4
CHUNK_WORKING_SET = 96 * 2**20


# Both ends are `make test-slow` (about a minute each); in `make test` the five-layer train step of
# tests/aot/test_aot_compile.py compiles this op for v5e at the newest end, kernel included.
@pytest.mark.aot
@pytest.mark.slow
@pytest.mark.parametrize("aot", ["tpu_aot_jax0102", "tpu_aot"])
def test_training_op_compiles_with_the_forward_and_backward_kernels(aot, request):
  runner = request.getfixturevalue(aot)
  chip = "v5e-2x2" if aot == "tpu_aot_jax0102" else "v5e"
  report = runner.run(MODULE, "--chip", chip, "--gate", "softplus", "--batch", "8", "--seq-len", "2048",
                      "--heads", "8", "--docs", "4", "--train", "pallas_tpu", timeout=600)
  assert report["train"] == "pallas_tpu" and report["kernel_calls"] == 2, report  # forward, backward
  assert report["temp_bytes"] <= STATE_BYTES + CHUNK_WORKING_SET, (
      f"temporaries {report['temp_bytes'] / 1e6:.1f} MB > the chunk states' {STATE_BYTES / 1e6:.1f} MB + "
      f"{CHUNK_WORKING_SET / 1e6:.1f} MB: a whole copy of an operand?")
