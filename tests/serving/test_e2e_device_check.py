"""tools/bench/e2e_device_check.sh on the CPU: its logic (phases, budgets, skips, the JSON) checked where CI
runs, in its smoke mode (tiny model and shapes, the checkout on PYTHONPATH instead of an install)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "bench" / "e2e_device_check.sh"


def _run(tmp_path, phases: str, extra_env=None, timeout=1800):
  env = dict(os.environ, OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"), CACHE_DIR=str(tmp_path / "jax"),
             E2E_SMOKE="1", SKIP_INSTALL="1", PY=sys.executable, JAX_PLATFORMS="cpu", E2E_PHASES=phases,
             KDA_COMMIT="testcommit", **(extra_env or {}))
  proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=timeout)
  report = json.loads((tmp_path / "out" / "e2e_device_check.json").read_text())
  return proc, report


def test_a_phase_whose_package_is_missing_is_skipped_by_name(tmp_path):
  """fastapi made unimportable: the server phase says so and nothing fails; the JSON still comes."""
  fake = tmp_path / "fake"
  fake.mkdir()
  (fake / "fastapi.py").write_text("raise ImportError('fastapi is not installed here (test)')\n")
  proc, report = _run(tmp_path, "server",
                      {"PYTHONPATH": f"{fake}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep)})
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert report["phases"]["server"]["status"] == "skipped: fastapi missing"
  assert report["imports"]["fastapi"].startswith("ImportError")
  assert report["commit"] == "testcommit" and report["smoke"] is True
  assert report["total_budget_s"] >= report["total_s"]
  assert sorted(os.listdir(tmp_path / "out")) == ["e2e_device_check.json", "e2e_logs.txt"]


@pytest.mark.slow
def test_every_phase_runs_in_smoke_mode(tmp_path):
  """The whole check in smoke mode (5 to 10 minutes on the shared 2-core host: `slow`): every phase
  ok, batched greedy tokens identical to alone (f32), the server answers the openai client's stream
  over the unix socket and starts warm (every executable loaded from the run's persistent cache)."""
  proc, report = _run(tmp_path, "model ckpt serving identity server real")
  phases = report["phases"]
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  for name in ("model", "ckpt", "serving", "identity", "server"):
    assert phases[name]["status"] == "ok", (name, phases[name])
    assert phases[name]["budget_s"] > 0
  assert phases["real"]["status"] == "skipped: E2E_REAL is not 1"
  model = phases["model"]["result"]
  assert model["decode"]["B=2"]["step_ms"] > 0 and model["decode"]["B=2"]["hbm_floor_ms"] > 0
  split = model["decode"]["split"]
  pieces = {k: v for k, v in split.items() if isinstance(v, dict)}
  assert set(pieces) == {"kda", "mla", "moe", "dense_ffn", "lm_head"}, split
  assert split["sum_ms"] == pytest.approx(sum(v["ms"] * v["layers"] for v in pieces.values()), abs=5e-3)
  assert [pieces[k]["layers"] for k in ("kda", "mla", "moe", "dense_ffn", "lm_head")] == [2, 2, 3, 1, 1]
  one = model["prefill"]["one_prompt"]
  assert one["tokens_per_s"] > 0 and one["flops_per_token"] > 0
  assert abs(one["mfu"] - one["flops_per_token"] * one["tokens_per_s"] / 197e12) < 1e-4   # ~0 on a tiny model
  assert model["prefill"]["long_prompt"]["tokens"] == 256 and model["prefill"]["long_prompt"]["ttft_ms"] > 0
  head = report["headline"]
  assert head["identity_f32_b32"] is True
  assert head["server_over_uds"] is True
  assert head["continuous_over_static_output_tok_s"] > 0 and head["prefix_cache_ttft_p50_off_over_on"] > 0
  server = phases["server"]["result"]
  assert server["compile_detail"].startswith("0 compiled"), server
  assert server["socket_removed"] and server["exit_status"] == 0


@pytest.mark.parametrize("phases, message", [
    ("model modle", "error: E2E_PHASES: unknown phase 'modle' (expected some of: model ckpt serving identity server real)"),
    (" ", "error: E2E_PHASES=' ': expected some of: model ckpt serving identity server real"),
])
def test_bad_phases_are_refused_before_anything_is_touched(tmp_path, phases, message):
  """A typo exits 2 with one line, before the script creates or clears anything: the last run's logs
  and figures stay (before, the log was emptied first), and an empty list is not a successful run."""
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "e2e_logs.txt").write_text("the last run's log\n")
  env = dict(os.environ, OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"), E2E_SMOKE="1", SKIP_INSTALL="1",
             PY=sys.executable, E2E_PHASES=phases)
  proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert proc.stderr.strip().splitlines() == [message]
  assert (tmp_path / "out" / "e2e_logs.txt").read_text() == "the last run's log\n"
  assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("env, message", [
    ({"E2E_SMOKE": "yes"}, "error: E2E_SMOKE='yes': expected 0 or 1 (empty: the default)"),
    ({"SKIP_INSTALL": "true"}, "error: SKIP_INSTALL='true': expected 0 or 1 (empty: the default)"),
    ({"SKIP_INSTALL": "01"}, "error: SKIP_INSTALL='01': expected 0 or 1 (empty: the default)"),
    ({"E2E_LONG_PROMPT": "32k"}, "error: E2E_LONG_PROMPT='32k': expected a whole number of tokens (0 = none)"),
])
def test_switches_other_than_0_or_1_are_refused_by_name(tmp_path, env, message):
  """E2E_SMOKE=yes used to run the full (TPU) check and SKIP_INSTALL=true an install: only 0, 1 or empty
  pass; anything else exits 2 with one line naming the variable, before anything is created or cleared."""
  _assert_refused(tmp_path, env, message)


