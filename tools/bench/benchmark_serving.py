r"""Serving throughput: offline, our engine against transformers' own Kimi-Linear (same weights); --online,
the HTTP server (tools/serve.py) under concurrent clients, engine against engine.

Online (`--online`; everything after it is the online mode's flags, see `--online --help`):

    .venv/bin/python tools/bench/benchmark_serving.py --online [--engines continuous,static] \
        [--workloads mixed,shared_prefix] [--num-requests 64] [--concurrency 32] [--json FILE]
        [--url http://HOST:PORT  (an already running server: measures that one only)]

For each configuration it starts `python -m tools.serve` on the demo checkpoint (port=0; the server
compiles every shape bucket before it listens), waits for /health, sends `--warmup` requests (not
measured; drawn with another seed, so the measured prompts never meet themselves in the prefix
cache; in shared_prefix they share the measured 512-token prefix, as a system prompt the server has
already seen, each with its own suffix), then the workload from
`--concurrency` concurrent clients, streaming with `ignore_eos` (every request produces exactly its
output length). The clients (`--client`) are plain aiohttp streams whose SSE lines are parsed as JSON
by default, as vLLM's benchmark_serving does: the client shares the host's cores with the server,
and the official `openai` client (`--client openai`) spends about a third of a core on its
per-chunk models at 32 streams, which the server's figures would then pay for. Workloads: "mixed" (prompt lengths
uniform in 16-1024, outputs uniform in 16-256 tokens) for every engine; "shared_prefix" (one
512-token prefix + a different 16-128-token suffix, outputs as mixed) on engine=continuous with
the prefix cache on and off. Figures: output tokens/s = generated tokens / workload wall time;
TTFT (request sent -> first token received) and TPOT ((last - first token time) / (tokens - 1))
p50 / p99 over the requests. `--rounds N` measures every configuration N times in interleaved
rounds (each in a fresh server, so no round finds another's prompts cached) and reports each figure's
median over the rounds, and for shared_prefix the TTFT p50 ratio of the medians with each round's own
ratio: the cores are shared, and a single run can be slowed by other jobs. Prints a markdown table
and writes --json.

With `--url` the one server given is measured (no server is started): its /metrics are scraped after the
warm-up and after the workload, and the JSON's `server_metrics` are the differences (this run's
generated, prompt and cached prompt tokens, compilations; other clients' tokens count too). Such a
server keeps its prefix cache between runs: run again with the same `--seed` and the measured prompts
are cached already, so TTFT is measured warm; a note says so when the server's prefix cache holds
anything before the run (restart the server, or change `--seed`, for a cold measurement). The JSON's
`args` holds the settings that apply to the mode run, as numbers and lists; a figure with no value (e.g. the
TTFT p50 of long suffixes when no request drew one) is null in the JSON and "-" in the table.

Every flag is checked before anything starts (one `error:` line naming the flag, exit status 2): counts
>= 1, each min <= its max, `--seed` in [0, 2**32), the workloads and engines named, the sizes and
`--serve-arg` keys `tools.serve` would refuse, a `--json` that can be written, an `--url` that answers,
and with `--url` no flag that only configures the servers this tool would start (`--engines`, the
sizes, `--serve-arg`, `--start-timeout`, `--rounds`); a failure while running (a server that does not
start, a refused request such as a 503 when the server's queue is full) is one `error:` line with
status 1. With servers this tool starts (or `--in-process`) the JSON is rewritten after each
configuration, `"partial": true` until the last, so it keeps what was measured before a failure or an
outer time limit; with `--url` it is written at the end only, and a failure writes nothing.

Start-up is recorded: each server's `startup` (seconds to listen, the compile seconds and how many
executables were compiled or loaded from jax's persistent compilation cache, from the server's log),
each `--in-process` engine's `compile` report and `warmup_s` (engine=static compiles there, at its first
group). `--compilation-cache-dir DIR|none` sets the cache of the engines or servers started (default
`~/.cache/kda_plugin/jax`; docs/serving.md, "Start-up compilation").

`--online --in-process` replays the same configurations, warm-ups and workloads on the engine in this
process (no server, no HTTP, no client library; `--concurrency` closed-loop clients, times taken at
the engine step that emitted each token): what the engine alone gives, to tell its cost from the
HTTP path's and the clients', which share the same cores in the online mode.

Offline (default):

    .venv/bin/python tools/bench/benchmark_serving.py [--hf-dir runs/reference/demo_hf] \
        [--checkpoint runs/serving/demo_ckpt] [--attention kda_native] [--prefill-tokens 512] \
        [--decode-tokens 64] [--runs 7] [--rounds 2] [--json runs/serving/benchmark_serving.json]

The demo-sized model (6 layers, width 256, KDA at 1, 2, 4, 5 and MLA at 3, 6, MoE with 8 experts top-2
plus a shared expert, vocab 4096) is built and saved by transformers
(`tools/bench/reference/bench_transformers.py --save-dir`, run under .venv-ref when `--hf-dir` is missing)
and converted with `tools.convert_checkpoint` (when `--checkpoint` is missing). Then, for `--rounds`
rounds, back to back on the same cores:

- theirs: `.venv-ref/bin/python tools/bench/reference/bench_transformers.py --model-dir HF` (torch, 2
  threads): prefill of the prompt (batch 1, last-token logits), then greedy decode steps through
  its cache.
- ours: `model.engine.generator.Generator` on the converted checkpoint: the packed prefill (batch 1, the
  first token sampled on device) and `--decode-tokens` jitted decode steps (one token each, fed
  back through the KDA state, conv windows and MLA latent cache), compiled and warmed up first.

Figures are tokens/s from the median (and the best) of `--runs` timed runs; prefill tokens/s =
prompt tokens / prefill seconds, decode tokens/s = decode steps / decode-loop seconds. The machine
is shared: the load average is recorded with every round, and the best-run figures are the least
inflated by other processes. Writes everything to `--json`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
REF_PY = REPO / ".venv-ref" / "bin" / "python"
REF_SCRIPT = REPO / "tools" / "bench" / "reference" / "bench_transformers.py"


def _run_reference(args, extra: list[str], json_path: pathlib.Path) -> dict:
  if not REF_PY.exists():
    sys.exit(f"error: {REF_PY} is missing: create the reference venv (tests/fixtures/README.md)")
  cmd = [str(REF_PY), str(REF_SCRIPT), "--json", str(json_path), "--prefill-tokens", str(args.prefill_tokens),
         "--decode-tokens", str(args.decode_tokens), "--runs", str(args.runs), "--threads", str(args.threads)] + extra
  print("$ " + " ".join(cmd), flush=True)
  subprocess.run(cmd, check=True, cwd=REPO)
  return json.loads(json_path.read_text())


def ensure_checkpoint(args) -> pathlib.Path:
  """Builds the HF demo model (transformers) and converts it, when missing."""
  if not (args.hf_dir / "config.json").exists():
    _run_reference(args, ["--save-dir", str(args.hf_dir), "--runs", "1"], args.json.with_suffix(".build.json"))
  ckpt = args.checkpoint.resolve()
  if not (ckpt / "config.json").exists():
    from tools import convert_checkpoint as cc  # only when the checkpoint is missing (jax start-up cost)
    cc.convert([f"hf_model_path={args.hf_dir}", f"output_path={ckpt}"])
  return ckpt


def measure_ours(args, ckpt: pathlib.Path) -> dict:
  """Prefill and decode figures of model.engine.generator on the converted checkpoint."""
  # Here, not at the top: jax starts in this process only when ours is first measured, so --help and
  # the transformers child (each round runs it first) do not share the machine with its runtime.
  from model.engine.generator import Generator, round_up
  from model.loading import load_model

  length = round_up(args.prefill_tokens + args.decode_tokens + 1, 64)
  model, cfg = load_model(ckpt, [f"attention={args.attention}", f"max_cache_length={length}"])
  gen = Generator(model, max_length=length, eos_id=None, batch_size=1)
  prompt = np.random.default_rng(args.seed).integers(3, int(cfg.vocab_size), args.prefill_tokens)
  new = args.decode_tokens + 1          # the first token comes from the prefill
  _, t = gen.generate([prompt], new)    # compiles (AOT) and warms up; not timed
  compile_s = t.compile_s
  prefill, decode = [], []
  for _ in range(args.runs):
    _, t = gen.generate([prompt], new)
    assert t.decode_steps == args.decode_tokens
    prefill.append(t.prefill_s)
    decode.append(t.decode_s)
  return {"engine": f"model.engine.generator.Generator, attention={args.attention}, float32, jax CPU",
          "compile_and_warmup_s": compile_s,
          "prefill": {"batch": 1, "tokens": args.prefill_tokens, "runs_s": prefill,
                      "median_s": statistics.median(prefill),
                      "tokens_per_s": args.prefill_tokens / statistics.median(prefill),
                      "tokens_per_s_best": args.prefill_tokens / min(prefill)},
          "decode": {"batch": 1, "context_tokens": args.prefill_tokens, "new_tokens": args.decode_tokens,
                     "runs_s": decode, "median_s": statistics.median(decode),
                     "tokens_per_s": args.decode_tokens / statistics.median(decode),
                     "tokens_per_s_best": args.decode_tokens / min(decode),
                     "ms_per_token": 1e3 * statistics.median(decode) / args.decode_tokens}}


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  if "--online" in argv:
    from tools.bench import serving_load  # the online client: only this mode needs openai and asyncio
    argv.remove("--online")
    return serving_load.main(argv)
  from tools.bench.serving_load import SEED_LIMIT, OneLineErrorParser, check_json_writable  # no jax, no openai
  p = OneLineErrorParser(prog="benchmark_serving.py", description=__doc__.split("\n\n")[0],
                         formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
  p.add_argument("--hf-dir", type=pathlib.Path, default=REPO / "runs/reference/demo_hf")
  p.add_argument("--checkpoint", type=pathlib.Path, default=REPO / "runs/serving/demo_ckpt")
  p.add_argument("--attention", default="kda_native")
  p.add_argument("--prefill-tokens", type=int, default=512)
  p.add_argument("--decode-tokens", type=int, default=64)
  p.add_argument("--runs", type=int, default=7)
  p.add_argument("--rounds", type=int, default=2, help="theirs-then-ours rounds, back to back")
  p.add_argument("--threads", type=int, default=2, help="torch threads of the transformers side")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--skip-reference", action="store_true", help="measure ours only")
  p.add_argument("--json", type=pathlib.Path, default=REPO / "runs/serving/benchmark_serving.json")
  args = p.parse_args(argv)
  for flag, value in (("--prefill-tokens", args.prefill_tokens), ("--decode-tokens", args.decode_tokens),
                      ("--runs", args.runs), ("--rounds", args.rounds), ("--threads", args.threads)):
    if value < 1:
      p.error(f"{flag} must be an integer >= 1, got {value}")
  if not 0 <= args.seed < SEED_LIMIT:
    p.error(f"--seed must be an integer in [0, 2**32), got {args.seed}")
  if args.json.is_dir():
    p.error(f"--json {str(args.json)!r} is a directory; expected a file path")
  check_json_writable(p, args.json)   # creates its directory, as the run would
  ckpt = ensure_checkpoint(args)
  rounds = []
  for r in range(args.rounds):
    row = {"round": r, "started": time.strftime("%H:%M:%S")}
    if not args.skip_reference:
      row["transformers"] = _run_reference(args, ["--model-dir", str(args.hf_dir)], args.json.with_suffix(f".ref{r}.json"))
    row["load_between"] = os.getloadavg()
    row["ours"] = measure_ours(args, ckpt)
    row["load_after"] = os.getloadavg()
    rounds.append(row)
    o = row["ours"]
    print(f"[round {r}] ours: prefill {o['prefill']['tokens_per_s']:.0f} tokens/s (best {o['prefill']['tokens_per_s_best']:.0f}), "
          f"decode {o['decode']['tokens_per_s']:.1f} tokens/s (best {o['decode']['tokens_per_s_best']:.1f}); "
          f"load {row['load_after'][0]:.1f}", flush=True)
    if "transformers" in row:
      t = row["transformers"]
      print(f"[round {r}] transformers: prefill {t['prefill']['tokens_per_s']:.0f} tokens/s "
            f"(best {t['prefill'].get('tokens_per_s_best', float('nan')):.0f}), decode {t['decode']['tokens_per_s']:.1f} "
            f"tokens/s (best {t['decode'].get('tokens_per_s_best', float('nan')):.1f})", flush=True)
      for what in ("prefill", "decode"):
        med = o[what]["tokens_per_s"] / t[what]["tokens_per_s"]
        best = o[what]["tokens_per_s_best"] / t[what].get("tokens_per_s_best", t[what]["tokens_per_s"])
        row[f"{what}_speedup_median"], row[f"{what}_speedup_best"] = med, best
        print(f"[round {r}] {what} speed-up: {med:.2f}x (medians), {best:.2f}x (best runs)", flush=True)
  result = {"what": "tools/bench/benchmark_serving.py: model.engine.generator vs transformers KimiLinearForCausalLM, same weights, CPU",
            "cpu_count": os.cpu_count(), "checkpoint": str(ckpt), "hf_dir": str(args.hf_dir),
            "prefill_tokens": args.prefill_tokens, "decode_tokens": args.decode_tokens, "runs": args.runs,
            "rounds": rounds}
  tmp = args.json.with_suffix(".tmp")
  tmp.write_text(json.dumps(result, indent=1) + "\n")
  os.replace(tmp, args.json)
  print(f"wrote {args.json} (the cores are shared with other jobs: see the load averages)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
