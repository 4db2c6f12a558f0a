"""The online mode of tools/bench/benchmark_serving.py: concurrent streaming clients against tools/serve.py
(or, with `--in-process`, the same workloads replayed on the engine itself, without HTTP).

`python tools/bench/benchmark_serving.py --online --help` lists the flags; the method is in that file's
docstring. Each configuration runs in a fresh server process, so compilations and caches of one do
not help another.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
DEMO = REPO / "kda_plugin" / "assets" / "demo"


WORKLOADS = ("mixed", "shared_prefix")
ENGINES = ("continuous", "static")   # model.engine.config.ENGINES (not imported: the client starts no jax)


SEED_LIMIT = 2 ** 32   # --seed in [0, SEED_LIMIT): numpy refuses negative seeds


class RequestFailed(Exception):
  """A request of the workload failed (the server refused it, or the connection broke): raised inside the
  client tasks, the others cancelled, printed by `main` as one `error:` line (exit status 1)."""


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """`(default: ...)` after each flag's help, except where there is no default to show (None, empty,
  a switch off) or the help already says it."""

  def _get_help_string(self, action):
    default = action.default
    if default is None or default is False or default in ("", []) or "default" in (action.help or ""):
      return action.help
    return super()._get_help_string(action)


class OneLineErrorParser(argparse.ArgumentParser):
  """argparse whose errors are the project's one `error:` line on stderr, exit status 2 (no usage dump)."""

  def error(self, message):
    print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
    sys.exit(2)


def _parser() -> argparse.ArgumentParser:
  p = OneLineErrorParser(prog="benchmark_serving.py --online", formatter_class=DefaultsHelpFormatter,
                         description="Online serving benchmark (see tools/bench/benchmark_serving.py). The flags "
                                     "that size the servers this tool starts (--engines, --max-num-seqs, "
                                     "--max-model-len, --max-num-batched-tokens, --prefix-cache-bytes, "
                                     "--max-num-partial-prefills, --serve-arg, --start-timeout, --rounds) are "
                                     "refused with --url.")
  p.add_argument("--url", default="",
                 help="an already running server: measure it (one configuration per workload) instead of "
                      "starting servers. Its /metrics are scraped before and after the measured requests and "
                      "the JSON's server_metrics are the differences. The server keeps its prefix cache "
                      "between runs: a repeated run (same --seed) finds its own prompts cached and is measured "
                      "warm; a note is printed when the server's prefix cache holds anything before the run")
  p.add_argument("--checkpoint", type=pathlib.Path, default=DEMO,
                 help="the checkpoint to serve (its config.json gives the vocabulary of the random prompts; "
                      "with --url, give the served one's)")
  p.add_argument("--engines", default="continuous,static", help="engines of the mixed workload: continuous, static")
  p.add_argument("--workloads", default="mixed,shared_prefix", help="mixed, shared_prefix (comma-separated)")
  p.add_argument("--num-requests", type=int, default=64, help="measured requests per configuration")
  p.add_argument("--concurrency", type=int, default=32, help="concurrent clients")
  p.add_argument("--prompt-min", type=int, default=16, help="mixed: prompt tokens, at least")
  p.add_argument("--prompt-max", type=int, default=1024, help="mixed: prompt tokens, at most")
  p.add_argument("--output-min", type=int, default=16, help="output tokens of a request, at least")
  p.add_argument("--output-max", type=int, default=256, help="output tokens of a request, at most")
  p.add_argument("--prefix-len", type=int, default=512, help="shared_prefix: the common prefix")
  p.add_argument("--suffix-min", type=int, default=16, help="shared_prefix: suffix tokens after the prefix, at least")
  p.add_argument("--suffix-max", type=int, default=128, help="shared_prefix: suffix tokens after the prefix, at most")
  p.add_argument("--warmup", type=int, default=None, help="unmeasured requests first (default: --concurrency)")
  p.add_argument("--max-num-seqs", type=int, default=32, help="the servers' max_num_seqs")
  p.add_argument("--max-model-len", type=int, default=0,
                 help="the servers' max_model_len; 0: the longest prompt + longest output the workload draws")
  p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the servers' max_num_batched_tokens")
  p.add_argument("--prefix-cache-bytes", type=int, default=1 << 30, help="the 'prefix cache on' budget")
  p.add_argument("--max-num-partial-prefills", type=int, default=0,
                 help="the continuous engines' max_num_partial_prefills (P: prompts prefilled in one step; "
                      "many requests arriving together wait N / P steps for their first tokens); "
                      "0: the engine's default, min(4, --max-num-seqs)")
  p.add_argument("--serve-arg", action="append", default=[],
                 help="more key=value for tools.serve (repeatable; configs/base.py keys)")
  p.add_argument("--start-timeout", type=float, default=1200.0, help="seconds a server may take to listen")
  p.add_argument("--seed", type=int, default=0, help=f"the workload's prompts (the warm-up's: --seed + 1); "
                                                     f"in [0, 2**32)")
  p.add_argument("--rounds", type=int, default=1,
                 help="measure every configuration this many times, in interleaved rounds (each in a fresh "
                      "server or engine), and report each figure's median over the rounds: the cores are "
                      "shared, and one run can be slowed by other jobs")
  p.add_argument("--client", choices=("raw", "openai"), default="raw",
                 help="raw (default): aiohttp streaming with the SSE lines parsed as JSON, as vLLM's "
                      "benchmark_serving does, so that the measuring client takes little of the CPU the server "
                      "shares with it; openai: the official openai client (its per-chunk models cost about a "
                      "third of a core at 32 streams on the 2-core host)")
  p.add_argument("--in-process", action="store_true",
                 help="no server and no HTTP: the same workloads replayed on the engine in this process, "
                      "`--concurrency` closed-loop clients in engine steps (separates the engine's cost from "
                      "the HTTP path's and the clients')")
  p.add_argument("--compilation-cache-dir", default="",
                 help="jax's persistent compilation cache of the engines (--in-process) or servers this tool starts: "
                      "'' = $KDA_COMPILATION_CACHE_DIR, else ~/.cache/kda_plugin/jax; none = off (every start "
                      "compiles). The rows record each start's compile seconds")
  p.add_argument("--json", type=pathlib.Path, default=REPO / "runs/serving/benchmark_serving_online.json",
                 help="where the results are written")
  return p


