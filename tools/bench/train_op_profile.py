r"""Where the KDA training op's device time goes: one forward + backward of `kda_chunked` traced with
jax's profiler, the compiled program's instructions summed by the source line they come from.

    python -m tools.bench.train_op_profile --json FILE [--implementation pallas_tpu|xla]
        [--gate model_init|steep] [--batch 8] [--seq-len 2048] [--heads 8] [--docs 4] [--top 60] [--smoke]

What it does, in order:
  1. builds the value and input gradients of `kda_chunked(implementation=...)` on lane-dense bf16
     inputs with Kimi's in-op softplus gate and q/k L2 norm, `--docs` equal documents a row (as the
     train check's split phase times it: `tools/bench/train_device.py`, `kda_op_program`); `--gate`
     draws the gate's inputs as the model's at initialisation (`model_init`, the default) or steeper
     (`steep`: most chunks then take the costliest score paths; `OP_GATES` says how each is drawn);
  2. times it: `--repeats` runs of `--calls` calls dispatched together, blocked once (device time),
     the median and the spread of ms a call;
  3. traces one call with `jax.profiler.trace` and sums every device event named like an instruction
     of the compiled program (`decode_profile.instruction_times`; a loop's own time is its body's);
  4. writes JSON (whole, or nothing): `call_ms`, `runs_ms`; `by_source_ms` (the innermost frame XLA
     records for each instruction and the frame that called it, `file:line function < file:line
     function`: which line of the chunk math costs what);
     `by_opcode_ms` (custom-calls by kernel); `top`: the `--top` largest instructions that run in the
     program's order, with their `ms` and `count` in the call, shape, fusion kind and source;
     `in_order_ms`: the time of every such instruction (near `call_ms` when the trace holds the
     whole call); `top_async` and `async_span_ms`: the asynchronous starts (`copy-start`,
     `slice-start`), whose events span a transfer while the others run, so they overlap the call
     (the exposed wait is the matching `-done`'s); `sum_ms`: every event, both kinds (above
     `call_ms` where they overlap); `compile_s`, `plane` (the trace's device plane),
     `instructions_seen`, `device`, `jax` and `args` say how it ran. On a CPU, XLA's XNNPACK
     fusions carry no source frame: their time is under "?".
A trace in which no event is named like an instruction still writes the time and exits 1.

On a CPU, `--smoke` (tiny shapes, the XLA implementation) is the test; the figures are for the chip:
the pallas_tpu implementation needs a TPU.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
import types

import jax
import numpy as np

from model.engine import compilation_cache
from model.errors import UsageError
from tools.bench import decode_profile as dp
from tools.bench.train_device import OP_GATES, kda_op_program


def by_source(times: dict[str, list[int]], instructions: dict) -> dict[str, float]:
  """Milliseconds by the instruction's innermost source frame and its caller (`source < caller`; "?"
  where XLA records no frame)."""
  total: dict[str, int] = collections.Counter()
  for name, (ns, _) in times.items():
    info = instructions[name]
    total[" < ".join(filter(None, (info.get("source", "?"), info.get("caller"))))] += ns
  return {k: round(v / 1e6, 5) for k, v in sorted(total.items(), key=lambda kv: -kv[1])}


def per_call(row: dict) -> dict:
  """A `decode_profile.summarize` row for one traced call: `ms` and `count` (its `*_per_step` for one
  step), without the model part (an op has none)."""
  row = dict(row)
  row["ms"], row["count"] = row.pop("ms_per_step"), row.pop("count_per_step")
  row.pop("part", None)
  return row


def run(args) -> dict:
  import jax.numpy as jnp  # noqa: PLC0415

  cfg = types.SimpleNamespace(kda_gate_lower_bound=None)   # Kimi's softplus gate
  lowered, (_, operands) = kda_op_program(args.batch, args.seq_len, args.heads, args.key_dim, args.docs,
                                          args.implementation, jnp.bfloat16, cfg, np.random.default_rng(0),
                                          gate=args.gate)
  t0 = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t0
  call = lambda: compiled(*operands)
  jax.block_until_ready(call())
  runs = []
  for _ in range(args.repeats):
    t0 = time.perf_counter()
    outs = [call() for _ in range(args.calls)]
    jax.block_until_ready(outs)
    runs.append((time.perf_counter() - t0) / args.calls * 1e3)
  call_ms = statistics.median(runs)
  print(f"kda_chunked[{args.implementation}] B={args.batch} T={args.seq_len} H={args.heads}, gate {args.gate}: "
        f"{call_ms:.3f} ms forward + backward (median of {len(runs)} runs; min {min(runs):.3f}, "
        f"max {max(runs):.3f}); compiled in {compile_s:.1f} s", flush=True)
  instructions, plane, times, lines_seen = dp.traced_instruction_times(call, compiled)
  summary = dp.summarize(times, instructions, 1, args.top)
  sources = by_source(times, instructions)
  print(f"profile ({plane}): {summary['instructions_seen']} instructions, {summary['in_order_ms_per_step']:.3f} ms "
        f"in order (asynchronous spans beside them: {summary['async_span_ms_per_step']:.3f} ms)",
        flush=True)
  for src, ms in list(sources.items())[:args.top]:
    print(f"  {ms:9.4f} ms  {src}", flush=True)
  return {"what": "tools/bench/train_op_profile.py", "args": {k: v for k, v in vars(args).items() if k != "json"},
          "jax": jax.__version__, "device": jax.devices()[0].device_kind, "compile_s": round(compile_s, 2),
          "call_ms": round(call_ms, 4), "runs_ms": [round(r, 4) for r in runs], "plane": plane,
          **({} if times else {"trace_planes": lines_seen}),
          "sum_ms": summary["sum_ms_per_step"], "in_order_ms": summary["in_order_ms_per_step"],
          "async_span_ms": summary["async_span_ms_per_step"], "by_source_ms": sources,
          "by_opcode_ms": summary["by_opcode_ms_per_step"], "top": [per_call(row) for row in summary["top"]],
          "top_async": [per_call(row) for row in summary["top_async"]],
          "instructions_seen": summary["instructions_seen"]}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m tools.bench.train_op_profile", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog=__doc__.split("\n\n", 1)[1])
  p.add_argument("--json", required=True, help="where the profile's figures are written")
  p.add_argument("--smoke", action="store_true", help="tiny shapes, the XLA implementation (the CPU test)")
  p.add_argument("--implementation", choices=("pallas_tpu", "xla"), default=None,
                 help="kda_chunked's implementation (default pallas_tpu; --smoke: xla)")
  p.add_argument("--gate", choices=OP_GATES, default="model_init",
                 help="how the gate's inputs are drawn (default: %(default)s; see the description)")
  p.add_argument("--batch", type=int, default=0, help="rows (0 or absent: 8; --smoke: 1)")
  p.add_argument("--seq-len", type=int, default=0, help="tokens a row (0 or absent: 2048; --smoke: 128)")
  p.add_argument("--heads", type=int, default=0, help="KDA heads (0 or absent: 8; --smoke: 2)")
  p.add_argument("--key-dim", type=int, default=0, help="K = V (0 or absent: 128; --smoke: 16)")
  p.add_argument("--docs", type=int, default=4,
                 help="documents a row, of equal length to a token (default: %(default)s)")
  p.add_argument("--repeats", type=int, default=5, help="timed runs (default: %(default)s)")
  p.add_argument("--calls", type=int, default=3, help="calls a timed run (default: %(default)s)")
  p.add_argument("--top", type=int, default=60, help="instructions and source lines listed (default: %(default)s)")
  p.add_argument("--compilation-cache-dir", default="", help="jax's persistent cache ('' = the default; none = off)")
  args = p.parse_args(argv)
  dp.check_counts(p, args, {"batch": (1, 8), "seq_len": (128, 2048), "heads": (2, 8), "key_dim": (16, 128)},
                  ("docs", "repeats", "calls", "top"),
                  {"repeats": 1000, "calls": 1000, "top": 100_000, "key_dim": 256})   # K, V <= 256: the kernels
  if args.docs > args.seq_len:
    p.error(f"--docs must be at most --seq-len ({args.seq_len}), got {args.docs}")
  elements = args.batch * args.seq_len * args.heads * args.key_dim
  # q, k, v, g and the cotangent in bf16, and their gradients; the float32 state entering every 64-row
  # chunk (the training op's residual)
  states = -(-args.seq_len // 64) * args.batch * args.heads * args.key_dim ** 2 * 4
  need = 5 * elements * 2 + 5 * elements * 2 + states
  limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit") or \
      os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
  if need > limit:
    p.error(f"--batch {args.batch} x --seq-len {args.seq_len} x --heads {args.heads} x --key-dim {args.key_dim}: "
            f"the op's inputs, gradients and chunk states alone need {need / 2**30:.1f} GiB, more than the "
            f"{limit / 2**30:.1f} GiB this device can hold; lower them")
  args.implementation = args.implementation or ("xla" if args.smoke else "pallas_tpu")
  if args.implementation == "pallas_tpu" and jax.default_backend() != "tpu":
    p.error(f"--implementation pallas_tpu needs a TPU (this backend: {jax.default_backend()}); "
            "use --implementation xla or --smoke here")
  out = dp.json_output_path(p, args.json)
  try:
    print(compilation_cache.enable(args.compilation_cache_dir), flush=True)
  except UsageError as e:
    p.error(f"--compilation-cache-dir: {e}")
  result = run(args)
  if not dp.write_json(out, result, args.json):
    return 1
  if result["plane"] is None:
    print("error: the trace has no event named like an instruction of the compiled program: no per-instruction "
          "figures", file=sys.stderr, flush=True)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
