"""tools/bench/serving_load.py's round aggregation (no server): medians over interleaved rounds and the
shared-prefix TTFT ratio, each round's own ratio beside it."""

from __future__ import annotations

import pytest

from tools.bench import serving_load


def _run(ttft, tok_s=100.0):
  return {"config": "x", "requests": 4, "wall_s": 1.0, "output_tokens_per_s": tok_s, "ttft_p50_s": ttft,
          "ttft_p99_s": 2 * ttft, "tpot_p50_s": 0.02, "tpot_p99_s": 0.03, "ttft_mean_s": ttft, "cached_tokens": 0}


def test_rounds_report_the_median_of_each_figure():
  row = serving_load.median_row([_run(0.30, 90.0), _run(0.10, 300.0), _run(0.20, 100.0)])
  assert row["rounds"] == 3 and row["ttft_p50_s"] == 0.20 and row["output_tokens_per_s"] == 100.0
  assert [r["ttft_p50_s"] for r in row["per_round"]] == [0.30, 0.10, 0.20]
  assert serving_load.median_row([_run(0.5)])["ttft_p50_s"] == 0.5


def test_prefix_cache_ratio_is_off_over_on_with_each_round():
  on = {"workload": "shared_prefix",
        **serving_load.median_row([{**_run(t), "config": "cache on", "cached_tokens": 512} for t in (0.1, 0.2)])}
  off = {"workload": "shared_prefix", **serving_load.median_row([{**_run(t), "config": "cache off"} for t in (0.4, 0.5)])}
  text = serving_load.prefix_cache_ratio([on, off])
  assert text.startswith("prefix cache TTFT p50 ratio (off / on, medians): 3.00x")   # 0.45 / 0.15
  assert text.endswith("(each round: 4.00x, 2.50x)")
  assert serving_load.prefix_cache_ratio([on]) == ""
  # a cache-on run that hit nothing (every request admitted before a prefix was saved) says so
  cold = {**on, "cached_tokens": 0}
  assert "NOTE: the cache-on run cached no prompt token" in serving_load.prefix_cache_ratio([cold, off])


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--rounds", "2", "--url", "http://127.0.0.1:1"]])
def test_bad_rounds_are_refused_before_anything_starts(argv, capsys):
  with pytest.raises(SystemExit) as e:
    serving_load.main(argv)
  assert e.value.code == 2 and "--rounds" in capsys.readouterr().err


def test_shared_prefix_ttft_is_split_at_a_block_of_suffix():
  results = [{"prompt_tokens": 512 + s, "output_tokens": 2, "cached_tokens": 512, "ttft_s": t, "tpot_s": 0.01}
             for s, t in ((16, 0.03), (63, 0.05), (64, 0.08), (128, 0.09), (100, 0.07))]
  row = serving_load.summarize(results, 1.0, prefix_len=512)
  assert row["requests_suffix_under_block"] == 2
  assert row["ttft_p50_suffix_under_block_s"] == pytest.approx(0.04)
  assert row["ttft_p50_suffix_block_or_more_s"] == pytest.approx(0.08)
  assert "ttft_p50_suffix_under_block_s" not in serving_load.summarize(results, 1.0)


def test_the_client_block_is_the_prefix_cache_block():
  from model.engine.prefix_cache import BLOCK
  assert serving_load.BLOCK == BLOCK


def test_server_metrics_are_the_differences_over_the_measured_requests():
  before = {"kda_num_compilations": 40.0, "kda_prompt_tokens_total": 1000.0, "kda_cached_prompt_tokens_total": 200.0,
            "kda_generation_tokens_total": 5000.0, "kda_prefix_cache_bytes": 10.0, "kda_num_requests_running": 0.0}
  after = {**before, "kda_prompt_tokens_total": 1800.0, "kda_cached_prompt_tokens_total": 800.0,
           "kda_generation_tokens_total": 5640.0, "kda_prefix_cache_bytes": 99.0}
  d = serving_load.metrics_delta(before, after)
  assert (d["kda_num_compilations"], d["kda_prompt_tokens_total"], d["kda_cached_prompt_tokens_total"],
          d["kda_generation_tokens_total"]) == (0.0, 800.0, 600.0, 640.0)
  assert d["prefix_cache_hit_rate"] == 0.75 and d["kda_prefix_cache_bytes_after"] == 99.0
  assert "differences" in d["scope"]
  missing = serving_load.metrics_delta({**before, "kda_num_compilations": None}, after)
  assert missing["kda_num_compilations"] is None and missing["kda_generation_tokens_total"] == 640.0
  idle = serving_load.metrics_delta(before, before)
  assert idle["prefix_cache_hit_rate"] is None and idle["kda_generation_tokens_total"] == 0.0