def workload(kind: str, args, vocab: int, seed: int, count: int | None = None) -> list[tuple[list[int], int]]:
  """`[(prompt ids, output tokens)]` of `count` (default `--num-requests`) requests (ids drawn from [4, vocab))."""
  count = args.num_requests if count is None else count
  rng = np.random.default_rng(seed)
  outs = rng.integers(args.output_min, args.output_max + 1, count)
  if kind == "mixed":
    lens = rng.integers(args.prompt_min, args.prompt_max + 1, count)
    return [(rng.integers(4, vocab, n).tolist(), int(o)) for n, o in zip(lens, outs)]
  if kind == "shared_prefix":
    prefix = rng.integers(4, vocab, args.prefix_len).tolist()
    lens = rng.integers(args.suffix_min, args.suffix_max + 1, count)
    return [(prefix + rng.integers(4, vocab, n).tolist(), int(o)) for n, o in zip(lens, outs)]
  raise ValueError(f"unknown workload {kind!r}; expected one of {WORKLOADS}")   # check_args refuses it first


async def _one(client, model, ids, n, sem) -> dict:
  async with sem:
    t0 = time.perf_counter()
    first = last = None
    tokens = cached = 0
    import openai   # the official client only for --client openai (not needed by the raw client)
    try:
      stream = await client.completions.create(model=model, prompt=ids, max_tokens=n, temperature=0, stream=True,
                                               stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
    except openai.APIStatusError as e:
      raise RequestFailed(f"the server answered {e.status_code}: {str(e.message)[:500]}") from None
    except openai.APIError as e:
      raise RequestFailed(f"a request failed: {e}") from None
    async for chunk in stream:
      now = time.perf_counter()
      if chunk.choices:
        got = len((chunk.choices[0].model_extra or {}).get("token_ids") or [])
        if got:
          first = now if first is None else first
          last = now
          tokens += got
      if chunk.usage is not None:
        cached = chunk.usage.prompt_tokens_details.cached_tokens if chunk.usage.prompt_tokens_details else 0
        tokens = chunk.usage.completion_tokens
    return {"prompt_tokens": len(ids), "output_tokens": tokens, "cached_tokens": cached, "sent": t0,
            "ttft_s": first - t0, "tpot_s": (last - first) / (tokens - 1) if tokens > 1 else None, "end": last}


async def _one_raw(session, url, model, ids, n, sem) -> dict:
  """`_one` over plain HTTP: the same request body, the SSE stream read line by line."""
  body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "stream": True,
          "stream_options": {"include_usage": True}, "ignore_eos": True, "return_token_ids": True}
  async with sem:
    t0 = time.perf_counter()
    first = last = None
    tokens = cached = 0
    async with session.post(url + "/v1/completions", json=body) as response:
      if response.status != 200:
        raise RequestFailed(f"the server answered {response.status}: {(await response.text())[:500]}")
      async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
          continue
        now = time.perf_counter()
        chunk = json.loads(line[6:])
        got = len(chunk["choices"][0].get("token_ids") or []) if chunk.get("choices") else 0
        if got:
          first = now if first is None else first
          last = now
          tokens += got
        if chunk.get("usage"):
          cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
          tokens = chunk["usage"]["completion_tokens"]
    return {"prompt_tokens": len(ids), "output_tokens": tokens, "cached_tokens": cached, "sent": t0,
            "ttft_s": first - t0, "tpot_s": (last - first) / (tokens - 1) if tokens > 1 else None, "end": last}


async def _run(url, model, requests, concurrency, client_kind="raw") -> tuple[list[dict], float]:
  sem = asyncio.Semaphore(concurrency)
  if client_kind == "openai":
    import openai  # the official client (test extra): needed by this mode only
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    one = lambda ids, n: _one(client, model, ids, n, sem)
  else:
    import aiohttp  # test extra: needed by this mode only
    client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600),
                                   connector=aiohttp.TCPConnector(limit=2 * concurrency))
    one = lambda ids, n: _one_raw(client, url, model, ids, n, sem)
  t0 = time.perf_counter()
  try:
    results = await _all_or_first_failure([one(ids, n) for ids, n in requests], client_kind)
  finally:
    await client.close()
  return results, time.perf_counter() - t0


async def _all_or_first_failure(coros, client_kind="raw") -> list:
  """The results of `coros`, run concurrently; at the first failure the others are cancelled (and
  awaited, so no task is left with an exception nobody retrieves) and that failure is raised, as
  `RequestFailed` for a refused request or a broken connection."""
  tasks = [asyncio.ensure_future(c) for c in coros]
  try:
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
  finally:
    for t in tasks:
      t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
  if failed is not None:
    e = failed.exception()
    if not isinstance(e, RequestFailed) and _is_client_error(e, client_kind):
      raise RequestFailed(f"a request failed: {type(e).__name__}: {e}") from e
    raise e
  return [t.result() for t in tasks]


def _is_client_error(e: BaseException, client_kind: str) -> bool:
  """Whether `e` is the HTTP client's failure of a request (connection refused or dropped, timeout)."""
  if isinstance(e, (OSError, asyncio.TimeoutError)):
    return True
  if client_kind == "openai":
    import openai   # each client's own error type, for the client this run uses (the other may be absent)
    return isinstance(e, openai.APIError)
  import aiohttp   # as above
  return isinstance(e, aiohttp.ClientError)


