"""Device time of the KDA kernels on the chip, beside their HBM and MXU floors, as JSON.

Each case is timed as a loop inside one jit (`lax.fori_loop`, the output fed back as the next call's v,
or the state as the next decode step's state), so the figure is device time: host dispatch is paid once
per loop, not per call. A case runs `--repeats` loops (median and spread reported) of enough iterations
to last about `--loop-ms`.

Phases (seconds of each in the JSON): build the inputs; compile every case at once in a thread pool
(XLA and Mosaic compile release the GIL, so a fresh machine pays about the longest compile, not the
sum); then time the cases one by one, never two at a time on the chip, and only once every compile
has finished (timed while other cases compiled on the host, the loops ran 3-40x slower and scattered
on the chip: docs/performance.md). The arrays enter the loop as
arguments, not closed-over constants (no constant folding of the inputs into the program). The JSON is
rewritten after every case, and a case that would start past `--budget-s` is recorded as skipped, so
an outer time limit never loses what was measured.

Floors (v5e): HBM bytes (inputs, outputs and final states, each once) / 819 GB/s and model FLOPs
/ 197 TFLOP/s (the chunked form's matmuls: 6CK + 4CV + 2C^2/3 + 6KV per token and head, C = 64);
floor = the larger of the two.

    python -m tools.bench.kernel_device_time --json out.json            # every case
    python -m tools.bench.kernel_device_time --cases seed_bf16 decode_h24_b32
    JAX_PLATFORMS=cpu python -m tools.bench.kernel_device_time --smoke --implementation xla --json s.json
                                                    # the tool's logic on a CPU, at small shapes
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

HBM_BYTES_PER_S = 819e9
MXU_FLOPS_PER_S = 197e12
C = 64
A_LOG, DT_BIAS, LOWER_BOUND = 0.0, -2.0, -5.0


def _docs(t, lengths):
  seg = np.zeros(t, np.int32)
  pos = 0
  for i, n in enumerate(lengths):
    seg[pos:pos + n] = i + 1
    pos += n
  return seg


def _split(t, n, seed=0):
  """n document lengths summing to t, not 64-aligned (seeded)."""
  rng = np.random.default_rng(seed)
  cuts = np.sort(rng.choice(np.arange(1, t), n - 1, replace=False))
  return list(np.diff(np.concatenate([[0], cuts, [t]])))


# name: (B, T, H, dtype, layout, document lengths per row, target ms)
PREFILL = {
    "seed_bf16": (1, 8192, 8, "bfloat16", "lane_dense", [4079, 4113], 0.35),
    "seed_bf16_heads": (1, 8192, 8, "bfloat16", "heads", [4079, 4113], 0.35 * 1.1),
    "seed_f32": (1, 8192, 8, "float32", "lane_dense", [4079, 4113], 0.70),
    "seed_f32_heads": (1, 8192, 8, "float32", "heads", [4079, 4113], 0.70 * 1.1),
    "t8192_h32_25docs": (1, 8192, 32, "bfloat16", "lane_dense", _split(8192, 25), 1.5),
    "t8192_h24_8x1024": (1, 8192, 24, "bfloat16", "lane_dense", [1024] * 8, 1.0),
    "t4096_h24_64x64": (1, 4096, 24, "bfloat16", "lane_dense", [64] * 64, 0.6),
    "one_8_token_doc_h24": (1, 8, 24, "bfloat16", "lane_dense", [8], 0.05),
    "b16_t2048_h8_4docs": (16, 2048, 8, "bfloat16", "lane_dense", [500, 530, 490, 528], 1.2),
    # Kimi-Linear's own gate: the softplus gate, no lower bound (kda_gate_lower_bound None, the config
    # default). Every case above uses the bounded gate (LOWER_BOUND), whose diagonal score blocks factor
    # into one matmul; the unbounded gate builds them elementwise (_chunk_math.intra_chunk_scores).
    "seed_bf16_softplus_gate": (1, 8192, 8, "bfloat16", "lane_dense", [4079, 4113], 0.35),
    # The 0.4B train step's shape (8 rows of 2048 tokens, 4 documents a row, H=8) with Kimi's gate: the
    # inference kernel, and the training op's forward (`kda_chunked(implementation="pallas_tpu")`: the
    # same kernel writing the state entering every chunk, `want_states`). In the op's profile at
    # 2c9b44e the latter took 15.84 ms, where b16_t2048_h8_4docs (twice the rows) took 3.07 ms at
    # 5c05c73: these rows tell the states' output from the shape, the gate and the per-row labels (the
    # step's batch gives every row its own `[B, T]` segment_ids; the other cases share one row's).
    "b8_t2048_h8_4docs_softplus": (8, 2048, 8, "bfloat16", "lane_dense", [500, 530, 490, 528], 0.6),
    "b8_t2048_h8_4docs_softplus_rows": (8, 2048, 8, "bfloat16", "lane_dense", [500, 530, 490, 528], 0.6),
    "b8_t2048_h8_4docs_train_fwd": (8, 2048, 8, "bfloat16", "lane_dense", [500, 530, 490, 528], 0.6),
}
# PREFILL cases run with lower_bound=None (the softplus gate)
SOFTPLUS_GATE = {"seed_bf16_softplus_gate", "b8_t2048_h8_4docs_softplus", "b8_t2048_h8_4docs_softplus_rows",
                 "b8_t2048_h8_4docs_train_fwd"}
TRAIN_FORWARD = {"b8_t2048_h8_4docs_train_fwd"}   # kda_chunked's forward instead of kda_inference
PER_ROW_LABELS = {"b8_t2048_h8_4docs_softplus_rows", "b8_t2048_h8_4docs_train_fwd"}   # [B, T] segment_ids
# name: (B, H, target ms, implementation). B=1's target is the XLA step's measured 0.056 ms (not to
# regress); the `_xla` rows time the XLA step beside the kernel.
DECODE = {"decode_h24_b1": (1, 24, 0.056, "auto"), "decode_h24_b32": (32, 24, 0.14, "auto"),
          "decode_h24_b128": (128, 24, 0.60, "auto"), "decode_h24_b32_xla": (32, 24, 0.14, "xla"),
          "decode_h24_b128_xla": (128, 24, 0.60, "xla")}
# A server's decode state lives in HBM between steps (one executable call a token, dozens of layers'
# states). Inside one looping jit, XLA's memory-space assignment would keep a state that fits VMEM
# (v5e: 128 MiB; B=32 H=24 is 50 MB) there for the whole loop, timing VMEM instead of HBM (it
# measured 0.113 ms at B=32, below the 0.123 ms HBM floor). This option keeps it in HBM on v5e
# (checked by tests/aot/test_tpu_decode_compile.py; an unknown option is a compile error).
DECODE_COMPILER_OPTIONS = {"xla_vf_vmem_memory_space_assignment": False}

def prefill_case(b, t, h, dtype, layout, lengths, kd=128, vd=128, implementation="pallas_tpu",
                 lower_bound=LOWER_BOUND, train_forward=False, per_row_labels=False):
  """(fn(v, consts) -> (o, final), v, consts, hbm_bytes, flops) for one kda_inference call (in-kernel
  gate, bounded by `lower_bound` or the softplus gate for None; q/k L2 norm, final states: the seed's
  options). train_forward: the training op's forward instead, `kda_chunked` (implementation
  "pallas_tpu" for the kernel, else "xla"; no final states; with the kernel, the state entering every
  chunk is written, and counted in hbm_bytes). per_row_labels: segment_ids `[B, T]` (every row its
  own copy of the labels, as a training batch has them) instead of one `[T]` row shared by all."""
  from kda_plugin.ops.chunked import kda_chunked  # noqa: PLC0415  (after jax is configured)
  from kda_plugin.ops.inference import kda_inference  # noqa: PLC0415
  rng = np.random.default_rng(0)
  dt = jnp.dtype(dtype)
  heads = layout == "heads"
  shape = lambda d: (b, t, h, d) if heads else (b, t, h * d)
  mk = lambda d: jnp.asarray(rng.standard_normal(shape(d)), dt)
  q, k, v, g = mk(kd), mk(kd), mk(vd), mk(kd)
  beta = jnp.asarray(rng.uniform(0, 1, (b, t, h)), dt)
  seg = jnp.asarray(np.broadcast_to(_docs(t, lengths), (b, t)) if per_row_labels else _docs(t, lengths))
  n = len(lengths)
  a_log = jnp.full((h,), A_LOG, jnp.float32)
  dt_bias = jnp.full((h * kd,), DT_BIAS, jnp.float32)

  def fn(v_, c):
    if train_forward:
      return kda_chunked(c["q"], c["k"], v_, c["g"], c["beta"], segment_ids=c["seg"], max_num_segments=n,
                         use_qk_l2norm=True, a_log=c["a_log"], dt_bias=c["dt_bias"], lower_bound=lower_bound,
                         num_heads=None if heads else h,
                         implementation="pallas_tpu" if implementation == "pallas_tpu" else "xla")
    return kda_inference(c["q"], c["k"], v_, c["g"], c["beta"], segment_ids=c["seg"],
                         output_final_state=True, max_num_segments=n, use_qk_l2norm=True,
                         a_log=c["a_log"], dt_bias=c["dt_bias"], lower_bound=lower_bound,
                         num_heads=None if heads else h, implementation=implementation)

  item = dt.itemsize
  hbm = b * t * h * (3 * kd + 2 * vd) * item + b * t * h * item + t * 4
  hbm += (-(-t // C) * b * h * kd * vd * 4 if train_forward and implementation == "pallas_tpu"
          else 0 if train_forward else b * n * h * kd * vd * 4)
  flops = b * t * h * (6 * C * kd + 4 * C * vd + 2 * C * C / 3 + 6 * kd * vd)
  consts = dict(q=q, k=k, g=g, beta=beta, seg=seg, a_log=a_log, dt_bias=dt_bias)
  return fn, v, consts, hbm, flops


def decode_inputs(b, h, kd=128, vd=128):
  """Seeded decode-step inputs: unit q and k, bf16 q, k, v, beta; float32 g (<= 0) and state."""
  rng = np.random.default_rng(0)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q = jnp.asarray(unit(rng.standard_normal((b, h, kd))), jnp.bfloat16)
  k = jnp.asarray(unit(rng.standard_normal((b, h, kd))), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((b, h, vd)), jnp.bfloat16)
  g = jnp.asarray(-rng.uniform(0, 0.5, (b, h, kd)), jnp.float32)
  beta = jnp.asarray(rng.uniform(0, 1, (b, h)), jnp.bfloat16)
  state = jnp.asarray(rng.standard_normal((b, h, kd, vd)) * 0.1, jnp.float32)
  return q, k, v, g, beta, state


def decode_hbm_bytes(b, h, kd=128, vd=128):
  """The state read and written once plus the small inputs."""
  return 2 * b * h * kd * vd * 4 + b * h * (3 * kd + 2 * vd) * 2 + b * h * kd * 4


def decode_case(b, h, kd=128, vd=128, implementation="auto"):
  """(fn(state) -> (new state, o), state, hbm_bytes, flops) for one `kda_decode_step` on
  `decode_inputs`."""
  from kda_plugin.ops.decode import kda_decode_step  # noqa: PLC0415  (after jax is configured)
  q, k, v, g, beta, state = decode_inputs(b, h, kd, vd)

  def fn(s):
    o, s2 = kda_decode_step(q, k, v, g, beta, s, implementation=implementation)
    return s2, o

  return fn, state, decode_hbm_bytes(b, h, kd, vd), 6 * b * h * kd * vd


def compile_decode_loop(fn, x):
  """`n` decode steps in one executable, `fn(state) -> (new state, o)`, compiled with
  DECODE_COMPILER_OPTIONS on a TPU (the state in HBM every step, as a server has it). The state is the loop
  carry, written in place each step: no copy inside the loop (one copy of the argument on entry).
  `x` may be a `jax.ShapeDtypeStruct` (ahead-of-time compiles)."""
  def body(_, carry):
    s, _o = carry
    return fn(s)

  def run(s, n):
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(fn, s)[1])
    return lax.fori_loop(0, n, body, (s, zeros))

  from kda_plugin.ops.inference import target_platform  # noqa: PLC0415  (after jax is configured)
  n = jax.ShapeDtypeStruct((), jnp.int32, sharding=getattr(x, "sharding", None))
  # the option is libtpu's: other backends reject it (an unknown option is a compile error)
  return jax.jit(run).lower(x, n).compile(DECODE_COMPILER_OPTIONS if target_platform() == "tpu" else None)


def _looped(fn):
  """One jit of `n` calls (n traced: one compile for every loop length), each call's first output
  fed back as the next call's argument; `consts` (the other inputs) are arguments of the jit."""
  @jax.jit
  def run(x, consts, n):
    def body(_, carry):
      x_, _aux = carry
      out = fn(x_, consts)
      return out[0].astype(x_.dtype).reshape(x_.shape), out[1]

    aux = jax.eval_shape(fn, x, consts)[1]
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux)
    return lax.fori_loop(0, n, body, (x, zeros))
  return run