def test_a_warm_server_gets_a_note():
  cold = {"kda_prefix_cache_bytes": 0.0, "kda_cached_prompt_tokens_total": 0.0}
  assert serving_load.warm_note("http://h:1", cold) == ""
  assert serving_load.warm_note("http://h:1", {"kda_prefix_cache_bytes": None}) == ""
  note = serving_load.warm_note("http://h:1", {"kda_prefix_cache_bytes": 4096.0, "kda_cached_prompt_tokens_total": 64.0})
  assert note.startswith("note: the server at http://h:1 is already warm") and "4096 bytes" in note
  assert "\n" not in note


@pytest.mark.parametrize("argv, mode, present, absent", [
    (["--url", "http://h:1", "--workloads", "shared_prefix"], "url", {"url": "http://h:1", "prefix_len": 512,
                                                                      "client": "raw"},
     {"max_num_seqs", "max_num_batched_tokens", "prefix_cache_bytes", "engines", "rounds", "serve_arg",
      "start_timeout", "in_process", "prompt_min", "prompt_max"}),
    (["--workloads", "mixed", "--engines", "static", "--concurrency", "4"], "servers",
     {"engines": ["static"], "max_num_seqs": 32, "max_num_batched_tokens": 2048, "prompt_max": 1024,
      "warmup": 4, "concurrency": 4, "rounds": 1, "start_timeout": 1200.0, "serve_arg": []},
     {"url", "prefix_cache_bytes", "prefix_len", "suffix_min", "in_process"}),
    (["--in-process", "--workloads", "mixed,shared_prefix"], "in_process",
     {"engines": ["continuous", "static"], "prefix_cache_bytes": 1 << 30, "suffix_max": 128, "warmup": 32,
      "workloads": ["mixed", "shared_prefix"], "max_num_partial_prefills": 4},   # the engine's default, resolved
     {"url", "client", "serve_arg", "start_timeout"}),
])
def test_the_json_records_typed_args_of_its_mode_only(argv, mode, present, absent):
  args = serving_load._parser().parse_args(argv)
  kinds = serving_load._split(args.workloads)
  engines = serving_load._split(args.engines) if "mixed" in kinds and not args.url else []
  rec = serving_load.recorded_args(args, kinds, engines, max_len=1300)
  assert rec["mode"] == mode
  for key, value in present.items():
    assert rec[key] == value and type(rec[key]) is type(value), (key, rec.get(key))
  assert not absent & set(rec), absent & set(rec)
  assert isinstance(rec["num_requests"], int) and isinstance(rec["checkpoint"], str)
  if mode != "url":
    assert rec["max_model_len"] == 1300


# --- the online mode against a fake server (no model): failures, JSON values, --help -------------------------

import asyncio
import http.server
import json
import math
import pathlib
import subprocess
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[2]


class _FakeServer(http.server.ThreadingHTTPServer):
  """Just what the benchmark reads of tools.serve: /v1/models, /metrics, and /v1/completions streamed,
  one token per SSE event, with the usage at the end; with `refuse`, a request that comes while another
  streams is answered 503 (as tools.serve does when max_waiting requests wait), and the streams are slow
  (the refused request's client still has others in flight)."""

  daemon_threads = True

  def __init__(self, refuse: bool):
    self.refuse = refuse
    self.streaming = 0
    self.lock = threading.Lock()
    super().__init__(("127.0.0.1", 0), _Handler)
    self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
  def log_message(self, *args):
    pass

  def _send(self, code, body: bytes, kind="application/json"):
    self.send_response(code)
    self.send_header("Content-Type", kind)
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)

  def do_GET(self):
    if self.path == "/v1/models":
      self._send(200, json.dumps({"data": [{"id": "demo", "max_model_len": 100000}]}).encode())
    elif self.path == "/metrics":
      self._send(200, b"kda_num_requests_running 0\nkda_prefix_cache_bytes 0\n", "text/plain")
    else:
      self._send(404, b"{}")

  def do_POST(self):
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    server = self.server
    with server.lock:
      busy = server.refuse and server.streaming > 0
      server.streaming += not busy
    if busy:
      self._send(503, json.dumps({"error": {"message": "too many requests waiting (max_waiting=1)"}}).encode())
      return
    try:
      self.send_response(200)
      self.send_header("Content-Type", "text/event-stream")
      self.end_headers()
      n = body["max_tokens"]
      for i in range(n):
        self.wfile.write(b"data: " + json.dumps({"choices": [{"token_ids": [5 + i]}]}).encode() + b"\n\n")
        self.wfile.flush()
        if server.refuse:
          time.sleep(0.2)
      usage = {"completion_tokens": n, "prompt_tokens_details": {"cached_tokens": 0}}
      self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
    except OSError:   # the client went away (it stops at the first refusal)
      pass
    finally:
      with server.lock:
        server.streaming -= 1
      self.close_connection = True