def _pct(values, q) -> float | None:
  """The `q`th percentile of `values`; None (JSON null) when there are none."""
  return float(np.percentile(np.asarray(values, float), q)) if len(values) else None


def _fmt(value, spec: str = ".3f", scale: float = 1.0) -> str:
  """`value * scale` formatted, or "-" for a figure with no value (None: no requests to take it over)."""
  return "-" if value is None else format(value * scale, spec)


BLOCK = 64   # the prefix cache's block (model.engine.prefix_cache.BLOCK; not imported: no jax in the client)


def summarize(results: list[dict], wall: float, prefix_len: int | None = None) -> dict:
  """Figures over `results`; with `prefix_len` (shared_prefix) also TTFT p50 of the requests whose
  suffix is shorter than a block and of the rest: with the prefix cache on, a suffix of a block or
  more ends a chunk at its last full block (a snapshot), and its step prefills the rest in a second
  stage (a second step when the step's rows are over `model.engine.scheduler.TAIL_MAX_BUCKET`)."""
  ttft = [r["ttft_s"] for r in results]
  split = {}
  if prefix_len is not None:
    short = [r["ttft_s"] for r in results if r["prompt_tokens"] - prefix_len < BLOCK]
    long = [r["ttft_s"] for r in results if r["prompt_tokens"] - prefix_len >= BLOCK]
    split = {"ttft_p50_suffix_under_block_s": _pct(short, 50), "ttft_p50_suffix_block_or_more_s": _pct(long, 50),
             "requests_suffix_under_block": len(short)}
  tpot = [r["tpot_s"] for r in results if r["tpot_s"] is not None]
  out = sum(r["output_tokens"] for r in results)
  prompt = sum(r["prompt_tokens"] for r in results)
  return {"requests": len(results), "wall_s": wall, "output_tokens": out, "output_tokens_per_s": out / wall,
          "prompt_tokens": prompt, "cached_tokens": sum(r["cached_tokens"] for r in results),
          "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99), "tpot_p50_s": _pct(tpot, 50),
          "tpot_p99_s": _pct(tpot, 99), "ttft_mean_s": statistics.fmean(ttft), **split}


STEP_FIELDS = ("admit_s", "execute_s", "events_s", "saves_s")
FIRST_STEPS = 8   # steps listed one by one in `step_summary` (a workload's arrival wave)


def step_summary(steps: list[dict]) -> dict:
  """The measured run's engine steps (`ContinuousEngine.last_step_timing` each, executed steps only):
  their count; each stage's total seconds and each count's total (`prompts`, `decodes`, `restores`,
  `saves`); the step's median wall ms; the seconds of steps with prompt chunks and of decode-only
  steps, with their counts; and the first FIRST_STEPS steps as they ran, their stages in ms
  (`admit_ms`, ...; the arrival wave: where a per-prompt cost of a step shows)."""
  wall = [sum(st[f] for f in STEP_FIELDS) for st in steps]
  with_prompts = [w for w, st in zip(wall, steps) if st["prompts"]]
  decode_only = [w for w, st in zip(wall, steps) if not st["prompts"]]
  keep = ("prompts", "decodes", "restores", "saves")
  return {"steps": len(steps), **{f: round(sum(st[f] for st in steps), 6) for f in STEP_FIELDS},
          **{k: sum(st[k] for st in steps) for k in keep},
          "step_ms_p50": round(statistics.median(wall) * 1e3, 3),
          "with_prompts": {"steps": len(with_prompts), "s": round(sum(with_prompts), 6)},
          "decode_only": {"steps": len(decode_only), "s": round(sum(decode_only), 6)},
          "first_steps": [{**{f[:-2] + "_ms": round(st[f] * 1e3, 3) for f in STEP_FIELDS}, **{k: st[k] for k in keep}}
                          for st in steps[:FIRST_STEPS]]}


def startup_figures(log: str) -> dict:
  """The start-up figures a `tools.serve` log states: compile_s and the executables (the
  `model.engine.warmup` summary line), startup_s (the server's own, load included)."""
  out = {}
  m = re.search(r"compiled (\d+) step executables in ([0-9.]+) s: (.*)", log)
  if m:
    out.update(executables=int(m.group(1)), compile_s=float(m.group(2)), compile_detail=m.group(3).strip())
  m = re.search(r"start-up ([0-9.]+) s", log)
  if m:
    out["server_startup_s"] = float(m.group(1))
  return out


class _Server:
  """`python -m tools.serve` on port 0, until stopped (SIGTERM drain)."""

  def __init__(self, args, keys: list[str], label: str):
    argv = [sys.executable, "-m", "tools.serve", f"load_parameters_path={args.checkpoint}", "port=0", *keys,
            *([f"compilation_cache_dir={args.compilation_cache_dir}"] if args.compilation_cache_dir else []),
            *args.serve_arg]
    print("$ " + " ".join(argv), flush=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_")
    self.log = open(args.json.with_suffix(f".{slug}.serve.log"), "w")
    self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                 env=dict(os.environ, PYTHONUNBUFFERED="1"))
    t0 = time.monotonic()
    deadline = t0 + args.start_timeout
    while True:
      line = self.proc.stdout.readline()
      m = re.search(r"listening on (http://\S+)", line or "")
      if m:
        self.url = m.group(1)
        break
      if not line and self.proc.poll() is not None or time.monotonic() > deadline:
        self.stop()
        raise SystemExit(f"error: the server did not start (see {self.log.name})")
    self.log.flush()
    self.startup = {"startup_s": time.monotonic() - t0, **startup_figures(pathlib.Path(self.log.name).read_text())}
    print(f"server up in {self.startup['startup_s']:.1f} s (compile {_fmt(self.startup.get('compile_s'), '.1f')} s)",
          flush=True)

  def stop(self) -> None:
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(timeout=120)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    self.log.close()