def _assert_refused(tmp_path, env, message):
  """The smoke check run with `env` over its defaults exits 2 with the one line `message` on stderr,
  leaving the last run's log in place and creating no work directory."""
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "e2e_logs.txt").write_text("the last run's log\n")
  full = dict(os.environ, OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"), E2E_SMOKE="1", SKIP_INSTALL="1",
              PY=sys.executable, E2E_PHASES="model")
  proc = subprocess.run(["bash", str(SCRIPT)], env={**full, **env}, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert proc.stderr.strip().splitlines() == [message]
  assert (tmp_path / "out" / "e2e_logs.txt").read_text() == "the last run's log\n"
  assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("env, message", [
    ({"E2E_BUDGET_model": "400s"}, "error: E2E_BUDGET_model='400s': expected whole seconds from 1 to 1500 (the whole "
                                   "check's time)"),
    ({"E2E_BUDGET_model": "0"}, "error: E2E_BUDGET_model='0': expected whole seconds from 1 to 1500 (the whole check's time)"),
    ({"E2E_BUDGET_model": ""}, "error: E2E_BUDGET_model='': expected whole seconds from 1 to 1500 (the whole check's time)"),
    # the model phase stops its decode batches 45 s before its budget: 30 s left it a negative time
    ({"E2E_BUDGET_model": "30"}, "error: E2E_BUDGET_model=30: the model phase needs at least 60 s (its decode batches "
                                 "stop 45 s before its budget)"),
    ({"PY": "/bin/false"}, "error: PY='/bin/false': not a Python with jax (); set PY to the machine's Python with JAX"),
    ({"E2E_SERVER_KEYS": "max_num_seqs=4 max_model_len"},
     "error: E2E_SERVER_KEYS: 'max_model_len' is not key=value (e.g. max_num_seqs=4)"),
    ({"E2E_SERVER_KEYS": "max_num_seqs=*"}, "error: E2E_SERVER_KEYS: 'max_num_seqs=*' is not key=value (e.g. max_num_seqs=4)"),
    ({"E2E_SERVER_KEYS": " "}, "error: E2E_SERVER_KEYS=' ': expected key=value words (e.g. max_num_seqs=4); unset it for "
                               "the serving phase's sizes"),
    ({"E2E_PARTIAL_PREFILLS": "0"}, "error: E2E_PARTIAL_PREFILLS='0': expected a whole number from 1 to the "
                                    "serving phase's max_num_seqs (8) (prompts a continuous step takes; unset: "
                                    "the engine's default)"),
    ({"E2E_PARTIAL_PREFILLS": "8x"}, "error: E2E_PARTIAL_PREFILLS='8x': expected a whole number from 1 to the "
                                    "serving phase's max_num_seqs (8) (prompts a continuous step takes; unset: "
                                    "the engine's default)"),
    ({"E2E_PARTIAL_PREFILLS": "9"}, "error: E2E_PARTIAL_PREFILLS='9': expected a whole number from 1 to the "
                                    "serving phase's max_num_seqs (8) (prompts a continuous step takes; unset: "
                                    "the engine's default)"),
    ({"E2E_BUDGET_modle": "400"}, "error: E2E_BUDGET_modle: unknown phase 'modle' (expected E2E_BUDGET_<phase> with "
                                  "a phase of: install model ckpt serving identity server real)"),
])
def test_bad_phase_budgets_are_refused_by_name(tmp_path, env, message):
  """E2E_BUDGET_<phase> (shared with the train check, tools/bench/device_budgets.sh): a budget that is not
  whole seconds, or one whose phase is misspelt (it would be silently ignored), exits 2 with one line
  before anything is created or cleared."""
  _assert_refused(tmp_path, env, message)


def test_a_signal_to_the_check_stops_its_running_phase(tmp_path):
  """tools/bench/device_phases.sh: `timeout` puts a phase in a process group of its own, so a SIGTERM or
  Ctrl-C sent to the check used to leave the phase running (on the chip, holding the device). Now the
  check passes the signal on, waits for the phase and exits 130."""
  pid_file = tmp_path / "phase.pid"
  script = tmp_path / "check.sh"
  script.write_text(f"""OUT={tmp_path}/out; WORK={tmp_path}/work; LOGS={tmp_path}/out/logs; TOTAL_BUDGET=100
mkdir -p "$OUT" "$WORK"
declare -A BUDGET=([slow]=60)
. {REPO}/tools/bench/device_phases.sh
run_phase slow bash -c 'echo $$ > {pid_file}; exec sleep 50'
echo "not reached"
""")
  proc = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 20
  while not pid_file.exists() or not pid_file.read_text().strip():
    assert time.monotonic() < deadline, "the phase never started"
    time.sleep(0.05)
  phase = int(pid_file.read_text())
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=20)
  assert proc.returncode == 130, (out, err)
  assert "not reached" not in out and "interrupted: the running phase was stopped" in err
  with pytest.raises(ProcessLookupError):
    os.kill(phase, 0)


@pytest.mark.parametrize("flags, message", [
    (["--long-prompt", "-5"], "--long-prompt must be >= 0, got -5"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--decode-steps", "-1"], "--decode-steps must be >= 0, got -1"),
])
def test_phase_flags_out_of_range_are_refused_by_name(tmp_path, capsys, flags, message):
  from tools.bench import e2e_device
  out = tmp_path / "m.json"
  with pytest.raises(SystemExit) as exit_:
    e2e_device.main(["model", "--smoke", *flags, "--json", str(out)])
  assert exit_.value.code == 2 and message in capsys.readouterr().err
  assert not out.exists()