@pytest.fixture
def fake_server(request):
  server = _FakeServer(refuse=request.param)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield server
  server.shutdown()
  server.server_close()


def _benchmark(*flags):
  return subprocess.run([sys.executable, "tools/bench/benchmark_serving.py", "--online", *flags], capture_output=True,
                        text=True, cwd=REPO, timeout=120)


@pytest.mark.parametrize("fake_server", [True], indirect=True)
def test_a_503_during_the_run_is_one_error_line_and_nothing_written(fake_server, tmp_path):
  out = tmp_path / "out.json"
  r = _benchmark("--url", fake_server.url, "--workloads", "mixed", "--num-requests", "8", "--concurrency", "4",
                 "--prompt-max", "32", "--output-min", "2", "--output-max", "8", "--json", str(out))
  assert r.returncode == 1, r.stderr
  assert "Traceback" not in r.stderr and "never retrieved" not in r.stderr, r.stderr
  assert r.stderr.splitlines() == [r.stderr.strip()] and r.stderr.startswith("error: the server answered 503"), r.stderr
  assert "max_waiting" in r.stderr
  assert not out.exists() and not out.with_suffix(".tmp").exists()
  assert list(tmp_path.iterdir()) == []   # the writability probe left nothing either


@pytest.mark.parametrize("fake_server", [False], indirect=True)
def test_a_figure_without_requests_is_null_in_strict_json(fake_server, tmp_path):
  """No request draws a suffix of a block or more: its TTFT p50 is null (was NaN, which is not JSON)."""
  out = tmp_path / "out.json"
  r = _benchmark("--url", fake_server.url, "--workloads", "shared_prefix", "--num-requests", "6", "--concurrency",
                 "3", "--prefix-len", "64", "--suffix-min", "1", "--suffix-max", "8", "--output-min", "2",
                 "--output-max", "4", "--json", str(out))
  assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr

  def no_constants(name):
    raise AssertionError(f"{name} in the JSON")

  data = json.loads(out.read_text(), parse_constant=no_constants)
  row = data["rows"][0]
  assert row["requests"] == 6 and row["requests_suffix_under_block"] == 6
  assert row["ttft_p50_suffix_block_or_more_s"] is None and row["ttft_p50_suffix_under_block_s"] > 0


def test_empty_figures_are_none_and_every_report_copes():
  assert serving_load._pct([], 50) is None and serving_load._pct([1.0, 3.0], 50) == 2.0
  one_token = [{"prompt_tokens": 520, "output_tokens": 1, "cached_tokens": 512, "ttft_s": 0.02, "tpot_s": None}]
  row = serving_load.summarize(one_token, 1.0, prefix_len=512)
  assert row["tpot_p50_s"] is None and row["tpot_p99_s"] is None and row["ttft_p50_suffix_block_or_more_s"] is None
  on = {"workload": "shared_prefix", **serving_load.median_row([{**row, "config": "cache on"}] * 2)}
  off = {"workload": "shared_prefix", **serving_load.median_row([{**row, "config": "cache off"}] * 2)}
  assert on["tpot_p50_s"] is None and on["ttft_p50_s"] == 0.02
  assert "| - | - |" in serving_load.table([on, off])
  text = serving_load.prefix_cache_ratio([on, off])
  assert "1.00x" in text and "or more (a snapshot at their last full block) - s" in text
  json.dumps([on, off], allow_nan=False)   # no NaN anywhere
  assert not any(isinstance(v, float) and math.isnan(v) for v in row.values())