# The server's counters (and gauges) the benchmark reads from /metrics (model/server/metrics.py).
COUNTERS = ("kda_num_compilations", "kda_prompt_tokens_total", "kda_cached_prompt_tokens_total",
            "kda_generation_tokens_total")
GAUGES = ("kda_prefix_cache_bytes", "kda_num_requests_running")


def scrape(url) -> dict[str, float | None]:
  """The values of COUNTERS and GAUGES in the server's /metrics now (None: not exposed)."""
  with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
    text = r.read().decode()
  out = {}
  for name in COUNTERS + GAUGES:
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    out[name] = float(m.group(1)) if m else None
  return out


def _scrape_settled(url, timeout_s: float = 5.0) -> dict:
  """`scrape` once no request runs (the engine loop refreshes its counters after the step that sent a
  request's last token, so a scrape right after the responses can miss that step), or after `timeout_s`
  (a server with other clients may never be idle)."""
  deadline = time.monotonic() + timeout_s
  while True:
    now = scrape(url)
    if not now["kda_num_requests_running"] or time.monotonic() > deadline:
      return now
    time.sleep(0.05)


def metrics_delta(before: dict, after: dict) -> dict:
  """The server's counters over the measured requests: `after - before` of each of COUNTERS (None where
  either scrape lacks it), the prefix-cache hit rate of those requests alone, and the prefix cache's
  bytes after them (a gauge)."""
  out = {"scope": "differences over the measured requests (/metrics scraped after the warm-up and after the "
                  "workload); a server with other clients counts their tokens too"}
  for name in COUNTERS:
    a, b = before.get(name), after.get(name)
    out[name] = None if a is None or b is None else b - a
  prompt, cached = out["kda_prompt_tokens_total"], out["kda_cached_prompt_tokens_total"]
  out["prefix_cache_hit_rate"] = cached / prompt if prompt and cached is not None else None
  out["kda_prefix_cache_bytes_after"] = after.get("kda_prefix_cache_bytes")
  return out


def warm_note(url, before: dict) -> str:
  """A one-line note when the server's prefix cache already holds something before this benchmark's
  first request (an earlier run, or other clients): the measured prompts may find themselves cached."""
  held, cached = before.get("kda_prefix_cache_bytes") or 0, before.get("kda_cached_prompt_tokens_total") or 0
  if held <= 0:
    return ""
  return (f"note: the server at {url} is already warm: its prefix cache holds {held:.0f} bytes before this run "
          f"({cached:.0f} prompt tokens served from it so far); a repeated run (same --seed) finds its own "
          f"prompts cached, so its TTFT is measured warm. Restart the server (or change --seed) for a cold run.")


def measure(args, url, label, requests, warmup, prefix_len=None) -> dict:
  """One configuration against the server at `url`: the warm-up, then the measured workload; the row
  holds the client's figures and the server's counters over the measured requests (`metrics_delta`)."""
  with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
    model = json.loads(r.read())["data"][0]["id"]
  warm = warmup_count(args)
  if warm:  # other prompts (another seed): the measured ones must not find themselves in the prefix cache
    # One request alone first, so that in shared_prefix the rest (sharing its prefix) find it cached:
    # concurrent first requests all miss.
    asyncio.run(_run(url, model, warmup[:1], 1, args.client))
    asyncio.run(_run(url, model, warmup[1:warm], args.concurrency, args.client))
  before = _scrape_settled(url)
  results, wall = asyncio.run(_run(url, model, requests, args.concurrency, args.client))
  after = _scrape_settled(url)
  row = {"config": label, "client": args.client, **summarize(results, wall, prefix_len),
         "server_metrics": metrics_delta(before, after), "load_after": os.getloadavg()}
  print(f"[{label}] {row['output_tokens_per_s']:.1f} output tokens/s, TTFT p50 {_fmt(row['ttft_p50_s'])} s, "
        f"TPOT p50 {_fmt(row['tpot_p50_s'], '.1f', 1e3)} ms; load {row['load_after'][0]:.1f}", flush=True)
  return row


class _Replay:
  """The engine of one configuration, built in this process (`--in-process`)."""

  def __init__(self, args, keys: list[str], max_len: int):
    # Only --in-process builds a model: the online mode's client process never starts jax.
    from model.engine.config import EngineConfig
    from model.engine.factory import build_engine
    from model.loading import load_model
    kv = dict(k.split("=", 1) for k in keys)
    self.model, cfg = load_model(args.checkpoint, [f"max_cache_length={max_len}"])
    config = EngineConfig(engine=kv["engine"], max_num_seqs=int(kv["max_num_seqs"]), max_model_len=int(kv["max_model_len"]),
                          max_num_batched_tokens=int(kv["max_num_batched_tokens"]),
                          prefix_cache_bytes=int(kv.get("prefix_cache_bytes", 0)),
                          max_num_partial_prefills=int(kv.get("max_num_partial_prefills", 0)))
    self.engine = build_engine(config, self.model, rules=cfg)
    from model.engine.warmup import compile_engine  # with the engine it compiles: model imports stay lazy here
    self.compile_report = compile_engine(self.engine)   # as tools.serve does before it listens
    self._n = 0

  def run(self, requests, concurrency) -> tuple[list[dict], float]:
    """Closed loop: `concurrency` requests in flight, the next added when one finishes; times on the host
    clock when the engine emitted each token (request sent = added). The static engine runs a whole
    group in one `step` and emits each decode chunk as it lands: timed at the end of the step, every
    token of a group would share one time (TPOT 0, TTFT the group's whole run)."""
    from model.engine.api import Request   # jax-free, but with the model package: --in-process only
    pending = collections.deque(requests)
    live: dict[str, dict] = {}
    done: list[dict] = []

    def add():
      ids, n = pending.popleft()
      rid = f"r{self._n}"
      self._n += 1
      live[rid] = {"prompt_tokens": len(ids), "output_tokens": 0, "cached_tokens": 0, "sent": time.perf_counter(),
                   "first": None, "last": None}
      self.engine.add_request(Request(rid, tuple(ids), int(n)))

    t0 = time.perf_counter()
    for _ in range(min(concurrency, len(pending))):
      add()
    self.steps = []   # the continuous engine's per-step stages (`ContinuousEngine.last_step_timing`)
    while self.engine.has_unfinished():
      events = []
      self.engine.step(lambda e: events.append((e, time.perf_counter())))
      timing = getattr(self.engine, "last_step_timing", None)
      if timing is not None and timing.executed:
        self.steps.append(dataclasses.asdict(timing))
      for e, now in events:
        r = live[e.request_id]
        if e.token_id is not None:
          r["first"] = now if r["first"] is None else r["first"]
          r["last"] = now
          r["output_tokens"] += 1
        r["cached_tokens"] = e.cached_tokens
        if e.finish_reason is not None:
          del live[e.request_id]
          k = r["output_tokens"]
          done.append({**r, "ttft_s": r["first"] - r["sent"], "end": r["last"],
                       "tpot_s": (r["last"] - r["first"]) / (k - 1) if k > 1 else None})
          if pending:
            add()
    return done, time.perf_counter() - t0


