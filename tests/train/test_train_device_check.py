"""tools/bench/train_device_check.sh on the CPU: its logic (phases, budgets, the JSON, the kill and resume of
kda-train) checked where CI runs, in its smoke mode (tiny models and shapes, the checkout on PYTHONPATH
instead of an install); and the driver's batch and FLOP formulas against hand counts."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from model.config import load_config
from tools.bench import train_device

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "bench" / "train_device_check.sh"


def test_packed_batch_frames_documents_and_masks_their_last_token():
  cfg = load_config(["tiny", "max_num_segments=4"])
  fields, lengths = train_device.packed_batch(cfg, 3, 100, seed=0)
  seg, ids, tgt, mask = fields["segment_ids"], fields["inputs"], fields["targets"], fields["loss_mask"]
  assert sum(lengths) == (seg > 0).sum() and seg.max() <= 4
  for b in range(3):
    for t in range(100):
      same_next = t + 1 < 100 and seg[b, t] > 0 and seg[b, t + 1] == seg[b, t]
      assert mask[b, t] == same_next, (b, t)
      if same_next:
        assert tgt[b, t] == ids[b, t + 1]


def test_attention_flops_by_hand():
  cfg = load_config(["tiny"])
  docs = [3, 5]
  got = train_device.attention_flops(cfg, docs)
  n_mla = len(cfg.full_attn_layers)
  n_kda = cfg.num_hidden_layers - n_mla
  pairs = 3 * 4 / 2 + 5 * 6 / 2   # causal (query, key) pairs: 6 + 15
  dims = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
  assert got["document_pairs"] == pairs == 21
  assert got["mla_causal"] == 3 * n_mla * 2 * cfg.num_attention_heads * dims * 21
  c, k = 64, cfg.kda_head_dim
  per = 6 * c * k + 4 * c * k + 6 * k * k + 2 * c * c / 3
  assert math.isclose(got["kda_chunk_estimate"], 3 * n_kda * cfg.kda_num_heads * 8 * per)
  # K = V = 128, C = 64: 182,955 FLOPs per token and head (the docstring's figure for the H=32 op)
  assert round(train_device.kda_chunk_flops_per_token_head(128, 128)) == 182955


@pytest.mark.slow
def test_the_whole_check_runs_in_smoke_mode(tmp_path):
  """Every phase on the CPU (about 4 to 8 minutes on the shared 2-core host: `slow`): the step is timed
  and its MFU is the formula's; the split has every piece and the KDA op; kda-train's loss falls on real
  text, the SIGTERMed run resumes to the uninterrupted run's losses exactly, and its checkpoints read back."""
  env = dict(os.environ, OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"), CACHE_DIR=str(tmp_path / "jax"),
             TRAIN_SMOKE="1", SKIP_INSTALL="1", PY=sys.executable, JAX_PLATFORMS="cpu", KDA_COMMIT="testcommit")
  shakespeare = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"   # the developer's and CI's data folder
  if shakespeare.is_file():
    env["TRAIN_CORPUS"] = str(shakespeare)
  proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=1800)
  path = tmp_path / "out" / "train_device_check.json"
  assert path.is_file(), proc.stdout[-4000:] + proc.stderr[-4000:]
  report = json.loads(path.read_text())
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  assert sorted(os.listdir(tmp_path / "out")) == ["train_device_check.json", "train_device_logs.txt"]
  assert report["commit"] == "testcommit" and report["smoke"] is True
  assert report["total_budget_s"] >= report["total_s"]
  phases = report["phases"]
  for name in ("step", "loss", "split", "profile"):
    assert phases[name]["status"] == "ok", (name, phases[name])

  step = phases["step"]["result"]
  assert step["batch_size"] == 4 and "fallback" not in step    # both candidates fit on the host
  assert set(step["batch_candidates"]) == {"4", "2"} and all(c["fits"] for c in step["batch_candidates"].values())
  timed = step["timed"]
  assert timed["tokens_per_step"] == 4 * 64
  assert timed["step"]["min_ms"] <= timed["step"]["median_ms"] <= timed["step"]["max_ms"]
  assert timed["tokens_per_s"] == pytest.approx(256 / (timed["step"]["median_ms"] / 1e3), rel=1e-3)
  flops = timed["flops_per_step"]
  assert flops["model_6N"] == 6 * step["parameters"]["active_matmul"] * 256
  assert timed["mfu_6N"] == pytest.approx(flops["model_6N"] * timed["tokens_per_s"] / 256 / 197e12, abs=1e-4)
  mem = step["batch_candidates"]["4"]["memory_analysis"]
  assert mem["total_bytes"] == mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"] + mem["temp_bytes"]
  assert step["compile"]["wall_s"] > 0
  # one more step traced: its instructions' time by model part covers every kind of layer and the optimizer
  prof = step["profile"]
  assert "error" not in prof, prof
  assert {"kda", "mla", "moe", "optimizer"} <= set(prof["by_part_ms_per_step"]), prof["by_part_ms_per_step"]
  assert sum(prof["by_part_ms_per_step"].values()) == pytest.approx(prof["sum_ms_per_step"], abs=1e-2)

  split = phases["split"]["result"]
  pieces = split["pieces"]
  assert set(pieces) == {"kda_mixer", "mla_mixer", "moe_ffn", "dense_ffn", "head", "optimizer"}
  assert pieces["kda_mixer"]["count"] == split["layers"]["kda"] and pieces["optimizer"]["count"] == 1
  assert split["pieces_sum_ms"] == pytest.approx(sum(p["times_count_ms"] for p in pieces.values()), abs=0.01)
  # the MoE under the CPU's other expert implementation (the tiny config's auto is dense here), not summed
  (alt_name, alt), = split["alternatives"].items()
  assert alt_name == "moe_ffn[ragged]" and alt["count"] == pieces["moe_ffn"]["count"] and alt["one_ms"] > 0
  kda = split["kda_op"]
  assert kda["forward_backward"]["median_ms"] > 0 and kda["peer"]["deltanet_tpu_v6e_ms"] == 22.5
  # on a CPU kda_native trains through the XLA scan: one implementation, at both shapes
  assert kda["op"] == "kda_chunked[xla]" and "kda_op_xla" not in split
  step_op = split["kda_op_step"]
  assert step_op["forward_backward"]["median_ms"] > 0 and step_op["documents"] == 4
  assert (step_op["B"], step_op["T"]) == (split["batch_size"], split["seq_len"])

  loss = phases["loss"]["result"]
  assert loss["corpus"]["what"] == ("given" if shakespeare.is_file() else "tinyshakespeare") or \
      loss["corpus"]["what"].startswith("the repository's README.md")
  curve = {int(k): v for k, v in loss["loss_curve"].items()}
  assert sorted(curve) == [1, 10, 20, 30, 40]
  assert abs(curve[1] - math.log(1024)) < 0.3      # a fresh model over the demo tokenizer's 1024 pieces
  assert loss["loss_falls"] and loss["loss_last10_mean"] < loss["loss_first10_mean"] - 0.5
  # Falling through the run, window by window: single steps are too noisy to order (lr 1e-2 on batches of
  # 256 tokens: the loss jumps by up to ~1 nat at single steps, e.g. 7.48 at step 10 after 6.1-6.4 at
  # steps 5-9, and where a jump lands moves with any rounding change, dense or ragged MoE alike).
  recs = [json.loads(line) for line in
          (tmp_path / "work" / "runs" / "C_uninterrupted" / "metrics.jsonl").read_text().splitlines()]
  by_step = {r["step"]: r["loss"] for r in recs if "loss" in r}
  window = lambda a, b: float(np.mean([by_step[s] for s in range(a, b + 1)]))
  assert window(1, 10) > window(21, 30) > window(31, 40), [round(by_step[s], 2) for s in sorted(by_step)]
  runs = loss["runs"]
  assert runs["A_killed"]["rc"] == 130 and runs["A_killed"]["sigterm_after_step"] >= 20
  # SIGTERM lands as step 20's checkpoint is written (checkpoint_every=10): held until it is complete
  assert not any(r["log_has_traceback"] for r in runs.values()), {k: r["log_tail"] for k, r in runs.items()}
  resume = loss["resume"]
  assert 20 <= resume["resumed_from_step"] < 40
  assert resume["steps_compared_after_resume"] == 40 - resume["resumed_from_step"]
  assert resume["equal"] is True and resume["max_abs_loss_diff_after_resume"] == 0.0
  # the compile: announced by every run; the resumed and uninterrupted runs load it from the cache
  assert all(any(ln.startswith("compiling the train step") for ln in r["compile_lines"]) for r in runs.values())
  assert "(compiled)" in runs["A_killed"]["compile_lines"][-1]
  assert "(loaded from the persistent cache)" in runs["B_resumed"]["compile_lines"][-1]
  assert "(loaded from the persistent cache)" in runs["C_uninterrupted"]["compile_lines"][-1]
  ck = loss["checkpoints"]
  assert ck["train_checkpoint_steps"][-1] == 40 and ck["restored_step"] == 40
  assert ck["exported_params_equal_uninterrupted"] is True and ck["train_checkpoint_params_equal_export"] is True
  head = report["headline"]
  assert head["resume_equal"] is True and head["loss_falls"] is True and head["step_ms_median"] > 0

  # the training op's profile: on a CPU the XLA implementation only (the kernel needs a TPU)
  prof = phases["profile"]["result"]
  assert list(prof) == ["xla"] and prof["xla"]["call_ms"] > 0 and prof["xla"]["instructions_seen"] > 20
  assert sum(prof["xla"]["by_source_ms"].values()) == pytest.approx(prof["xla"]["sum_ms"], abs=1e-3)
  top10 = head["kda_op_profile"]["xla"]["by_source_ms_top10"]
  assert len(top10) == 10 and list(top10.items()) == list(prof["xla"]["by_source_ms"].items())[:10]