def compile_case(kind, fn, x, consts):
  """(run(n) -> the loop's outputs, compile seconds): the case's loop traced, lowered and compiled
  ahead of the timing. kind "prefill": `_looped`; "decode": `compile_decode_loop`."""
  t0 = time.perf_counter()
  if kind == "decode":
    compiled = compile_decode_loop(fn, x)
    run = lambda n: compiled(x, n)
  else:
    compiled = _looped(fn).lower(x, consts, jnp.int32(4)).compile()
    run = lambda n: compiled(x, consts, n)
  return run, time.perf_counter() - t0


def time_compiled(run, *, repeats, loop_ms):
  """(per-call ms samples, iterations per loop) of a compiled loop (`compile_case`)."""
  jax.block_until_ready(run(jnp.int32(4)))  # first run: allocation, transfers
  t0 = time.perf_counter()
  jax.block_until_ready(run(jnp.int32(4)))
  est = (time.perf_counter() - t0) / 4 * 1e3
  iters = int(min(2000, max(8, loop_ms / max(est, 1e-3))))
  n = jnp.int32(iters)
  jax.block_until_ready(run(n))
  samples = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(run(n))
    samples.append((time.perf_counter() - t0) * 1e3 / iters)
  return samples, iters


def _commit() -> str:
  """KDA_COMMIT when set (a copied tree's git may not be the one measured), else git's HEAD."""
  if os.environ.get("KDA_COMMIT"):
    return os.environ["KDA_COMMIT"]
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