def replay(args, label, keys, requests, warmup, max_len, prefix_len=None) -> dict:
  """`measure` without the server: the same warm-up and workload on the engine in this process."""
  rep = _Replay(args, keys, max_len)
  warm = warmup_count(args)
  t0 = time.perf_counter()
  if warm:
    rep.run(warmup[:1], 1)
    rep.run(warmup[1:warm], args.concurrency)
  warmup_s = time.perf_counter() - t0   # engine=static compiles here, at its first group of each shape
  results, wall = rep.run(requests, args.concurrency)
  row = {"config": label + " (in-process replay, no HTTP)", **summarize(results, wall, prefix_len),
         "load_after": os.getloadavg(), "compile": rep.compile_report.as_dict(), "warmup_s": warmup_s,
         **({"engine_steps": step_summary(rep.steps)} if rep.steps else {})}
  print(f"[{row['config']}] start-up: {rep.compile_report.summary()}; warm-up requests {warmup_s:.1f} s", flush=True)
  print(f"[{row['config']}] {row['output_tokens_per_s']:.1f} output tokens/s, TTFT p50 {_fmt(row['ttft_p50_s'])} s, "
        f"TPOT p50 {_fmt(row['tpot_p50_s'], '.1f', 1e3)} ms; load {row['load_after'][0]:.1f}", flush=True)
  return row


_FIGURES = ("wall_s", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "ttft_mean_s",
            "ttft_p50_suffix_under_block_s", "ttft_p50_suffix_block_or_more_s")


def median_row(runs: list[dict]) -> dict:
  """One configuration's row: each figure the median over its rounds (`runs`, kept under "rounds")."""
  if len(runs) == 1:
    return {**runs[0], "rounds": 1}
  row = {**runs[-1], **{k: _median([r[k] for r in runs]) for k in _FIGURES if k in runs[0]}}
  return {**row, "rounds": len(runs), "per_round": runs}


def _median(values: list) -> float | None:
  """The median of the rounds that have the figure (None: none has it)."""
  values = [v for v in values if v is not None]
  return statistics.median(values) if values else None


def _ratio(off, on) -> float | None:
  return off / on if off is not None and on else None


def prefix_cache_ratio(rows: list[dict]) -> str:
  """The shared-prefix TTFT p50 ratio (cache off / on), with each round's own ratio when there are rounds."""
  on = next((r for r in rows if r["workload"] == "shared_prefix" and "cache on" in r["config"]), None)
  off = next((r for r in rows if r["workload"] == "shared_prefix" and "cache off" in r["config"]), None)
  if on is None or off is None:
    return ""
  text = f"prefix cache TTFT p50 ratio (off / on, medians): {_fmt(_ratio(off['ttft_p50_s'], on['ttft_p50_s']), '.2f')}x"
  if on.get("rounds", 1) > 1:
    each = [_ratio(b["ttft_p50_s"], a["ttft_p50_s"]) for a, b in zip(on["per_round"], off["per_round"])]
    text += " (each round: " + ", ".join(f"{_fmt(x, '.2f')}x" for x in each) + ")"
  if "ttft_p50_suffix_under_block_s" in on:
    text += (f"; with the cache on, TTFT p50 of suffixes under {BLOCK} tokens "
             f"{_fmt(on['ttft_p50_suffix_under_block_s'])} s, of {BLOCK} or more (a snapshot at their last full "
             f"block) {_fmt(on['ttft_p50_suffix_block_or_more_s'])} s")
    if None in (on["ttft_p50_suffix_under_block_s"], on["ttft_p50_suffix_block_or_more_s"]):
      text += " (-: no such request)"
  if on.get("cached_tokens") == 0:
    text += ("; NOTE: the cache-on run cached no prompt token (every request was admitted before a prefix "
             "was saved; a warm-up request, --warmup >= 1, saves it first): the ratio measures no cache hit")
  return text


def table(rows: list[dict]) -> str:
  lines = ["| workload | configuration | requests | rounds | output tok/s | TTFT p50 (s) | TTFT p99 (s) | "
           "TPOT p50 (ms) | TPOT p99 (ms) | cached prompt tokens |", "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['workload']} | {r['config']} | {r['requests']} | {r.get('rounds', 1)} | "
                 f"{r['output_tokens_per_s']:.1f} | "
                 f"{_fmt(r['ttft_p50_s'])} | {_fmt(r['ttft_p99_s'])} | {_fmt(r['tpot_p50_s'], '.1f', 1e3)} | "
                 f"{_fmt(r['tpot_p99_s'], '.1f', 1e3)} | {r['cached_tokens']} |")
  return "\n".join(lines)