def test_the_first_failed_request_cancels_the_others():
  cancelled = []

  async def fails():
    await asyncio.sleep(0.01)
    raise serving_load.RequestFailed("the server answered 503: full")

  async def slow():
    try:
      await asyncio.sleep(60)
    except asyncio.CancelledError:
      cancelled.append(True)
      raise

  async def run():
    return await serving_load._all_or_first_failure([slow(), fails(), fails(), slow()])

  with pytest.raises(serving_load.RequestFailed, match="503"):
    asyncio.run(asyncio.wait_for(run(), 10))
  assert cancelled == [True, True]

  async def fine():
    return await serving_load._all_or_first_failure([asyncio.sleep(0, result=i) for i in range(3)])

  assert asyncio.run(fine()) == [0, 1, 2]


def test_online_help_shows_the_defaults():
  text = serving_load._parser().format_help()
  for flag, default in (("--output-min", 16), ("--num-requests", 64), ("--concurrency", 32), ("--seed", 0),
                        ("--max-num-batched-tokens", 2048), ("--client", "raw")):
    entry = text.split(f"  {flag} ", 1)[1].split("\n  --", 1)[0]
    assert f"default: {default}" in " ".join(entry.split()) or f"{default} (default)" in entry, (flag, entry)


def test_given_server_flags_are_refused_with_url_but_defaults_pass(capsys):
  parser = serving_load._parser()
  args = parser.parse_args(["--url", "http://127.0.0.1:1", "--max-num-seqs", "32"])   # the default: not refused
  with pytest.raises(SystemExit) as e:
    serving_load.check_args(parser, args)
  assert e.value.code == 2 and "--url" in capsys.readouterr().err   # got as far as the --url probe


def test_each_configuration_is_written_as_it_ends(tmp_path, monkeypatch):
  """--in-process: the JSON is rewritten after every configuration ("partial": true), so a run stopped by
  an outer time limit (the device check's) keeps what it measured; the last write says partial false."""
  (tmp_path / "ckpt").mkdir()
  (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"vocab_size": 64}))
  out = tmp_path / "out.json"
  seen = []

  def fake_replay(args, label, keys, requests, warmup, max_len, prefix_len=None):
    if seen:   # the second configuration finds the first one's row on disk
      data = json.loads(out.read_text())
      assert data["partial"] is True and [r["config"] for r in data["rows"]] == [seen[0]]
    seen.append(label)
    return {**_run(0.1 * len(seen)), "config": label}

  monkeypatch.setattr(serving_load, "replay", fake_replay)
  argv = ["--in-process", "--checkpoint", str(tmp_path / "ckpt"), "--engines", "continuous,static",
          "--workloads", "mixed", "--num-requests", "4", "--concurrency", "2", "--prompt-max", "16",
          "--output-min", "2", "--output-max", "4", "--rounds", "1", "--json", str(out)]
  assert serving_load.main(argv) == 0
  data = json.loads(out.read_text())
  assert data["partial"] is False and [r["config"] for r in data["rows"]] == seen == ["engine=continuous", "engine=static"]


def test_partial_prefills_reach_the_continuous_engines_only(tmp_path, monkeypatch):
  """--max-num-partial-prefills: every continuous configuration's engine keys carry it (prefix cache on and
  off alike), the static engine's never (it prefills whole groups and refuses the key); the JSON records it."""
  (tmp_path / "ckpt").mkdir()
  (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"vocab_size": 64}))
  out, keys_of = tmp_path / "out.json", {}

  def fake_replay(args, label, keys, requests, warmup, max_len, prefix_len=None):
    keys_of[label] = keys
    return {**_run(0.1), "config": label}

  monkeypatch.setattr(serving_load, "replay", fake_replay)
  argv = ["--in-process", "--checkpoint", str(tmp_path / "ckpt"), "--engines", "continuous,static",
          "--workloads", "mixed,shared_prefix", "--num-requests", "4", "--concurrency", "2", "--prompt-max", "16",
          "--prefix-len", "64", "--suffix-max", "16", "--output-min", "2", "--output-max", "4",
          "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-num-partial-prefills", "8", "--json", str(out)]
  assert serving_load.main(argv) == 0
  assert set(keys_of) == {"engine=continuous", "engine=static", "engine=continuous, prefix cache on",
                          "engine=continuous, prefix cache off"}
  for label, keys in keys_of.items():
    assert ("max_num_partial_prefills=8" in keys) == (label != "engine=static"), (label, keys)
  assert json.loads(out.read_text())["args"]["max_num_partial_prefills"] == 8