@pytest.mark.parametrize("env, message", [
    ({"TRAIN_PHASES": "step lossx"}, "error: TRAIN_PHASES: unknown phase 'lossx' (expected some of: step loss split profile)"),
    ({"TRAIN_BUDGET_step": "abc"}, "error: TRAIN_BUDGET_step='abc': expected whole seconds from 1 to 1200"),
    # empty was taken for the default, and a budget above the whole check's time reached `[` as text
    ({"TRAIN_BUDGET_loss": ""}, "error: TRAIN_BUDGET_loss='': expected whole seconds from 1 to 1200"),
    ({"TRAIN_BUDGET_loss": "99999999999999999999"}, "error: TRAIN_BUDGET_loss='99999999999999999999': expected "
                                                    "whole seconds from 1 to 1200"),
    ({"TRAIN_BATCHES": "8 x"}, "error: TRAIN_BATCHES='8 x': expected batch sizes >= 1 separated by spaces"),
    ({"TRAIN_PHASES": " "}, "error: TRAIN_PHASES=' ': expected some of: step loss split profile"),
    # a misspelt budget name was silently ignored (the phase then ran under its default budget)
    ({"TRAIN_BUDGET_stpe": "400"}, "error: TRAIN_BUDGET_stpe: unknown phase 'stpe' (expected TRAIN_BUDGET_<phase> "
                                   "with a phase of: install step loss split profile)"),
    ({"TRAIN_BUDGET_": "400"}, "error: TRAIN_BUDGET_: unknown phase ''"),
    # the 0/1 switches: any other value passed silently for one of them
    ({"TRAIN_SMOKE": "yes"}, "error: TRAIN_SMOKE='yes': expected 0 or 1 (empty: the default)"),
    # a blank implementation list ran a profile phase of nothing and reported ok
    ({"TRAIN_PROFILE_IMPLS": "  "}, "error: TRAIN_PROFILE_IMPLS='  ': expected pallas_tpu and/or xla"),
    ({"TRAIN_STEP_PROFILE_TOP": "-1"}, "error: TRAIN_STEP_PROFILE_TOP='-1': expected 0 (no traced step)"),
    ({"TRAIN_DONATE": "2"}, "error: TRAIN_DONATE='2': expected 0 or 1 (empty: the default)"),
    ({"SKIP_INSTALL": "true"}, "error: SKIP_INSTALL='true': expected 0 or 1 (empty: the default)"),
    # a bad model key or value: one line naming TRAIN_MODEL_SET, not a traceback inside the step phase
    ({"TRAIN_MODEL_SET": "scan_layers=true scan_layer=true"},
     "error: TRAIN_MODEL_SET: unknown config key 'scan_layer'; did you mean scan_layers"),
    ({"TRAIN_MODEL_SET": "remat_policy=nonsense"}, "error: TRAIN_MODEL_SET: remat_policy must be one of"),
    ({"TRAIN_MODEL_SET": "scan_layers"}, "error: TRAIN_MODEL_SET: override 'scan_layers' must be written key=value"),
    # a mistyped corpus failed inside the loss phase, after the install; a PY without jax after OUT was cleared
    ({"TRAIN_CORPUS": "/nonexistent/corpus.txt"}, "error: TRAIN_CORPUS='/nonexistent/corpus.txt': no such file"),
    ({"PY": "/nonexistent/python3"}, "error: PY='/nonexistent/python3': not a Python with jax"),
    ({"TRAIN_SMOKE": "0", "TRAIN_COMPILED_STEP": "no/such.bin"}, "error: TRAIN_COMPILED_STEP='no/such.bin': no such file"),
    # the smoke step is another program: the file was checked, then silently unused
    ({"TRAIN_COMPILED_STEP": "no/such.bin"}, "error: TRAIN_COMPILED_STEP is for the 0.4B step phase on the chip, "
                                             "not with TRAIN_SMOKE=1"),
])
def test_bad_settings_are_refused_before_any_phase(tmp_path, env, message):
  """A typo in a phase name, budget, switch, batch list or model key exits 2 with one line naming the
  variable; before the fix a misspelt phase was silently dropped and the run reported success with an empty
  JSON, a misspelt budget or a switch of "yes" was silently read as something else, and a bad model key was
  a traceback inside the step phase after the install."""
  run = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                       env={**os.environ, "TRAIN_SMOKE": "1", "SKIP_INSTALL": "1", "PY": sys.executable,
                            "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), **env})
  assert run.returncode == 2, run.stdout + run.stderr
  assert run.stderr.strip().splitlines() == [run.stderr.strip()] and run.stderr.startswith(message), run.stderr
  assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()   # nothing made, nothing cleared


@pytest.mark.parametrize("script", ["train_device_check.sh", "e2e_device_check.sh", "tpu_device_check.sh"])
def test_help_and_a_stray_argument(tmp_path, script):
  """The device checks take their settings from the environment: --help prints the header (its usage and
  every variable) and exits 0; any argument is refused (before, `--help` started a full run)."""
  path = SCRIPT.parent / script
  env = {**os.environ, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work")}
  run = subprocess.run(["bash", str(path), "--help"], capture_output=True, text=True, timeout=60, env=env)
  assert run.returncode == 0 and "Usage" in run.stdout and "set -uo" not in run.stdout, run.stdout + run.stderr
  assert not run.stdout.startswith("#!") and not (tmp_path / "out").exists()
  run = subprocess.run(["bash", str(path), "phases=step"], capture_output=True, text=True, timeout=60, env=env)
  assert run.returncode == 2 and run.stderr.startswith(f"error: unexpected argument 'phases=step': {script} takes no "
                                                       "arguments"), run.stderr
  assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


def test_a_bad_model_key_is_refused_by_name_before_the_install_too(tmp_path):
  """Before the install, PY may lack the project's packages (ml_collections here made unimportable): the
  key names of TRAIN_MODEL_SET are checked against configs/base.py's text, before anything is touched (the
  last run's log stays); good names pass that check with a note."""
  fake = tmp_path / "fake"
  (fake / "ml_collections").mkdir(parents=True)
  (fake / "ml_collections" / "__init__.py").write_text("raise ImportError('not installed', name='ml_collections')\n")
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "train_device_logs.txt").write_text("the last run's log\n")
  env = {**os.environ, "TRAIN_SMOKE": "1", "SKIP_INSTALL": "1", "PY": sys.executable, "OUT": str(tmp_path / "out"),
         "WORK": str(tmp_path / "work"), "PYTHONPATH": str(fake), "TRAIN_MODEL_SET": "scan_layers=true kda_layer=[1]"}
  run = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
  assert run.returncode == 2, run.stdout + run.stderr
  assert run.stderr.strip() == ("error: TRAIN_MODEL_SET: unknown config key 'kda_layer'; did you mean kda_layers, "
                                "scan_layers, full_attn_layers? (see configs/base.py for every key)")
  assert (tmp_path / "out" / "train_device_logs.txt").read_text() == "the last run's log\n"
  assert not (tmp_path / "work").exists()
  ok = subprocess.run([sys.executable, "-m", "tools.bench.train_device", "check-set", "--smoke", "--set-source",
                       "TRAIN_MODEL_SET", "--set", "scan_layers=true", "--set", "kda_layers=[1]"],
                      capture_output=True, text=True, timeout=60, cwd=REPO, env={**env, "PYTHONPATH": f"{fake}:{REPO}"})
  assert ok.returncode == 0, ok.stdout + ok.stderr
  assert "note: TRAIN_MODEL_SET key names checked only (ml_collections is not installed here" in ok.stdout


def test_config_keys_read_from_the_text_are_the_configs_keys():
  """The package-free key check reads configs/base.py's `c.<key> = ...` lines: the same keys as the config."""
  from configs import base
  assert train_device.config_keys_from_text() == (list(base.get_config().keys()), base.RENAMED)


@pytest.mark.parametrize("flag", ["--seq-len", "--repeats", "--steps-per-repeat", "--batch", "--loss-steps",
                                  "--kill-at", "--checkpoint-every"])
@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_count_flags_must_be_whole_numbers_of_at_least_one(tmp_path, capsys, flag, value):
  """`--seq-len 0` used to run the phase into an IndexError; every count flag now refuses < 1 by name."""
  phase = "loss" if flag in ("--loss-steps", "--kill-at", "--checkpoint-every") else "split"
  with pytest.raises(SystemExit) as e:
    train_device.main([phase, "--json", str(tmp_path / "x.json"), "--smoke", flag, value])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err == (f"python -m tools.bench.train_device: error: argument {flag}: expected a whole number >= 1, "
                 f"got {value!r} (see --help)\n")
  assert not (tmp_path / "x.json").exists()


def test_kill_at_must_come_before_the_last_step_and_json_is_required(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    train_device.main(["loss", "--json", str(tmp_path / "x.json"), "--loss-steps", "40"])   # --kill-at 150
  assert e.value.code == 2
  assert "error: argument --kill-at: expected fewer than --loss-steps=40, got 150" in capsys.readouterr().err
  with pytest.raises(SystemExit) as e:
    train_device.main(["step", "--smoke"])
  assert e.value.code == 2
  assert "error: the following arguments are required: --json" in capsys.readouterr().err
  # a missing corpus: exit 2 before the run directory or the JSON exists (it was exit 1, both left behind)
  with pytest.raises(SystemExit) as e:
    train_device.main(["loss", "--corpus", str(tmp_path / "nope.txt"), "--json", str(tmp_path / "x.json"),
                       "--dir", str(tmp_path / "runs")])
  assert e.value.code == 2
  assert f"error: argument --corpus: no such file: '{tmp_path / 'nope.txt'}'" in capsys.readouterr().err
  assert not list(tmp_path.iterdir())


def test_a_bad_set_is_one_line_before_the_phase_runs(tmp_path, capsys):
  """`--set` is checked before the phase builds anything: one line naming --set and the key, exit 2, no JSON."""
  assert train_device.main(["step", "--json", str(tmp_path / "x.json"), "--smoke", "--set", "scan_layer=true"]) == 2
  assert capsys.readouterr().err == ("error: --set: unknown config key 'scan_layer'; did you mean scan_layers, "
                                     "kda_layers, full_attn_layers? (see configs/base.py for every key)\n")
  assert not (tmp_path / "x.json").exists()
  assert train_device.main(["check-set", "--smoke", "--seq-len", "64", "--set-source", "TRAIN_MODEL_SET",
                            "--set", "scan_layers=maybe"]) == 2
  assert capsys.readouterr().err == "error: TRAIN_MODEL_SET: scan_layers expects bool, got 'maybe'\n"
  assert train_device.main(["check-set", "--smoke", "--seq-len", "64", "--set", "scan_layers=true"]) == 0
  assert capsys.readouterr().out == "--set: ok\n"


@pytest.mark.parametrize("argv,message", [
    (["loss", "--set", "scan_layers=true"],
     "argument --set: the step and split phases' only (phase loss takes --loss-model / --loss-set)"),
    (["split", "--smoke", "--compiled-step", "STEP"], "argument --compiled-step: the step phase's only, got phase split"),
    (["step", "--smoke", "--compiled-step", "NOPE"], "argument --compiled-step: no such file: 'NOPE' (expected a step "
     "written by kda-aot-compile ... mode=train compiled_trainstep_file=FILE)"),
], ids=["set_for_loss", "compiled_step_for_split", "compiled_step_missing"])
def test_flags_of_another_phase_or_a_missing_file_are_refused(tmp_path, capsys, argv, message):
  step = tmp_path / "step.bin"
  step.write_bytes(b"x")
  argv = [str(step) if a == "STEP" else str(tmp_path / "nope.bin") if a == "NOPE" else a for a in argv]
  message = message.replace("'NOPE'", repr(str(tmp_path / "nope.bin")))
  with pytest.raises(SystemExit) as e:
    train_device.main([*argv, "--json", str(tmp_path / "x.json"), "--dir", str(tmp_path / "runs")])
  assert e.value.code == 2
  assert capsys.readouterr().err == f"python -m tools.bench.train_device: error: {message} (see --help)\n"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["step.bin"]
  with pytest.raises(SystemExit) as e:
    train_device.main(["check-set", "--json", str(tmp_path / "x.json")])
  assert e.value.code == 2
  assert "error: argument --json: check-set runs nothing and writes no figures" in capsys.readouterr().err


def test_a_file_that_is_no_compiled_step_is_one_error_line(tmp_path, capsys):
  """--compiled-step FILE exists but is not a step: it was a traceback (exit 1); now one line, exit 2,
  and the JSON says why."""
  step = tmp_path / "not_a_step.bin"
  step.write_text("hello\n")
  out = tmp_path / "step.json"
  assert train_device.main(["step", "--smoke", "--profile-top", "0", "--compiled-step", str(step),
                            "--json", str(out)]) == 2
  err = capsys.readouterr().err.splitlines()
  assert err[-1] == (f"error: compiled_trainstep_file={step} is not a compiled train step (written by "
                     f"kda-aot-compile ... mode=train compiled_trainstep_file=...)")
  assert json.loads(out.read_text())["error"] == err[-1].removeprefix("error: ")


@pytest.mark.parametrize("loss_set,message", [
    (["bogus_key=1"], "unknown config key 'bogus_key'"),
    (["warmup_steps=500"], "warmup_steps=500 is invalid: expected fewer than steps=300"),
    (["steps=5"], "steps is set by the loss phase itself (use --loss-steps)"),
    (["output_dir=/tmp/elsewhere"], "output_dir is set by the loss phase itself (use --dir)"),
])
def test_bad_loss_run_keys_are_refused_before_any_run(tmp_path, capsys, loss_set, message):
  """The kda-train runs' keys are checked up front: a bad one used to start three runs that each exited 2,
  with the phase itself exiting 0."""
  runs = tmp_path / "runs"
  assert train_device.main(["loss", "--json", str(tmp_path / "x.json"), "--dir", str(runs),
                            "--loss-set", *loss_set]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: --loss-model / --loss-set: ") and message in err and err.count("\n") == 1
  assert not list(tmp_path.iterdir())


def test_a_failed_run_fails_the_loss_phase_with_its_error_line(tmp_path, capsys):
  """A kda-train run that exits with an error (here: an empty corpus, which only the run itself reads) ends
  the phase with exit 1, the run's `error:` line said, and the JSON naming the failed run; B and C do
  not start."""
  corpus = tmp_path / "empty.txt"
  corpus.write_text("")
  out = tmp_path / "loss.json"
  rc = train_device.main(["loss", "--json", str(out), "--dir", str(tmp_path / "runs"), "--corpus", str(corpus),
                          "--child-platforms", "cpu", "--loss-model", "demo", "num_hidden_layers=2", "kda_layers=[1]",
                          "full_attn_layers=[2]", "--loss-set", "seq_len=64",
                          "batch_size=2", "warmup_steps=2", "--loss-steps", "10", "--kill-at", "5"])
  assert rc == 1
  captured = capsys.readouterr()
  assert f"run A_killed failed: error: train_data='{corpus}' is empty" in captured.out + captured.err
  assert "error: loss: run(s) A_killed failed" in captured.err
  result = json.loads(out.read_text())
  assert result["failed_runs"] == ["A_killed"] and list(result["runs"]) == ["A_killed"]
  assert result["runs"]["A_killed"]["rc"] == 2 and result["runs"]["A_killed"]["ok"] is False


def test_help_has_the_description_once_and_every_flag_explained(capsys):
  parser = train_device.build_parser()
  missing = [a.dest for a in parser._actions if not a.help]
  assert missing == []
  text = parser.format_help()
  first = train_device.__doc__.split("\n\n")[0].splitlines()[0]
  assert text.count(first) == 1
  assert "Formulas (docs/training.md" in text   # the rest of the docstring, as the epilog
  with pytest.raises(SystemExit) as e:
    train_device.main(["--help"])
  assert e.value.code == 0 and capsys.readouterr().out.count(first) == 1


@pytest.mark.slow   # ~40 s of CPU (a compile of the smoke step, then the phase); make test-slow runs it
def test_the_step_phase_runs_a_step_compiled_ahead_of_time(tmp_path):
  """--compiled-step: the step phase loads the file (model/aot.py's program, compiled here for this CPU as
  kda-aot-compile compiles it for the chip) instead of compiling, and times it."""
  import jax

  from model import aot, partitioning
  from model.training import compiled_step
  cfg = train_device.step_config(train_device.build_parser().parse_args(["step", "--smoke", "--seq-len", "64"]), 2)
  mesh = partitioning.create_mesh(cfg, jax.devices()[:1])
  path = tmp_path / "step.bin"
  head = compiled_step.header(cfg, jax.devices()[0].device_kind, 1, partitioning.mesh_shape(cfg, 1))
  compiled_step.save(path, aot.lower(cfg, "train", mesh)[0].compile(), head)
  out = tmp_path / "step.json"
  assert train_device.main(["step", "--json", str(out), "--smoke", "--batches", "2", "--seq-len", "64",
                            "--repeats", "2", "--steps-per-repeat", "1", "--compiled-step", str(path)]) == 0
  report = json.loads(out.read_text())
  assert report["compile"]["loaded_from"] == str(path) and report["compile"]["file_bytes"] == path.stat().st_size
  assert report["batch_size"] == 2 and report["timed"]["step"]["median_ms"] > 0
  assert np.isfinite(report["timed"]["first_loss"])


# one case a script and way (the scripts share device_budgets.sh's check_dirs for OUT, WORK, CACHE_DIR)
@pytest.mark.parametrize("script, var, under", [
    ("train_device_check.sh", "OUT", False), ("e2e_device_check.sh", "WORK", False),
    ("tpu_device_check.sh", "OUT", False), ("e2e_device_check.sh", "CACHE_DIR", True)])
def test_an_output_directory_that_cannot_be_is_refused(tmp_path, script, var, under):
  """OUT, WORK or CACHE_DIR naming an existing file, or a path under one: before the fix the check ran its
  phases into errors (a traceback in each, where the report or the cache was to be written) and, for
  OUT and WORK, exited 0 with no JSON."""
  afile = tmp_path / "afile"
  afile.write_text("keep me\n")
  value = afile / "sub" if under else afile
  env = {**os.environ, "TRAIN_SMOKE": "1", "E2E_SMOKE": "1", "SMOKE": "1", "SKIP_INSTALL": "1", "PY": sys.executable,
         "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), "CACHE_DIR": str(tmp_path / "cache"),
         var: str(value)}
  run = subprocess.run(["bash", str(SCRIPT.parent / script)], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path, env=env)
  assert run.returncode == 2, run.stdout + run.stderr
  want = (f"error: {var}='{value}' cannot be created: '{afile}' is not a directory" if under else
          f"error: {var}='{afile}' exists and is not a directory: expected a directory path (it is created if missing)")
  assert run.stderr.strip().splitlines() == [want], run.stderr
  assert afile.read_text() == "keep me\n"
  assert not any((tmp_path / d).exists() for d in ("out", "work", "cache"))   # nothing made