def warmup_count(args) -> int:
  """Unmeasured requests before each configuration's workload (`--warmup`, default `--concurrency`)."""
  return args.concurrency if args.warmup is None else args.warmup


def _split(text: str) -> list[str]:
  out = []
  for item in (w.strip() for w in text.split(",")):
    if item and item not in out:
      out.append(item)
  return out


# tools.serve keys this tool sets on every server it starts, and the flag (or reason) that sets each.
_OWN_SERVE_KEYS = {"load_parameters_path": "--checkpoint", "port": "a free port", "engine": "--engines / the workload",
                   "max_num_seqs": "--max-num-seqs", "max_model_len": "--max-model-len",
                   "max_num_batched_tokens": "--max-num-batched-tokens",
                   "max_num_partial_prefills": "--max-num-partial-prefills",
                   "prefix_cache_bytes": "--prefix-cache-bytes / the workload"}


def check_args(parser: argparse.ArgumentParser, args) -> tuple[list[str], list[str]]:
  """Every flag's value, before anything starts (no server, no model, nothing written): one `error:` line
  naming the flag and exit status 2 (`parser.error`) for the first bad one. Returns (workloads, engines).

  With --url the server must answer GET /v1/models (nothing is sent to it otherwise); the sizes the
  started servers would refuse (their `tools.serve` key checks) are refused here instead."""
  bad = parser.error
  if args.rounds < 1:
    bad(f"--rounds must be >= 1, got {args.rounds}")
  if args.url and args.rounds > 1:
    bad("--rounds needs a fresh server per round (a running server's prefix cache already holds the "
        "measured prompts after one round): drop --url, or --rounds")
  if args.url and args.in_process:
    bad("--url measures a running server and --in-process the engine in this process: give one of them")
  if args.url or args.in_process:   # flags of the servers this tool would start: ignored silently otherwise
    only = _SERVER_ONLY_FLAGS if args.url else ("--serve-arg", "--start-timeout")
    for flag in only:
      dest = flag.lstrip("-").replace("-", "_")
      if getattr(args, dest) != parser.get_default(dest):
        bad(f"{flag} configures the servers this tool starts, and "
            f"{'--url measures a running one' if args.url else '--in-process starts none'}: drop {flag}")
  if not 0 <= args.seed < SEED_LIMIT:
    bad(f"--seed must be an integer in [0, 2**32), got {args.seed}")
  kinds = _split(args.workloads)
  unknown = [k for k in kinds if k not in WORKLOADS]
  if unknown or not kinds:
    bad(f"--workloads must be a comma-separated list of {', '.join(WORKLOADS)}; got {args.workloads!r}")
  engines = _split(args.engines) if "mixed" in kinds and not args.url else []
  if "mixed" in kinds and not args.url and (not engines or any(e not in ENGINES for e in engines)):
    bad(f"--engines must be a comma-separated list of {', '.join(ENGINES)}; got {args.engines!r}")
  for flag, value, low in (("--num-requests", args.num_requests, 1), ("--concurrency", args.concurrency, 1),
                           ("--warmup", 0 if args.warmup is None else args.warmup, 0),
                           ("--output-min", args.output_min, 1)):
    if value < low:
      bad(f"{flag} must be an integer >= {low}, got {value}")
  pairs = [("--output-min", args.output_min, "--output-max", args.output_max)]
  if "mixed" in kinds:
    if args.prompt_min < 1:
      bad(f"--prompt-min must be an integer >= 1, got {args.prompt_min}")
    pairs.append(("--prompt-min", args.prompt_min, "--prompt-max", args.prompt_max))
  if "shared_prefix" in kinds:
    if args.prefix_len < 1:
      bad(f"--prefix-len must be an integer >= 1, got {args.prefix_len}")
    if args.suffix_min < 0:
      bad(f"--suffix-min must be an integer >= 0, got {args.suffix_min}")
    pairs.append(("--suffix-min", args.suffix_min, "--suffix-max", args.suffix_max))
  for low_flag, low, high_flag, high in pairs:
    if low > high:
      bad(f"{low_flag} ({low}) must be <= {high_flag} ({high})")
  longest = max([args.output_max + (args.prompt_max if k == "mixed" else args.prefix_len + args.suffix_max)
                 for k in kinds])
  if not args.url:   # the sizes of the servers (engines) this run starts: tools.serve's own checks
    for flag, value, low in (("--max-num-seqs", args.max_num_seqs, 1),
                             ("--max-num-batched-tokens", args.max_num_batched_tokens, 1),
                             ("--prefix-cache-bytes", args.prefix_cache_bytes, 0)):
      if value < low:
        bad(f"{flag} must be an integer >= {low}, got {value}")
    if not 0 <= args.max_num_partial_prefills <= max(args.max_num_seqs, 1):
      bad(f"--max-num-partial-prefills must be an integer in [0, --max-num-seqs={args.max_num_seqs}] "
          f"(0: the engine's default), got {args.max_num_partial_prefills}")
    if args.max_num_partial_prefills and not ("shared_prefix" in kinds or "continuous" in engines):
      bad("--max-num-partial-prefills sizes the continuous engine, and this run starts none "
          "(--engines static with --workloads mixed)")
    if ("shared_prefix" in kinds or "continuous" in engines) and args.max_num_batched_tokens < args.max_num_seqs:
      bad(f"--max-num-batched-tokens ({args.max_num_batched_tokens}) must be >= --max-num-seqs "
          f"({args.max_num_seqs}) for engine=continuous (every decoding request needs one token per step)")
    if args.max_model_len < 0:
      bad(f"--max-model-len must be 0 (fit the workload) or >= 2, got {args.max_model_len}")
    if args.max_model_len and args.max_model_len < longest:
      bad(f"--max-model-len ({args.max_model_len}) must be 0 (fit the workload) or hold the longest request the "
          f"workload may draw: prompt + output up to {longest} tokens")
    if args.start_timeout <= 0:
      bad(f"--start-timeout must be > 0 seconds, got {args.start_timeout}")
    for item in args.serve_arg:
      if "=" not in item:
        bad(f"--serve-arg takes key=value (a tools.serve key), got {item!r}")
      key = item.split("=", 1)[0].strip().lstrip("-")
      if key in _OWN_SERVE_KEYS:   # tools.serve would take the later value silently: the JSON would record the other
        bad(f"--serve-arg {item!r}: {key} is set by this tool ({_OWN_SERVE_KEYS[key]}), not by --serve-arg")
    if args.serve_arg:
      problem = serve_arg_problem(args.serve_arg)
      if problem:
        bad(f"--serve-arg: {problem}")
  if not (args.checkpoint / "config.json").is_file():
    bad(f"--checkpoint {str(args.checkpoint)!r} has no config.json (a checkpoint directory: it gives the "
        f"vocabulary of the prompts{', and the model served' if not args.url else ''})")
  if args.json.is_dir():
    bad(f"--json {str(args.json)!r} is a directory; expected a file path")
  ancestor = args.json.parent
  while not ancestor.exists() and ancestor != ancestor.parent:
    ancestor = ancestor.parent
  if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
    bad(f"--json {str(args.json)!r}: cannot write under {str(ancestor)!r}")
  if args.url:
    served = probe(parser, args.url)
    limit = served.get("max_model_len")
    if isinstance(limit, int) and longest > limit:
      bad(f"the workload's longest request (prompt + output up to {longest} tokens: --prompt-max / --prefix-len "
          f"+ --suffix-max, + --output-max) exceeds the max_model_len={limit} of the server at --url {args.url}")
  check_json_writable(parser, args.json)   # last: it creates the directory (the only thing a check writes)
  return kinds, engines