@pytest.mark.parametrize("argv, message", [
    (["--max-num-partial-prefills", "-1"], "--max-num-partial-prefills must be an integer in [0, --max-num-seqs=32]"),
    (["--max-num-partial-prefills", "33"], "--max-num-partial-prefills must be an integer in [0, --max-num-seqs=32]"),
    (["--max-num-partial-prefills", "2", "--workloads", "mixed", "--engines", "static"],
     "--max-num-partial-prefills sizes the continuous engine, and this run starts none"),
    (["--max-num-partial-prefills", "2", "--url", "http://127.0.0.1:1"],
     "--max-num-partial-prefills configures the servers this tool starts"),
])
def test_bad_partial_prefills_are_refused_by_name(tmp_path, capsys, argv, message):
  (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 64}))
  with pytest.raises(SystemExit) as e:
    serving_load.main(["--checkpoint", str(tmp_path), *argv])
  assert e.value.code == 2 and message in capsys.readouterr().err


def test_in_process_replay_times_each_token_when_it_is_emitted():
  """The static engine emits a group's tokens chunk by chunk inside one `step`: each token is timed
  when emitted, so TPOT is the gap between chunks (was 0: every token took the step's end time)."""
  from model.engine.api import TokenEvent

  class ChunkedEngine:   # one step runs the request to its end, emitting two chunks 50 ms apart
    def __init__(self):
      self.requests = []

    def add_request(self, request):
      self.requests.append(request)

    def has_unfinished(self):
      return bool(self.requests)

    def step(self, emit):
      r = self.requests.pop()
      for chunk in range(2):
        if chunk:
          time.sleep(0.05)
        emit(TokenEvent(r.request_id, 5, None, None, 0))
        emit(TokenEvent(r.request_id, 6, None, "length" if chunk else None, 0))

  rep = object.__new__(serving_load._Replay)
  rep.engine, rep._n = ChunkedEngine(), 0
  done, _ = rep.run([([3, 4], 4)], 1)
  assert len(done) == 1 and done[0]["output_tokens"] == 4
  assert done[0]["tpot_s"] >= 0.05 / 3 * 0.9   # (last - first) / (4 - 1), the 50 ms between the chunks


def test_the_replay_sums_the_continuous_engine_s_steps():
  """The in-process replay keeps each executed step's `StepTiming` (a step without a plan is left out)
  and the row sums them: stages in seconds, counts, the steps with prompt chunks apart from decode-only
  ones, and the arrival wave step by step in ms."""
  from model.engine.api import TokenEvent
  from model.engine.continuous import StepTiming

  plan = [StepTiming(0.002, 0.050, 0.001, 0.004, prompts=8, restores=8, saves=3, executed=True),
          StepTiming(0.001, 0.030, 0.001, 0.0, prompts=2, decodes=8, executed=True),
          StepTiming(0.0005, 0.0, 0.0, 0.0),   # nothing to run: not counted
          StepTiming(0.0, 0.010, 0.001, 0.0, decodes=10, executed=True)]

  class TimedEngine:   # one request, one token a step, the next planned timing each step
    def __init__(self):
      self.left, self.last_step_timing = list(plan), None

    def add_request(self, request):
      self.rid = request.request_id

    def has_unfinished(self):
      return bool(self.left)

    def step(self, emit):
      self.last_step_timing = self.left.pop(0)
      emit(TokenEvent(self.rid, 5, None, None if self.left else "length", 0))

  rep = object.__new__(serving_load._Replay)
  rep.engine, rep._n = TimedEngine(), 0
  rep.run([([3, 4], 4)], 1)
  s = serving_load.step_summary(rep.steps)
  assert s["steps"] == 3 and (s["prompts"], s["decodes"], s["restores"], s["saves"]) == (10, 18, 8, 3)
  assert s["admit_s"] == pytest.approx(0.003) and s["execute_s"] == pytest.approx(0.09)
  assert s["with_prompts"] == {"steps": 2, "s": pytest.approx(0.089)}
  assert s["decode_only"] == {"steps": 1, "s": pytest.approx(0.011)}
  assert s["step_ms_p50"] == pytest.approx(32.0)
  assert s["first_steps"][0] == {"admit_ms": 2.0, "execute_ms": 50.0, "events_ms": 1.0, "saves_ms": 4.0,
                                 "prompts": 8, "decodes": 0, "restores": 8, "saves": 3}
