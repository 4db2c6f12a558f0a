"""tools/bench/kernel_device_time.py and tools/bench/tpu_device_check.sh on a CPU, at small shapes
(`--smoke`, `SMOKE=1`): the phases, the JSON and the budget logic that the chip run relies on. The
figures themselves mean nothing here; the chip's are in docs/performance.md."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tools.bench import kernel_device_time as kdt

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_smoke_run_writes_every_phase_and_case(tmp_path):
  out = tmp_path / "t.json"
  rc = kdt.main(["--smoke", "--implementation", "xla", "--cases", "one_8_token_doc_h24", "decode_h24_b32",
                 "--repeats", "5", "--loop-ms", "2", "--compile-workers", "2", "--json", str(out)])
  assert rc == 0
  r = json.loads(out.read_text())
  assert set(r["phases_s"]) == {"build", "compile", "time"} and r["smoke"] and r["implementation"] == "xla"
  assert [c["name"] for c in r["cases"]] == ["one_8_token_doc_h24", "decode_h24_b32"]
  for c in r["cases"]:
    assert c["repeats"] == 5 and c["min_ms"] <= c["median_ms"] <= c["max_ms"], c
    assert c["compile_s"] >= 0 and c["iters_per_loop"] >= 8 and c["floor_ms"] > 0
    assert c["target_ms"] is None and c["meets_target"] is None  # smoke shapes have no targets
  assert r["cases"][0]["seq_len"] == 8 and r["cases"][0]["heads"] == 8 and r["cases"][1]["batch"] == 4


def test_budget_skips_cases_and_fails(tmp_path):
  """A case that would start past --budget-s is recorded as skipped (the run exits 1), not lost."""
  out = tmp_path / "t.json"
  rc = kdt.main(["--smoke", "--cases", "decode_h24_b32", "--budget-s", "0", "--json", str(out)])
  assert rc == 1
  (case,) = json.loads(out.read_text())["cases"]
  assert case["skipped"].startswith("not timed: past --budget-s") and "median_ms" not in case


@pytest.mark.parametrize("argv,msg", [(["--cases", "nope"], "unknown"), (["--repeats", "0"], "repeats"),
                                      (["--implementation", "cuda"], "implementation")])
def test_bad_arguments_exit_2(argv, msg, capsys):
  with pytest.raises(SystemExit) as e:
    kdt.main(argv)
  assert e.value.code == 2 and msg in capsys.readouterr().err


@pytest.mark.slow
def test_device_check_script_smoke(tmp_path):
  """The one-command check end to end with SMOKE=1: every phase passes and reports its budget."""
  env = dict(os.environ, SMOKE="1", PY=sys.executable, OUT=str(tmp_path))
  r = subprocess.run(["bash", str(ROOT / "tools/bench/tpu_device_check.sh")], env=env, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  rep = json.loads((tmp_path / "tpu_device_check.json").read_text())
  assert rep["smoke"] and all(s["rc"] == 0 for s in rep["steps"].values())
  assert {k: s["budget_s"] for k, s in rep["steps"].items()} == {"install": 85, "numerics": 330, "bench": 160}
  assert rep["budget_total_s"] <= 600 - 20 and rep["numerics"].endswith("deselected")   # one device command
  bench = json.loads((tmp_path / "kernel_device_time.json").read_text())
  assert [c["name"] for c in bench["cases"]] == ["seed_bf16", "decode_h24_b32"]
  assert all("median_ms" in c for c in bench["cases"])


def test_the_softplus_gate_and_the_train_step_shape_cases(tmp_path):
  """Kimi-Linear's gate (kda_gate_lower_bound None) is its own case: every other prefill case but the train
  step's passes the bounded gate, whose kernel path is much cheaper, so the model's own path must be timed
  too. The 0.4B step's shape three times with Kimi's gate: kda_inference with shared and per-row labels,
  and kda_chunked's forward (the training op's kernel with the chunk states written), whose bytes count
  the states."""
  out = tmp_path / "t.json"
  # one smoke run (a compile each): the bounded seed, then Kimi's gate with per-row labels, through
  # kda_inference and through the training op's forward
  names = ["seed_bf16", "b8_t2048_h8_4docs_softplus_rows", "b8_t2048_h8_4docs_train_fwd"]
  rc = kdt.main(["--smoke", "--implementation", "xla", "--cases", *names,
                 "--repeats", "2", "--loop-ms", "1", "--compile-workers", "1", "--json", str(out)])
  assert rc == 0
  cases = json.loads(out.read_text())["cases"]
  assert [c["gate"] for c in cases] == [f"bounded ({kdt.LOWER_BOUND})"] + ["softplus (no lower bound)"] * 2
  assert [c["op"] for c in cases] == ["kda_inference", "kda_inference", "kda_chunked forward (chunk states written)"]
  assert [c["labels"] for c in cases] == ["[T], shared", "[B, T]", "[B, T]"]
  assert all(c["batch"] == 2 and "median_ms" in c for c in cases[1:])
  # the other softplus cases take the same path as the run's (their gate and labels by name)
  assert {"seed_bf16_softplus_gate", "b8_t2048_h8_4docs_softplus"} <= kdt.SOFTPLUS_GATE
  assert "b8_t2048_h8_4docs_softplus" not in kdt.PER_ROW_LABELS | kdt.TRAIN_FORWARD
  small = (2, 192, 2, "bfloat16", "lane_dense", [192])
  _, _, _, hbm_states, _ = kdt.prefill_case(*small, kd=16, vd=16, train_forward=True)
  _, _, _, hbm_final, _ = kdt.prefill_case(*small, kd=16, vd=16)
  # 3 chunks' float32 states of every row and head instead of one final state a row and head
  assert hbm_states - hbm_final == (3 - 1) * 2 * 2 * 16 * 16 * 4


@pytest.mark.parametrize("argv, msg", [
    (["--json", "/nonexistent-dir/x.json"], "--json='/nonexistent-dir/x.json': directory '/nonexistent-dir' does not exist"),
    (["--loop-ms", "0"], "--loop-ms must be a finite number > 0"),
    (["--loop-ms", "nan"], "--loop-ms must be a finite number > 0, got nan"),   # timed normally before
    (["--budget-s", "-1"], "--budget-s must be a finite number >= 0"),
    (["--budget-s", "inf"], "--budget-s must be a finite number >= 0, got inf"),
    (["--cases"], "expected at least one argument"),
])
def test_bad_arguments_fail_before_any_work(argv, msg, capsys):
  """A bad --json path used to crash with a traceback after every case had compiled."""
  with pytest.raises(SystemExit) as e:
    kdt.main(["--smoke", *argv])
  assert e.value.code == 2 and msg in capsys.readouterr().err


def test_kda_layer_split_times_every_piece_and_says_which_gate(tmp_path):
  """tools/bench/kda_layer_split.py on the CPU at a small row: every piece timed, the JSON names the gate
  and the implementation it measured (the chip's figures depend on both)."""
  from tools.bench import kda_layer_split  # noqa: PLC0415
  out = tmp_path / "split.json"
  assert kda_layer_split.main(["--seq-len", "64", "--repeats", "1", "--config", "tiny", "--json", str(out)]) == 0
  r = json.loads(out.read_text())
  assert len(r["pieces"]) == 7 and all(p["min_ms"] <= p["median_ms"] <= p["max_ms"] for p in r["pieces"].values())
  assert r["gate"].startswith(("softplus", "bounded")) and r["backend"] == "cpu" and r["commit"]


@pytest.mark.parametrize("argv, msg", [
    (["--json", "/nonexistent-dir/x.json"], "directory '/nonexistent-dir' does not exist"),
    (["--config", "nope"], "--config: unknown model config 'nope'"),
    (["--seq-len", "10"], "--seq-len must be >= 64, got 10"),
])
def test_kda_layer_split_refuses_bad_arguments_in_one_line(argv, msg, capsys):
  from tools.bench import kda_layer_split  # noqa: PLC0415
  with pytest.raises(SystemExit) as e:
    kda_layer_split.main(argv)
  assert e.value.code == 2 and msg in capsys.readouterr().err