def check_json_writable(parser: argparse.ArgumentParser, path: pathlib.Path) -> None:
  """Creates `path`'s directory (as the run would) and a file in it, removed at once: `parser.error`
  naming --json when either fails (os.access alone passes where root may write nothing, e.g. /proc),
  the directories it created removed again."""
  created = []
  parent = path.parent
  while not parent.exists() and parent != parent.parent:
    created.append(parent)
    parent = parent.parent
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".probe"):
      pass
  except OSError as e:
    for d in created:   # deepest first
      try:
        d.rmdir()
      except OSError:
        pass
    parser.error(f"--json {str(path)!r}: cannot write a file there ({e.strerror or e})")


def serve_arg_problem(items: list[str]) -> str:
  """Why tools.serve would refuse these `key=value` (configs/base.py: an unknown key, a value of the wrong
  type), "" when it would take them. The project's own parser (model.config.apply_overrides), imported
  here only: it brings jax's modules (not its runtime) into this process, so only with --serve-arg."""
  # Here, not at the top: jax's modules are imported only when --serve-arg is given (see above).
  from configs import base
  from model.config import apply_overrides
  from model.errors import UserError
  try:
    apply_overrides(base.get_config(), list(items))
  except UserError as e:
    return str(e)
  return ""


def probe(parser: argparse.ArgumentParser, url: str) -> dict:
  """The model entry GET /v1/models of `url` answers (`parser.error` naming --url when none answers)."""
  if not re.match(r"^https?://[^/]+", url):
    parser.error(f"--url must be http://HOST:PORT (the server's address), got {url!r}")
  try:
    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=10) as r:
      data = json.loads(r.read())
    return data["data"][0]
  except urllib.error.HTTPError as e:
    parser.error(f"--url {url}: GET /v1/models answered HTTP {e.code}: not an OpenAI-compatible server (tools.serve)?")
  except (urllib.error.URLError, OSError) as e:
    reason = getattr(e, "reason", e)
    parser.error(f"--url {url}: nothing answers there ({getattr(reason, 'strerror', None) or reason})")
  except (ValueError, KeyError, IndexError, TypeError):
    parser.error(f"--url {url}: GET /v1/models did not answer a model list: not an OpenAI-compatible server?")


# The flags that configure the servers this tool starts: refused with --url when given other than default.
_SERVER_ONLY_FLAGS = ("--engines", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
                      "--prefix-cache-bytes", "--max-num-partial-prefills", "--serve-arg", "--start-timeout", "--compilation-cache-dir")

# The flags that apply to each mode, recorded (typed) in the JSON's "args".
_COMMON = ("checkpoint", "workloads", "num_requests", "concurrency", "output_min", "output_max", "warmup", "seed",
           "json")
_WORKLOAD_FLAGS = {"mixed": ("prompt_min", "prompt_max"), "shared_prefix": ("prefix_len", "suffix_min", "suffix_max")}
_SERVER_FLAGS = ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "rounds", "compilation_cache_dir")