# --smoke: every case at a small size (the tool's logic, e.g. on a CPU; the figures mean nothing)
SMOKE_PREFILL_T, SMOKE_HEADS, SMOKE_DECODE_B = 256, 8, 4


def _smoke_lengths(t, lengths):
  """The case's document count at length t (at most one document per 8 tokens)."""
  n = max(1, min(len(lengths), t // 8))
  return [t] if n == 1 else _split(t, n)


def _build(name, *, smoke, implementation):
  """(shape description, fn, x, consts, hbm bytes, flops, target ms) of one case."""
  if name in PREFILL:
    b, t, h, dtype, layout, lengths, target = PREFILL[name]
    if smoke:
      b, t, h = min(b, 2), min(t, SMOKE_PREFILL_T), min(h, SMOKE_HEADS)
      lengths = _smoke_lengths(t, lengths)
    lower_bound = None if name in SOFTPLUS_GATE else LOWER_BOUND
    fn, x, consts, hbm, flops = prefill_case(b, t, h, dtype, layout, lengths,
                                             implementation=implementation, lower_bound=lower_bound,
                                             train_forward=name in TRAIN_FORWARD,
                                             per_row_labels=name in PER_ROW_LABELS)
    shape = dict(batch=b, seq_len=t, heads=h, dtype=dtype, layout=layout, documents=len(lengths),
                 gate="softplus (no lower bound)" if lower_bound is None else f"bounded ({lower_bound})",
                 op="kda_chunked forward (chunk states written)" if name in TRAIN_FORWARD else "kda_inference",
                 labels="[B, T]" if name in PER_ROW_LABELS else "[T], shared")
  else:
    b, h, target, impl = DECODE[name]
    if smoke:
      b, h = min(b, SMOKE_DECODE_B), min(h, SMOKE_HEADS)
    fn, x, hbm, flops = decode_case(b, h, implementation=impl)
    consts = None  # the decode step's small inputs are constants of its loop (`decode_case`)
    shape = dict(batch=b, heads=h, state="float32", inputs="bfloat16", implementation=impl)
  return shape, fn, x, consts, hbm, flops, None if smoke else target  # targets are for the real shapes


def _error(e: BaseException) -> str:
  return f"{type(e).__name__}: {str(e)[:400]}"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--cases", nargs="+", default=None,
                  help=f"case names (default: all but the `_xla` comparison rows): {', '.join([*PREFILL, *DECODE])}; "
                       "the prefill cases use the bounded gate except those named *softplus* and "
                       "b8_t2048_h8_4docs_train_fwd (Kimi's softplus gate; the latter times kda_chunked's forward)")
  ap.add_argument("--repeats", type=int, default=7, help="timed loops per case (median and spread; default 7)")
  ap.add_argument("--loop-ms", type=float, default=60.0, help="about how long one timed loop runs (ms, default 60)")
  ap.add_argument("--json", default=None, help="write the results here (rewritten after every case)")
  ap.add_argument("--implementation", default="pallas_tpu",
                  help="kda_inference's implementation for the prefill cases (default pallas_tpu)")
  ap.add_argument("--compile-workers", type=int, default=min(16, os.cpu_count() or 1),
                  help="cases compiled at once (default: the CPU count, at most 16)")
  ap.add_argument("--budget-s", type=float, default=None,
                  help="no case starts timing after this many seconds from the start (skipped ones "
                       "are recorded); default: no limit")
  ap.add_argument("--smoke", action="store_true",
                  help=f"every case at a small size (T <= {SMOKE_PREFILL_T}, H <= {SMOKE_HEADS}, decode "
                       f"B <= {SMOKE_DECODE_B}): checks the tool, e.g. with JAX_PLATFORMS=cpu and "
                       "--implementation xla; its figures are not measurements")
  args = ap.parse_args(argv)
  names = args.cases or [n for n in [*PREFILL, *DECODE] if not n.endswith("_xla")]
  unknown = [n for n in names if n not in PREFILL and n not in DECODE]
  if unknown:
    ap.error(f"--cases: unknown {unknown}; expected names from {[*PREFILL, *DECODE]}")
  if args.repeats < 1:
    ap.error("--repeats must be at least 1")
  if not math.isfinite(args.loop_ms) or args.loop_ms <= 0:
    ap.error(f"--loop-ms must be a finite number > 0, got {args.loop_ms}")
  if args.budget_s is not None and (not math.isfinite(args.budget_s) or args.budget_s < 0):
    ap.error(f"--budget-s must be a finite number >= 0, got {args.budget_s}")
  if args.json:  # a bad path fails now, not after every case has compiled
    from model.errors import UsageError  # noqa: PLC0415
    from tools.cli import check_output_path  # noqa: PLC0415
    try:
      check_output_path(args.json, "--json", overwrite=True)
    except UsageError as e:
      ap.error(str(e))
  if args.compile_workers < 1:
    ap.error("--compile-workers must be at least 1")
  if args.implementation not in ("pallas_tpu", "pallas_gpu", "xla"):
    ap.error(f"--implementation must be pallas_tpu, pallas_gpu or xla, got {args.implementation!r}")
  start = time.perf_counter()
  dev = jax.devices()[0]
  phases = {}
  results = {n: dict(name=n) for n in names}
  out = dict(tool="tools.bench.kernel_device_time", commit=_commit(), jax=jax.__version__,
             device=dev.device_kind, platform=dev.platform, implementation=args.implementation,
             smoke=args.smoke, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), method=(
                 "lax.fori_loop of iters_per_loop calls in one jit, output fed back; per-call ms = "
                 "loop time / iters; median and min/max over repeats; cases compiled concurrently "
                 "first, then timed one at a time"),
             budget_s=args.budget_s, phases_s=phases, cases=list(results.values()))

  def write():
    out["total_s"] = round(time.perf_counter() - start, 1)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(out, f, indent=1)

  t0 = time.perf_counter()
  built = {}
  for name in names:
    try:
      shape, fn, x, consts, hbm, flops, target = _build(name, smoke=args.smoke,
                                                        implementation=args.implementation)
    except Exception as e:  # noqa: BLE001  (a case that fails is recorded, the others still run)
      results[name]["error"] = _error(e)
      continue
    results[name].update(shape, target_ms=target)
    built[name] = (fn, x, consts, hbm, flops, target)
  phases["build"] = round(time.perf_counter() - t0, 1)

  t0 = time.perf_counter()
  compiled = {}
  with concurrent.futures.ThreadPoolExecutor(args.compile_workers) as pool:
    futures = {pool.submit(compile_case, "prefill" if name in PREFILL else "decode", fn, x, consts): name
               for name, (fn, x, consts, *_) in built.items()}
    for fut in concurrent.futures.as_completed(futures):
      name = futures[fut]
      try:
        compiled[name], secs = fut.result()
        results[name]["compile_s"] = round(secs, 1)
      except Exception as e:  # noqa: BLE001
        results[name]["error"] = _error(e)
        print(f"{name:24s} COMPILE FAILED {results[name]['error'][:200]}", flush=True)
  phases["compile"] = round(time.perf_counter() - t0, 1)
  write()

  t0 = time.perf_counter()
  for name in names:
    if name not in compiled:
      continue
    if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
      results[name]["skipped"] = f"not timed: past --budget-s {args.budget_s:g}"
      print(f"{name:24s} SKIPPED (budget)", flush=True)
      continue
    hbm, flops, target = built[name][3:]
    try:
      samples, iters = time_compiled(compiled.pop(name), repeats=args.repeats, loop_ms=args.loop_ms)
    except Exception as e:  # noqa: BLE001
      results[name]["error"] = _error(e)
      print(f"{name:24s} FAILED {results[name]['error'][:200]}", flush=True)
      continue
    finally:
      built[name] = None  # the case's device arrays are freed before the next one runs
    med = statistics.median(samples)
    hbm_ms, mxu_ms = hbm / HBM_BYTES_PER_S * 1e3, flops / MXU_FLOPS_PER_S * 1e3
    floor = max(hbm_ms, mxu_ms)
    results[name].update(
        median_ms=round(med, 4), min_ms=round(min(samples), 4), max_ms=round(max(samples), 4),
        repeats=len(samples), iters_per_loop=iters, hbm_floor_ms=round(hbm_ms, 4),
        mxu_floor_ms=round(mxu_ms, 4), floor_ms=round(floor, 4), x_floor=round(med / floor, 2),
        meets_target=None if target is None else med <= target)
    phases["time"] = round(time.perf_counter() - t0, 1)
    write()
    verdict = "" if target is None else f"  target {target}  {'ok' if med <= target else 'MISSED'}"
    print(f"{name:24s} {med:8.4f} ms  [{min(samples):.4f}, {max(samples):.4f}]  floor {floor:.4f} "
          f"({med / floor:.1f}x){verdict}", flush=True)
  phases["time"] = round(time.perf_counter() - t0, 1)
  write()
  print(f"phases (s): {phases}  total {out['total_s']} s", flush=True)
  return 0 if all("error" not in r and "skipped" not in r for r in results.values()) else 1


if __name__ == "__main__":
  sys.exit(main())
