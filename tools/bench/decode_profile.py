r"""Where a decode step's device time goes: one loop of decode steps traced with jax's profiler, the
compiled program's own instructions summed by name, by model part and by opcode, largest first.

    python -m tools.bench.decode_profile --json FILE [--batch 64] [--context 1024] [--steps 32]
        [--config kimi_linear_48b_a3b] [--set key=value ...] [--top 40] [--smoke]

What it does, in order:
  1. builds the model (random weights, bf16) and a decode cache for `--batch` sequences that hold
     `--context` tokens, and jits `--steps` greedy decode steps in one `lax.fori_loop` (the cache
     donated, as tools/bench/e2e_device.py's decode figures and the serving engine run it). Without
     --config that is the real-width shard (kimi_linear_48b_a3b num_experts=16: about 9.9 GB of bf16
     weights): a tool for the chip; on a CPU use --smoke;
  2. times the loop (median of `--repeats`, wall clock around a blocked call: device time, one
     dispatch a loop) and prints the step time beside the HBM floor at v5e's 819 GB/s (weights, KDA
     states and the MLA rows in use read once; meaningful on a v5e only);
  3. traces one more loop with `jax.profiler.trace` and reads the trace back (`jax.profiler.ProfileData`):
     every event on the device's plane ("/device:TPU:0", else the host's, where XLA:CPU runs) whose
     name is an instruction of the compiled program is that instruction's execution (control flow
     such as the loop itself is left out: its time is its body's);
  4. writes JSON (whole, or nothing): `step_ms`, `loop_runs_ms`, `hbm_floor_ms`, `x_floor`,
     `floor_bytes`; `by_part_ms_per_step` (the model part each instruction comes from, by the stack
     XLA records for it: kda, mla, moe, ffn (a dense or shared-expert SwiGLU outside them), norm,
     embed, model (the rest of the decoder layer and the LM head), other); `by_opcode_ms_per_step`
     (custom-calls by target and kernel name); `top`: the `--top` largest instructions that run in
     the program's order, each with its time and count a step, opcode, fusion kind or kernel, output
     shape, jax's op_name, source line, caller and part; `in_order_ms_per_step`: the time of every
     instruction that runs in order, listed or not (near the step: what to cut); `top_async` and
     `async_span_ms_per_step`: the asynchronous starts (`copy-start`, `slice-start`: their events
     span a transfer while the others run, so they overlap the step; the exposed wait is the
     `-done`'s); `sum_ms_per_step`: every event, both kinds (XLA:CPU's threads overlap too);
     `compile_s`, `plane` (the trace's device plane), `instructions_seen`, `device`, `jax`, `config`
     and `args` say how it ran.
A trace in which no event is named like an instruction of the program still writes the step time
(and the trace's planes and lines, `trace_planes`) and exits 1.

Run it on the chip beside the e2e check's real phase (same model, same loop) to see what the step split
leaves out (docs/performance.md). `--smoke`: the tiny config, batch 2, context 16, 2 steps, on any
backend (the CPU test).
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import os
import pathlib
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.profiler import ProfileData

from model.engine import compilation_cache
from model.errors import ConfigError, UsageError
from tools.bench import e2e_device

REAL_CONFIG = ["kimi_linear_48b_a3b", "num_experts=16"]

# `%name = shape opcode(` in XLA's HLO text; the shape is an array `f32[64,32]{...}` or a tuple `(...)`
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (\(.*?\)|[\w]+\[[\d,]*\][^ ]*) ([\w\-]+)\(")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_KERNEL = re.compile(r'"kernel_name":\s*"([^"]+)"|kernel_name=([\w.\-]+)')
_KIND = re.compile(r"kind=(k\w+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
# The model part an instruction belongs to, by its stack (innermost frame first): the first frame in
# a layer-level part (a mixer or the MoE block: a projection called by the KDA mixer is the KDA
# mixer's), else the first frame in a smaller part, else "other". A mark is a function name prefix
# or a piece of the file's path.
LAYER_PARTS = (("kda", ("KimiDeltaAttention.", "KDABackend.", "kda_plugin/", "model/nn/kda.py")),
               ("mla", ("MultiHeadLatentAttention.", "model/nn/mla.py")),
               ("moe", ("SparseMoeBlock.", "Experts.", "TopKRouter.", "megablox/", "model/nn/moe.py")))
SMALL_PARTS = (("ffn", ("SwiGLU.",)),
               ("norm", ("RMSNorm.",)),
               ("embed", ("Embed.",)),
               # the LM head (and, in a train step, the loss around it)
               ("head", ("KimiLinearForCausalLM.head", "KimiLinearForCausalLM.last_logits", "blocked_nll",
                         "masked_nll")),
               ("model", ("KimiLinearForCausalLM.", "DecoderLayer.")),
               # the rest of a train step (tools/bench/train_device.py step profile)
               ("optimizer", ("optax/",)),
               ("train_step", ("model/training/",)))


def stack_frames(hlo_text: str) -> dict[int, list[tuple[str, str, int]]]:
  """`{stack_frame_id: [(file, function, line), ...]}`, innermost frame first (callers after), from the FileNames /
  FunctionNames / FileLocations / StackFrames tables that XLA prints at the top of a module's text
  (absent in older XLA: then `{}`)."""
  sections: dict[str, list[str]] = {}
  current = None
  for line in hlo_text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      current = sections.setdefault(line, [])
    elif current is not None and re.match(r"^\d+ ", line):
      current.append(line)
    elif current is not None:
      current = None
  named = lambda key: {int(l.split(None, 1)[0]): l.split(None, 1)[1].strip('"') for l in sections.get(key, [])}
  files, functions = named("FileNames"), named("FunctionNames")
  locations, frames = {}, {}
  for l in sections.get("FileLocations", []):
    d = dict(re.findall(r"(\w+)=(\d+)", l))
    locations[int(l.split()[0])] = (files.get(int(d.get("file_name_id", 0)), "?"),
                                    functions.get(int(d.get("function_name_id", 0)), "?"), int(d.get("line", 0)))
  for l in sections.get("StackFrames", []):
    d = dict(re.findall(r"(\w+)=(\d+)", l))
    frames[int(l.split()[0])] = (int(d.get("file_location_id", 0)), int(d.get("parent_frame_id", 0)))
  out = {}
  for fid in frames:
    chain, seen, f = [], set(), fid
    while f in frames and f not in seen:
      seen.add(f)
      loc, parent = frames[f]
      if loc in locations:
        chain.append(locations[loc])
      # As XLA prints the table (jax 0.10.2 and 0.12 alike), a frame's caller is the frame numbered
      # parent_frame_id - 1; 1 (frame 0) means none. Read so, a projection's chain goes
      # Linear.__call__ -> KimiDeltaAttention._output -> KimiDeltaAttention.decode -> DecoderLayer...
      f = parent - 1
    out[fid] = chain
  return out


def part_of(chain: list[tuple[str, str, int]]) -> str:
  """The model part of a stack, innermost frame first (LAYER_PARTS before SMALL_PARTS); "other"
  when no frame matches."""
  for parts in (LAYER_PARTS, SMALL_PARTS):
    for file, function, _ in chain:
      for part, marks in parts:
        if any(function.startswith(m) or m in file for m in marks):
          return part
  return "other"


def hlo_instructions(hlo_text: str) -> dict[str, dict]:
  """Every instruction of an HLO module's text by name: opcode, output shape (layout dropped), the
  custom-call target (a Mosaic kernel's name where the backend config gives it), the fusion kind and
  jax's op_name, and where its stack says it comes from: the innermost frame ("source"), the frame
  that called it ("caller", where there is one) and the model part (`part_of`)."""
  frames = stack_frames(hlo_text)
  out = {}
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    name, shape, opcode = m.groups()
    info = {"opcode": opcode, "shape": re.sub(r"\{[^{}]*\}", "", shape)}
    if opcode == "custom-call":
      t = _TARGET.search(line)
      k = _KERNEL.search(line)
      target = t.group(1) if t else "?"
      if k:
        target += f":{k.group(1) or k.group(2)}"
      elif target == "tpu_custom_call":   # XLA:TPU names a Pallas call's instruction after its kernel
        target += ":" + re.sub(r"\.\d+$", "", name)
      info["target"] = target
    kind = _KIND.search(line)
    if kind:
      info["kind"] = kind.group(1)
    op = _OP_NAME.search(line)
    if op:
      info["op_name"] = op.group(1)
    frame = _FRAME_ID.search(line)
    chain = frames.get(int(frame.group(1)), []) if frame else []
    info["part"] = part_of(chain)
    if chain:
      file, function, lineno = chain[0]
      info["source"] = f"{'/'.join(file.split('/')[-2:])}:{lineno} {function}"
      if len(chain) > 1:   # the line that called it (a helper such as a matmul wrapper says little alone)
        file, function, lineno = chain[1]
        info["caller"] = f"{'/'.join(file.split('/')[-2:])}:{lineno} {function}"
    out[name] = info
  return out


# Instructions whose time is their body's (counted there): left out of every sum.
CONTAINERS = ("while", "conditional", "call", "async-start", "async-done")


def event_instruction(event_name: str) -> str:
  """The instruction an event of the trace is named after. XLA:CPU names an event by the instruction
  ("fusion.3"); XLA:TPU (libtpu 0.0.42, jax 0.10.2) by its whole text ("%fusion.3 = f32[8]{0} fusion(...),
  kind=kLoop, ..."), whose name is the part before " = "."""
  if event_name.startswith("%"):
    return event_name[1:].split(" = ", 1)[0]
  return event_name


def instruction_times(profile, instructions: dict) -> tuple[str | None, dict[str, list[int]]]:
  """`(plane name, {instruction: [total ns, count]})`: the events of the device plane (the first
  "/device:" plane with any event named like an instruction, else "/host:CPU") whose names are
  instructions of the program, control flow (CONTAINERS) left out. A profile with neither gives `(None, {})`."""
  planes = list(profile.planes)
  ordered = ([p for p in planes if p.name.startswith("/device:")]
             + [p for p in planes if p.name == "/host:CPU"])
  for plane in ordered:
    times: dict[str, list[int]] = {}
    for line in plane.lines:
      for ev in line.events:
        name = event_instruction(ev.name)
        if name in instructions and instructions[name]["opcode"] not in CONTAINERS:
          slot = times.setdefault(name, [0, 0])
          slot[0] += int(ev.duration_ns)
          slot[1] += 1
    if times:
      return plane.name, times
  return None, {}


def traced_instruction_times(fn, compiled):
  """Runs `fn()` (a call of `compiled`) once under `jax.profiler.trace` and reads the trace back:
  `(instructions, plane, times, lines_seen)` (`hlo_instructions` of the compiled program,
  `instruction_times`' plane and times, and the trace's planes and lines with, when no event matched,
  samples of the device's event names, so that a mismatch can be read from the JSON)."""
  instructions = hlo_instructions(compiled.as_text())
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      jax.block_until_ready(fn())
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
      raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {trace_dir}")
    profile = ProfileData.from_file(files[0])
    plane, times = instruction_times(profile, instructions)
    lines_seen = {p.name: sorted({line.name for line in p.lines}) for p in profile.planes}
    if not times:
      lines_seen["event_samples"] = {
          f"{p.name}|{line.name}": sorted({ev.name for _, ev in zip(range(400), line.events)})[:25]
          for p in profile.planes if p.name.startswith("/device:") for line in p.lines}
  return instructions, plane, times, lines_seen


def is_async_start(info: dict) -> bool:
  """An asynchronous operation's start (`copy-start`, `slice-start`, ...): its event spans the transfer
  while other instructions run beside it, so its time overlaps theirs; the wait is its `-done`."""
  return info["opcode"].endswith("-start")


def summarize(times: dict[str, list[int]], instructions: dict, steps: int, top: int) -> dict:
  """Per-step times: the `top` largest instructions that run in the program's order (`top`; the
  asynchronous starts, whose spans overlap them, apart in `top_async`), and sums by model part and by
  opcode (custom-call by target). `in_order_ms_per_step` sums the former: near the step time when the
  trace holds the whole step."""
  per_step = lambda ns: round(ns / steps / 1e6, 5)   # milliseconds a step
  rows = sorted(times.items(), key=lambda kv: -kv[1][0])
  by_kind: dict[str, int] = collections.Counter()
  by_part: dict[str, int] = collections.Counter()
  for name, (ns, _) in rows:
    info = instructions[name]
    by_part[info["part"]] += ns
    by_kind[info.get("target", info["opcode"]) if info["opcode"] == "custom-call" else info["opcode"]] += ns
  row = lambda name, ns, n: {"name": name, "ms_per_step": per_step(ns), "count_per_step": round(n / steps, 3),
                             **instructions[name]}
  in_order = [(name, t) for name, t in rows if not is_async_start(instructions[name])]
  spans = [(name, t) for name, t in rows if is_async_start(instructions[name])]
  return {
      "sum_ms_per_step": per_step(sum(ns for ns, _ in times.values())),
      "in_order_ms_per_step": per_step(sum(ns for _, (ns, _) in in_order)),
      "async_span_ms_per_step": per_step(sum(ns for _, (ns, _) in spans)),
      "by_part_ms_per_step": {k: per_step(v) for k, v in sorted(by_part.items(), key=lambda kv: -kv[1])},
      "by_opcode_ms_per_step": {k: per_step(v) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
      "top": [row(name, ns, n) for name, (ns, n) in in_order[:top]],
      "top_async": [row(name, ns, n) for name, (ns, n) in spans[:max(1, top // 4)]],
      "instructions_seen": len(times),
  }


def run(args) -> dict:
  ns = argparse.Namespace(config=args.config, set=args.set)
  cfg = e2e_device.build_config(ns, "bfloat16")
  model = e2e_device.build_model(cfg)
  graphdef, treedef, leaves = e2e_device.split(model)
  model_of = lambda lv: nnx.merge(graphdef, jax.tree.unflatten(treedef, lv))
  b, context, steps = args.batch, args.context, args.steps

  def decode_loop(lv, tok, cache):   # as tools/bench/e2e_device.py's decode figures run it
    m = model_of(lv)

    def body(_, carry):
      tok, cache = carry
      logits, cache = m.decode(tok, cache)
      return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    tok, out = jax.lax.fori_loop(0, steps, body, (tok, cache))
    return tok, type(out)(out.layers, cache.lengths)

  @functools.partial(jax.jit, static_argnums=0)
  def decode_cache(batch):
    cache = model.init_cache(batch, 1, context + steps + 1)
    return type(cache)(cache.layers, jnp.full((batch,), context, jnp.int32))

  tok = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (b,)), jnp.int32)
  t = time.perf_counter()
  compiled = jax.jit(decode_loop, donate_argnums=2).lower(leaves, tok, jax.eval_shape(decode_cache, b)).compile()
  compile_s = time.perf_counter() - t
  live = {"cache": decode_cache(b)}
  floor = e2e_device.decode_floor_bytes(e2e_device.tree_bytes(leaves), live["cache"], context)

  def loop():
    out, live["cache"] = compiled(leaves, tok, live["cache"])
    return out

  jax.block_until_ready(loop())
  med, runs = e2e_device.timed(loop, args.repeats)
  step_ms = med / steps * 1e3
  floor_ms = floor["total"] / e2e_device.HBM_BYTES_PER_S * 1e3
  print(f"decode B={b}: {step_ms:.3f} ms/step (v5e HBM floor {floor_ms:.2f} ms, {step_ms / floor_ms:.2f}x); "
        f"compiled in {compile_s:.1f} s", flush=True)
  instructions, plane, times, lines_seen = traced_instruction_times(loop, compiled)
  summary = summarize(times, instructions, steps, args.top)
  print(f"profile ({plane}): {summary['instructions_seen']} instructions, "
        f"{summary['in_order_ms_per_step']:.3f} ms a step in order (asynchronous spans beside them: "
        f"{summary['async_span_ms_per_step']:.3f} ms)", flush=True)
  for part, ms in summary["by_part_ms_per_step"].items():
    print(f"  part {part:43s} {ms:9.4f} ms/step", flush=True)
  for kind, ms in list(summary["by_opcode_ms_per_step"].items())[:12]:
    print(f"  {kind:48s} {ms:9.4f} ms/step", flush=True)
  for row in summary["top"][:args.top]:
    print(f"  {row['ms_per_step']:9.4f} ms x{row['count_per_step']:<6g} {row['name']:32s} "
          f"{row['part']:6s} {row.get('target', row.get('kind', row['opcode']))} {row['shape'][:60]}  "
          f"{row.get('source', '')}", flush=True)
  return {"what": "tools/bench/decode_profile.py", "config": [args.config, *args.set],
          "args": {k: v for k, v in vars(args).items() if k != "json"}, "jax": jax.__version__,
          "device": jax.devices()[0].device_kind, "compile_s": round(compile_s, 2),
          "step_ms": round(step_ms, 4), "loop_runs_ms": [round(r * 1e3, 3) for r in runs],
          "hbm_bytes_per_s": e2e_device.HBM_BYTES_PER_S, "hbm_floor_ms": round(floor_ms, 4), "x_floor": round(step_ms / floor_ms, 3), "floor_bytes": floor,
          "plane": plane, **({} if times else {"trace_planes": lines_seen}), **summary}


# The most each whole-number flag takes: 512 sequences already hold ~21 GB of KDA states at real width
# (more than a v5e's HBM); a 256k-token context, 4096 steps a loop and 1000 timed loops are far past any
# profile's need.
LIMITS = {"batch": 512, "context": 262_144, "steps": 4096, "repeats": 1000}


def check_counts(p: argparse.ArgumentParser, args, sizes: dict[str, tuple[int, int]], counts=(),
                 limits: dict[str, int] | None = None) -> None:
  """Fills and checks the command's whole-number arguments in place: each of `sizes` (`name: (smoke
  default, default)`) may be 0 or absent for its default (`--smoke`'s when args.smoke) and is >= 1
  after; each of `counts` must be >= 1; each of `limits` (`name: most`) at most that (a value past it
  would run for hours or ask more memory than a host has, before any error of its own). A bad one is
  a usage error naming the flag (`p.error`, exit 2)."""
  flag = lambda name: f"--{name.replace('_', '-')}"
  for name, (smoke, full) in sizes.items():
    value = getattr(args, name)
    if value < 0:
      p.error(f"{flag(name)} must be >= 1 (0 = the default), got {value}")
    setattr(args, name, value or (smoke if args.smoke else full))
  for name in counts:
    if getattr(args, name) < 1:
      p.error(f"{flag(name)} must be >= 1, got {getattr(args, name)}")
  for name, most in (limits or {}).items():
    if getattr(args, name) > most:
      p.error(f"{flag(name)} must be at most {most}, got {getattr(args, name)}")


def json_output_path(p: argparse.ArgumentParser, given: str) -> pathlib.Path:
  """`--json`'s path, checked before minutes of building and compiling: a directory or a path that
  cannot be written is a usage error now (`p.error`, exit 2), and nothing is created until
  `write_json`."""
  if not given.strip():
    p.error("--json: expected a file path, got an empty value")
  out = pathlib.Path(given)
  if out.is_dir():
    p.error(f"--json {given!r} is a directory; expected a file path")
  ancestor = out.parent
  while not ancestor.exists() and ancestor != ancestor.parent:
    ancestor = ancestor.parent
  writable = ancestor.is_dir() and not (out.exists() and not os.access(out, os.W_OK))
  if writable:   # a trial file, removed at once: permission bits do not stop root, a read-only mount does
    try:
      with tempfile.NamedTemporaryFile(dir=ancestor, prefix=".write-check-"):
        pass
    except OSError:
      writable = False
  if not writable:
    p.error(f"--json {given!r} cannot be written ({ancestor} is not a writable directory)")
  return out


def write_json(out: pathlib.Path, result: dict, given: str) -> bool:
  """Writes `result` to `out` whole or not at all (a temporary file renamed); False, with the reason
  on stderr, when it cannot."""
  try:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    os.replace(tmp, out)
  except OSError as e:
    print(f"error: --json {given!r}: cannot write the figures: {e.strerror or e}", file=sys.stderr, flush=True)
    return False
  print(f"wrote {out}", flush=True)
  return True


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m tools.bench.decode_profile", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog=__doc__.split("\n\n", 1)[1])
  p.add_argument("--json", required=True, help="where the profile's figures are written")
  p.add_argument("--smoke", action="store_true", help="the tiny config at tiny shapes (the CPU test)")
  p.add_argument("--config", default=None, help="model config (default: the real-width shard, kimi_linear_48b_a3b "
                                              "with num_experts=16, ~9.9 GB of weights: for the chip, refused on another backend; --smoke: tiny)")
  p.add_argument("--set", action="append", default=[], help="key=value config override (repeatable)")
  p.add_argument("--batch", type=int, default=0, help="sequences decoded together (0 or absent: 64; --smoke: 2)")
  p.add_argument("--context", type=int, default=0, help="tokens each sequence holds (0 or absent: 1024; --smoke: 16)")
  p.add_argument("--steps", type=int, default=0, help="decode steps in the loop (0 or absent: 32; --smoke: 2)")
  p.add_argument("--repeats", type=int, default=3, help="timed loops before the traced one (default: %(default)s)")
  p.add_argument("--top", type=int, default=40, help="instructions listed, largest first (default: %(default)s)")
  p.add_argument("--compilation-cache-dir", default="", help="jax's persistent cache ('' = the default; none = off)")
  args = p.parse_args(argv)
  check_counts(p, args, {"batch": (2, 64), "context": (16, 1024), "steps": (2, 32)}, ("repeats", "top"), LIMITS)
  if args.config is not None and not args.config.strip():
    p.error("--config: expected a model config name or file, got an empty value")
  if args.config is None and not args.smoke and jax.default_backend() != "tpu":
    p.error(f"without --config the model is the real-width shard ({' '.join(REAL_CONFIG)}: ~9.9 GB of bf16 "
            f"weights), a model for the chip; this backend is {jax.default_backend()}: use --smoke or --config")
  if not args.config:
    if args.smoke:
      args.config = e2e_device.SMOKE_CONFIG
    else:
      args.config, args.set = REAL_CONFIG[0], [*REAL_CONFIG[1:], *args.set]
  out = json_output_path(p, args.json)
  try:   # an unknown --config or a bad --set names itself before anything is built
    e2e_device.build_config(argparse.Namespace(config=args.config, set=args.set), "bfloat16")
  except ConfigError as e:
    p.error(f"--config {args.config!r} / --set: {e}")
  try:
    print(compilation_cache.enable(args.compilation_cache_dir), flush=True)
  except UsageError as e:
    p.error(f"--compilation-cache-dir: {e}")
  result = run(args)
  if not write_json(out, result, args.json):
    return 1
  if result["plane"] is None:   # the step time stands; the breakdown is missing, and the JSON lists what the trace had
    print("error: the trace has no event named like an instruction of the compiled loop (its planes and lines "
          f"are in {out} under trace_planes): no per-instruction figures", file=sys.stderr, flush=True)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