def recorded_args(args, kinds: list[str], engines: list[str], max_len: int) -> dict:
  """The settings of this run that apply to its mode, as JSON values (numbers as numbers, lists as lists):
  the mode ("url": a running server; "servers": a fresh server per configuration; "in_process"), the
  workload flags of the workloads run, the server sizes where this run starts the servers or engines."""
  mode = "url" if args.url else "in_process" if args.in_process else "servers"
  names = list(_COMMON) + [f for k in kinds for f in _WORKLOAD_FLAGS[k]]
  if mode != "url":
    names += _SERVER_FLAGS
    if "shared_prefix" in kinds or "continuous" in engines:
      names += ["prefix_cache_bytes", "max_num_partial_prefills"]
  if mode != "in_process":
    names.append("client")
  if mode == "servers":
    names += ["serve_arg", "start_timeout"]
  out = {"mode": mode}
  if mode == "url":
    out["url"] = args.url
  for name in names:
    value = getattr(args, name)
    out[name] = str(value) if isinstance(value, pathlib.Path) else value
  out["workloads"] = kinds
  out["warmup"] = warmup_count(args)
  if mode != "url":
    out["max_model_len"] = max_len
    if "mixed" in kinds:
      out["engines"] = engines
    if "max_num_partial_prefills" in out:   # the P the continuous engines ran with (0 resolved as they resolve it)
      from model.engine.config import DEFAULT_PARTIAL_PREFILLS  # no jax: the client mode stays light
      out["max_num_partial_prefills"] = args.max_num_partial_prefills or min(DEFAULT_PARTIAL_PREFILLS,
                                                                             args.max_num_seqs)
  return out


def main(argv) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  kinds, engines = check_args(parser, args)
  try:
    return _main(args, kinds, engines)
  except RequestFailed as e:   # one line, status 1 (started servers: the JSON keeps the configurations before it)
    print(f"error: {e}", file=sys.stderr)
    return 1


def _main(args, kinds: list[str], engines: list[str]) -> int:
  vocab = json.loads((args.checkpoint / "config.json").read_text())["vocab_size"]   # the served one's, with --url
  warm = warmup_count(args)
  loads = {k: workload(k, args, vocab, args.seed) for k in kinds}
  warmups = {k: workload(k, args, vocab, args.seed + 1, max(args.num_requests, warm)) for k in kinds}
  if "shared_prefix" in kinds:  # the warm-up shares the measured prefix (a system prompt the server has seen)
    prefix = loads["shared_prefix"][0][0][:args.prefix_len]
    warmups["shared_prefix"] = [(prefix + ids[args.prefix_len:], n) for ids, n in warmups["shared_prefix"]]
  longest = max(len(ids) + n for reqs in (*loads.values(), *warmups.values()) for ids, n in reqs)
  max_len = args.max_model_len or longest
  args.json.parent.mkdir(parents=True, exist_ok=True)
  if args.in_process:   # before the first compilation of this process
    from model.engine import compilation_cache  # only when a run asks for the cache: model imports stay lazy here
    print(compilation_cache.enable(args.compilation_cache_dir), flush=True)
  rows, note = [], ""
  if args.url:
    url = args.url.rstrip("/")
    note = warm_note(url, scrape(url))
    if note:
      print(note, flush=True)
    for k in kinds:
      rows.append({"workload": k, **measure(args, url, args.url, loads[k], warmups[k],
                                            args.prefix_len if k == "shared_prefix" else None)})
  else:
    base = [f"max_num_seqs={args.max_num_seqs}", f"max_model_len={max_len}",
            f"max_num_batched_tokens={args.max_num_batched_tokens}"]
    configs = []
    # the static engine prefills whole groups: P is the continuous engine's alone
    partial = [f"max_num_partial_prefills={args.max_num_partial_prefills}"] if args.max_num_partial_prefills else []
    if "mixed" in kinds:
      for e in engines:
        keys = [f"engine={e}"] + ([f"prefix_cache_bytes={args.prefix_cache_bytes}", *partial] if e == "continuous" else [])
        configs.append(("mixed", f"engine={e}", keys))
    if "shared_prefix" in kinds:
      for on in (True, False):
        configs.append(("shared_prefix", f"engine=continuous, prefix cache {'on' if on else 'off'}",
                        ["engine=continuous", f"prefix_cache_bytes={args.prefix_cache_bytes if on else 0}", *partial]))
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):     # interleaved: a slow spell of the host hits every configuration alike
      for kind, label, keys in configs:
        if args.rounds > 1:
          print(f"round {r + 1}/{args.rounds}: {kind}, {label}", flush=True)
        plen = args.prefix_len if kind == "shared_prefix" else None
        if args.in_process:
          row = replay(args, label, base + keys, loads[kind], warmups[kind], max_len, plen)
        else:
          server = _Server(args, base + keys, f"{kind}_{label}_round{r}")
          try:
            row = {**measure(args, server.url, label, loads[kind], warmups[kind], plen), "startup": server.startup}
          finally:
            server.stop()
        runs.setdefault((kind, label), []).append(row)
        # rewritten after every configuration ("partial": true until the end): an outer time limit
        # (the device check's) keeps what was measured
        _write_result(args, kinds, engines, max_len, _median_rows(runs), note, partial=True)
    rows = _median_rows(runs)
  md = table(rows)
  print(md)
  ratio = prefix_cache_ratio(rows)
  if ratio:
    print(ratio)
  _write_result(args, kinds, engines, max_len, rows, note, partial=False)
  print(f"wrote {args.json}")
  return 0


def _median_rows(runs: dict) -> list[dict]:
  return [{"workload": kind, **median_row(rs)} for (kind, _), rs in runs.items()]


def _write_result(args, kinds, engines, max_len, rows, note, *, partial: bool) -> None:
  """Writes the run's JSON atomically (a temporary file, then a rename)."""
  result = {"what": "tools/bench/benchmark_serving.py --online: tools.serve under concurrent streaming clients",
            "cpu_count": os.cpu_count(), "args": recorded_args(args, kinds, engines, max_len), "rows": rows,
            "table": table(rows), "prefix_cache_ratio": prefix_cache_ratio(rows), "partial": partial}
  if args.url:   # a running server: was its prefix cache warm before this run's first request?
    result["server_warm_before_run"] = note or None
  tmp = args.json.with_suffix(".tmp")
  tmp.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")   # no NaN (not JSON): figures without values are null
  os.replace(tmp, args.json)
