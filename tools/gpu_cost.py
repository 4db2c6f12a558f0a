"""Estimated H200 kernel time of kda_inference(implementation="pallas_gpu") from a real deviceless sm_90a compile.

Usage (in the CUDA-plugin venv, one compile per process):
  .venv-gpu-aot/bin/python -m tools.gpu_cost [seq_len=8192] [batch=1] [heads=8] [key_dim=128]
      [value_dim=128] [dtype=bfloat16|float32] [num_segments=2] [device=h200|h100] [output_json=OUT]
      [ptx_dir=DIR [ptxas=PATH]]

It compiles the kernels (tools/gpu_compile.py: XLA's Triton passes, LLVM, ptxas for sm_90a), reads
ptxas' report (registers per thread, spills) and the PTX of each KDA kernel (tensor-core `mma.sync` /
`wgmma` and `fma.rn.f32` counts), and prints an ESTIMATE of the kernel time. Nothing runs on a GPU.

Published H200 SXM rates used (NVIDIA H200 datasheet; dense, no sparsity): TF32 tensor 494.7 TFLOP/s,
FP32 vector 66.9 TFLOP/s (128 FP32 lanes x 132 SMs x 1.98 GHz x 2), SFU (exp2) 16 per clock per SM
(CUDA guide, compute capability 9.0), HBM3e 4.8 TB/s, 132 SMs, 65,536 registers per SM. The H100 SXM
figures (4.8 -> 3.35 TB/s, same SM count and clocks for these purposes) apply with device=h100.

Formula, per kernel:
  programs per SM  = floor(65536 / (registers x 32 x warps)) (ptxas registers; at least 1; reported)
  waves            = ceil(programs / (132 x programs per SM))   (reported)
  program time     = tensor_flops / (TF32 rate / 132) + vector_ops / (FP32 lanes rate / 132)
                     + exps / (SFU rate / 132)   (the phases of one program are serial: summed)
  chunk prep       = max(ceil(programs / 132) x program time, bytes / HBM bandwidth)
                     (programs sharing an SM share its rates, so more programs per SM earn nothing)
  state pass       = steps of the longest document chain x step time, with step memory = step bytes
                     / (HBM bandwidth / active programs); when the PTX shows software-pipelined loads
                     (`cp.async`, num_stages=2) the next chunk's loads overlap this chunk's matmuls:
                     step = max(compute, memory) + 0.3 us for the dependent matmul chain
                     (w S -> vnew -> aqk vnew, kg^T vnew -> S); otherwise step = compute + memory +
                     0.6 us (that chain plus a global-load round trip). Both latencies are assumptions.
  estimated_ms     = chunk prep + state pass + XLA glue (padded copies when T, K or V need padding,
                     the zero-filled output buffer; bytes at HBM bandwidth)
Per-program counts (tensor FLOPs, vector ops, exps, bytes) are the kernels' own matmul and tile
shapes, written out in `_chunk_prep_work` / `_state_step_work`; the PTX counts confirm that the
matmuls are on the tensor cores (a kernel without `mma`/`wgmma` is charged at the FP32 vector rate).
TF32x3 (float32 inputs) is charged 3 TF32 passes.

ptx_dir=DIR: the same reading for kernels compiled elsewhere (e.g. fla's Triton kernels, compiled
deviceless by triton.compile for GPUTarget("cuda", 90, 32)): DIR/launches.json lists the launches
({name, grid, num_warps, num_stages, hash, tensor_bytes}: bytes of the launch's tensor arguments) and
DIR/<name>.<hash[:10]>.ptx their PTX; ptxas=PATH (default: the nvcc wheel's) must accept the PTX's
.version (Triton 3.9's PTX 9.4 needs its bundled ptxas-blackwell, CUDA 13.4). Per-program work is not
known for foreign kernels, so each parallel kernel is charged its MEMORY FLOOR (tensor_bytes at HBM
rate), and a kernel whose grid is one program per (V block, head, document) and walks the chunks
(name contains "fwd_kernel_h") is charged the state-pass step model above with fla's step (w S and
kg^T vnew, no output; BV from the grid). The same floor for our kernels is printed as `floor_ms`
beside our full estimate, so the two can be compared on equal terms.

What it ignores: tensor-core efficiency below peak for 64 x 64 tiles (shared-memory staging, wgmma
issue), instruction issue limits and integer/predicate work beyond the counted ops, L2 hits (every
byte is charged at HBM rate), launch overhead (~3 us per kernel), tail effects inside a wave, and
overlap between the two kernels (they run one after the other). It is an estimate, not a measurement:
tools/device_check.sh measures on a device.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys

USAGE = __doc__.split("\n\n")[1]
RATES = {"h200": dict(tf32=494.7e12, fp32=66.9e12, sfu_per_clk_sm=16, clock=1.98e9, hbm=4.8e12, sms=132),
         "h100": dict(tf32=494.7e12, fp32=66.9e12, sfu_per_clk_sm=16, clock=1.98e9, hbm=3.35e12,
                      sms=132)}
CHAIN_LATENCY_S = 0.3e-6  # dependent matmul chain of one step (assumed)
LOAD_LATENCY_S = 0.3e-6  # a global-load round trip not hidden by pipelining (assumed)
DEFAULTS = dict(seq_len=8192, batch=1, heads=8, key_dim=128, value_dim=128, dtype="bfloat16",
                num_segments=2, device="h200", output_json=None, ptx_dir=None, ptxas=None)
LOWER_BOUND = -5.0  # the bounded gate that tools/gpu_compile.compile_kda compiles (its default)
INTS = ("seq_len", "batch", "heads", "key_dim", "value_dim", "num_segments")
C = 64


class UsageError(ValueError):
  pass


def parse_args(argv):
  if any(a in ("-h", "--help") for a in argv):
    print(USAGE)
    sys.exit(0)
  args = dict(DEFAULTS)
  for a in argv:
    key, eq, value = a.partition("=")
    if not eq or key not in DEFAULTS:
      raise UsageError(f"unknown argument {a!r}; expected key=value with key in {sorted(DEFAULTS)}")
    if key in INTS:
      try:
        args[key] = int(value)
      except ValueError:
        raise UsageError(f"{key} must be an integer, got {value!r}") from None
      if args[key] < 1:
        raise UsageError(f"{key} must be >= 1, got {args[key]}")
    else:
      args[key] = value
  if args["dtype"] not in ("bfloat16", "float32"):
    raise UsageError(f"dtype must be bfloat16 or float32, got {args['dtype']!r}")
  if args["device"] not in RATES:
    raise UsageError(f"device must be one of {sorted(RATES)}, got {args['device']!r}")
  if max(args["key_dim"], args["value_dim"]) > 128:
    raise UsageError("key_dim and value_dim must be <= 128 (backend 'pallas_gpu' limit)")
  return args


@dataclasses.dataclass
class Work:
  tensor_flops: float
  vector_ops: float
  exps: float
  bytes: float


def _pow2(x):
  return max(16, 1 << (x - 1).bit_length())


def _chunk_prep_work(kp, vp, item, passes, factored) -> Work:
  """One program of kda_gpu_chunk_prep (one chunk of one head). factored: the diagonal 16x16 blocks
  are two full [C, C] tensor-core matmuls around the blocks' middle rows (bounded gate,
  `_gpu_chunk_math.factored_diagonal`) instead of 16 masked elementwise iterations."""
  below = 3 * 2 * C * C * kp  # three below-diagonal block matmuls, Akk and again Aqk
  diag = 2 * 2 * C * C * kp if factored else 0  # Akk and Aqk over all four blocks at once
  inverse = 5 * 2 * 2 * C ** 3 if passes == 1 else 0  # doubling; float32 uses row substitution
  tensor = passes * (2 * below + diag + inverse + 2 * C * C * vp + 2 * C * C * kp)
  # diagonal blocks: 16 masked iterations, ~10 ops per element (Akk+Aqk); factored: the middle-row
  # pick (a masked 16-row reduction), two exponent differences, three scalings (~10 per element) and
  # the two block-diagonal selections of the [C, C] products
  diag_ops = C * kp * 10 + 2 * C * C if factored else 16 * C * kp * 10
  inverse_ops = 0 if passes == 1 else 63 * C * C * 4
  gates_ops = 2 * C * kp * 30  # gate activation, cumsum, masks, boundary picks; recomputed in 2 passes
  # diagonal blocks, below-diagonal row/column factors, the gate (x2 passes), dec/qg/kg/w decays
  exps = (2 if factored else 16) * C * kp + 3 * 2 * C * kp + 2 * 2 * C * kp + 4 * C * kp
  read = C * (3 * kp * item + 4 * kp + vp * item + item + 12)  # q, k (+ the re-read of k), g, v, beta, ids
  write = C * (3 * kp * item + vp * item + C * item + 4 * kp)
  return Work(tensor, diag_ops + inverse_ops + gates_ops, exps, read + write)


def _state_step_work(kp, bv, item, passes) -> Work:
  """One chunk step of one kda_gpu_state_pass program (one document, one head, BV state columns)."""
  tensor = passes * (2 * 2 * C * kp * bv + 2 * C * C * bv + 2 * kp * C * bv)
  vector = C * bv * 6 + kp * bv * 2
  read = C * (3 * kp * item + bv * item + C * item + 4) + 4 * kp
  return Work(tensor, vector, 0, read + C * bv * item)


def _program_seconds(work: Work, rates, tensor_cores: bool) -> float:
  per_sm = lambda r: r / rates["sms"]
  matmul_rate = rates["tf32"] if tensor_cores else rates["fp32"]
  return (work.tensor_flops / per_sm(matmul_rate) + work.vector_ops / (per_sm(rates["fp32"]) / 2)
          + work.exps / (rates["sfu_per_clk_sm"] * rates["clock"]))


def estimate(args, kernels) -> dict:
  """The estimate from the shape and the compiled kernels' reports (see the module docstring)."""
  rates = RATES[args["device"]]
  b, t, h = args["batch"], args["seq_len"], args["heads"]
  kp, vp = _pow2(args["key_dim"]), _pow2(args["value_dim"])
  item = 2 if args["dtype"] == "bfloat16" else 4
  from kda_plugin.ops import _gpu_chunk_math as gm  # noqa: PLC0415
  from kda_plugin.ops import pallas_gpu as pg  # noqa: PLC0415
  passes = 1 if item == 2 else 3
  bv = min(pg.BLOCK_V[passes], vp)
  nc = -(-t // C)
  n = args["num_segments"]
  find = lambda prefix: next(v for k_, v in kernels.items() if k_.startswith(prefix))
  prep_k, state_k = find("kda_gpu_chunk_prep"), find("kda_gpu_state_pass")
  out = {}
  # chunk prep
  warps = 8
  per_sm = max(1, 65536 // (prep_k["registers"] * 32 * warps))
  programs = nc * b * h
  waves = math.ceil(programs / (rates["sms"] * per_sm))
  work = _chunk_prep_work(kp, vp, item, passes, gm.factored_diagonal(LOWER_BOUND))
  tc = prep_k["mma"] + prep_k["wgmma"] > 0
  # Co-resident programs share their SM's rates: an SM's time is the programs it runs times one
  # program's time at the full SM rates, however many run at once (residency only hides latency,
  # which this model does not credit).
  compute_s = math.ceil(programs / rates["sms"]) * _program_seconds(work, rates, tc)
  memory_s = programs * work.bytes / rates["hbm"]
  out["chunk_prep"] = dict(programs=programs, programs_per_sm=per_sm, waves=waves,
                           program_tensor_flops=work.tensor_flops, program_vector_ops=work.vector_ops,
                           program_exps=work.exps, bytes=programs * work.bytes,
                           compute_ms=compute_s * 1e3, memory_ms=memory_s * 1e3,
                           estimated_ms=max(compute_s, memory_s) * 1e3, tensor_cores=tc,
                           ptx=dict(mma=prep_k["mma"], wgmma=prep_k["wgmma"], fma_f32=prep_k["fma_f32"],
                                    ex2_static=prep_k.get("ex2", 0)),
                           registers=prep_k["registers"])
  # state pass: the seed-style layout, num_segments documents of equal length per row
  steps = math.ceil(nc / n) + (1 if n > 1 else 0)
  active = (vp // bv) * b * h * n
  step = _state_step_work(kp, bv, item, passes)
  tc2 = state_k["mma"] + state_k["wgmma"] > 0
  step_compute = _program_seconds(step, rates, tc2)
  step_memory = step.bytes / (rates["hbm"] / min(active, rates["sms"]))
  pipelined = state_k.get("cp_async", 0) > 0
  if pipelined:
    step_s = max(step_compute, step_memory) + CHAIN_LATENCY_S
  else:
    step_s = step_compute + step_memory + CHAIN_LATENCY_S + LOAD_LATENCY_S
  waves2 = math.ceil(active / rates["sms"])
  out["state_pass"] = dict(programs_with_work=active, steps_per_chain=steps, waves=waves2,
                           step_tensor_flops=step.tensor_flops, step_bytes=step.bytes,
                           step_compute_us=step_compute * 1e6, step_memory_us=step_memory * 1e6,
                           pipelined_loads=pipelined, step_us=step_s * 1e6,
                           estimated_ms=waves2 * steps * step_s * 1e3,
                           tensor_cores=tc2, registers=state_k["registers"],
                           ptx=dict(mma=state_k["mma"], wgmma=state_k["wgmma"],
                                    fma_f32=state_k["fma_f32"], cp_async=state_k.get("cp_async", 0)))
  # XLA glue: padded copies of q, k, g, v only when T, K or V need padding (a zero pad is elided), the
  # zero-filled output buffer the state pass writes into, and the small per-row tables (ignored).
  padded = t % C != 0 or kp != args["key_dim"] or vp != args["value_dim"]
  glue_bytes = (b * t * h * (2 * kp * item + 4 * kp + vp * item) * 2 if padded else 0)
  glue_bytes += b * nc * C * h * vp * item
  out["glue_ms"] = glue_bytes / rates["hbm"] * 1e3
  out["estimated_ms"] = out["chunk_prep"]["estimated_ms"] + out["state_pass"]["estimated_ms"] + out["glue_ms"]
  out["floor_ms"] = out["chunk_prep"]["memory_ms"] + out["state_pass"]["estimated_ms"] + out["glue_ms"]
  out["label"] = ("ESTIMATE from a deviceless compile and published rates (tools/gpu_cost.py docstring); "
                  "not a measurement")
  out["rates"] = dict(rates, chain_latency_s=CHAIN_LATENCY_S, load_latency_s=LOAD_LATENCY_S)
  return out


def _run_ptxas(ptxas, ptx_path) -> dict:
  import subprocess  # noqa: PLC0415
  from tools.gpu_compile import parse_ptxas  # noqa: PLC0415
  proc = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", str(ptx_path), "-o", "/dev/null"],
                        capture_output=True, text=True, timeout=300)
  if proc.returncode != 0:
    raise UsageError(f"ptxas failed on {ptx_path}: {proc.stderr.strip().splitlines()[-1:]}")
  text = proc.stderr.replace("ptxas info    : Used", "Used")
  info = parse_ptxas(text)
  return next(iter(info.values())) if info else {}


def estimate_ptx_dir(args) -> dict:
  """Floors for foreign kernels (see the module docstring, ptx_dir=)."""
  import pathlib  # noqa: PLC0415
  from tools.gpu_compile import count_instructions  # noqa: PLC0415
  rates = RATES[args["device"]]
  d = pathlib.Path(args["ptx_dir"])
  try:
    launches = [l for l in json.loads((d / "launches.json").read_text()) if l.get("config") is None]
  except (OSError, ValueError) as e:
    raise UsageError(f"ptx_dir={d}: cannot read launches.json ({e})") from None
  ptxas = args["ptxas"]
  if ptxas is None:
    from tools.gpu_compile import _site_packages  # noqa: PLC0415
    ptxas = str(_site_packages() / "nvidia" / "cuda_nvcc" / "bin" / "ptxas")
  b, t, h, n = args["batch"], args["seq_len"], args["heads"], args["num_segments"]
  kp, vp = _pow2(args["key_dim"]), _pow2(args["value_dim"])
  item = 2 if args["dtype"] == "bfloat16" else 4
  nc = -(-t // C)
  kernels, total = [], 0.0
  for l in launches:
    path = d / f"{l['name']}.{l['hash'][:10]}.ptx"
    ptx = path.read_text()
    counts = count_instructions(ptx)
    info = _run_ptxas(ptxas, path)
    programs = math.prod(l["grid"])
    regs = info.get("registers") or 255
    per_sm = max(1, 65536 // (regs * 32 * l["num_warps"]))
    row = dict(name=l["name"], grid=l["grid"], num_warps=l["num_warps"], num_stages=l["num_stages"],
               registers=info.get("registers"), spill_store_bytes=info.get("spill_store_bytes"),
               programs=programs, programs_per_sm=per_sm,
               waves=math.ceil(programs / (rates["sms"] * per_sm)), bytes=l["tensor_bytes"], **counts)
    row["memory_ms"] = l["tensor_bytes"] / rates["hbm"] * 1e3
    if "fwd_kernel_h" in l["name"]:
      bv = vp * b * h * n // programs
      tensor = 2 * C * kp * bv + 2 * kp * C * bv
      step_bytes = C * (2 * kp * item + bv * item) + kp * bv * item + C * bv * item
      step_compute = _program_seconds(Work(tensor, C * bv * 4 + kp * bv * 2, C * kp, step_bytes), rates,
                                      counts["mma"] + counts["wgmma"] > 0)
      step_memory = step_bytes / (rates["hbm"] / min(programs, rates["sms"]))
      if counts["cp_async"] > 0:
        step_s = max(step_compute, step_memory) + CHAIN_LATENCY_S
      else:
        step_s = step_compute + step_memory + CHAIN_LATENCY_S + LOAD_LATENCY_S
      steps = math.ceil(nc / n) + (1 if n > 1 else 0)
      row.update(block_v=bv, steps_per_chain=steps, step_us=step_s * 1e6,
                 estimated_ms=math.ceil(programs / rates["sms"]) * steps * step_s * 1e3)
    else:
      row["estimated_ms"] = row["memory_ms"]
    total += row["estimated_ms"]
    kernels.append(row)
  return dict(kernels=kernels, floor_ms=total,
              label=("ESTIMATE (floor: memory-bound parallel kernels + state-pass step model) from a "
                     "deviceless compile and published rates (tools/gpu_cost.py docstring); not a "
                     "measurement"))


def main(argv) -> int:
  try:
    args = parse_args(argv)
    if args["ptx_dir"]:
      result = dict(shape={k: v for k, v in args.items() if k not in ("output_json", "ptx_dir", "ptxas")},
                    **estimate_ptx_dir(args))
      text = json.dumps(result, indent=1)
      if args["output_json"]:
        from tools.atomic_file import atomic_writer  # noqa: PLC0415
        with atomic_writer(args["output_json"]) as f:
          f.write(text + "\n")
      print(f"floor_ms (ESTIMATE, not measured): {result['floor_ms']:.3f}  [" + ", ".join(
          f"{k['name']} {k['estimated_ms']:.3f}" for k in result["kernels"]) + "]")
      print(json.dumps({"floor_ms": result["floor_ms"]}))
      return 0
  except UsageError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  from tools.gpu_compile import compile_kda  # noqa: PLC0415
  reports, seconds, _ = compile_kda(device=args["device"], batch=args["batch"], seq_len=args["seq_len"],
                                    heads=args["heads"], key_dim=args["key_dim"],
                                    value_dim=args["value_dim"], dtype=args["dtype"],
                                    num_segments=args["num_segments"])
  kernels = {k: {f: v for f, v in dataclasses.asdict(r).items() if f != "ptx"} for k, r in reports.items()}
  result = dict(shape={k: v for k, v in args.items() if k != "output_json"}, compile_seconds=seconds,
                kernels=kernels, **estimate(args, kernels))
  text = json.dumps(result, indent=1)
  if args["output_json"]:
    from tools.atomic_file import atomic_writer  # noqa: PLC0415
    with atomic_writer(args["output_json"]) as f:
      f.write(text + "\n")
  print(f"estimated_ms (ESTIMATE, not measured): {result['estimated_ms']:.3f}  "
        f"[chunk prep {result['chunk_prep']['estimated_ms']:.3f}, state pass "
        f"{result['state_pass']['estimated_ms']:.3f}, glue {result['glue_ms']:.3f}]; floor_ms "
        f"{result['floor_ms']:.3f}")
  print(json.dumps({"estimated_ms": result["estimated_ms"]}))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
