"""tools/bench/train_op_profile.py on this host: the smoke run's figures, and bad arguments."""

import json
import re

import pytest

from tools.bench import train_op_profile as top


def test_smoke_run_sums_the_op_s_instructions_by_source_line(tmp_path, capsys):
  out = tmp_path / "p.json"
  assert top.main(["--smoke", "--json", str(out), "--top", "500", "--repeats", "2", "--calls", "1",
                   "--compilation-cache-dir", "none"]) == 0
  r = json.loads(out.read_text())
  assert r["args"]["implementation"] == "xla" and r["args"]["gate"] == "model_init" and r["plane"] == "/host:CPU"
  assert r["call_ms"] > 0 and len(r["runs_ms"]) == 2 and r["instructions_seen"] > 20
  # every instruction's time lands in exactly one source line, and the chunk math's lines are among them
  assert sum(r["by_source_ms"].values()) == pytest.approx(r["sum_ms"], abs=1e-3)
  assert any(src.startswith("ops/chunked.py:") for src in r["by_source_ms"]), list(r["by_source_ms"])[:20]
  # a matmul wrapper's instructions name the line that called it
  assert any(re.match(r"ops/chunked\.py:\d+ _mm < ops/chunked\.py:\d+ ", src) for src in r["by_source_ms"])
  rows = r["top"]
  assert rows and rows[0]["ms"] >= rows[-1]["ms"] and all("part" not in row and row["count"] >= 1 for row in rows)
  assert "kda_chunked[xla] B=1 T=128 H=2" in capsys.readouterr().out


def test_by_source_groups_instructions_without_a_frame_as_unknown():
  ins = {"a": {"source": "ops/chunked.py:10 f"}, "b": {"source": "ops/chunked.py:10 f"}, "c": {},
         "d": {"source": "ops/chunked.py:65 _mm", "caller": "ops/chunked.py:460 chunk_with_state"}}
  times = {"a": [1_000_000, 1], "b": [2_000_000, 3], "c": [500_000, 1], "d": [250_000, 2]}
  assert top.by_source(times, ins) == {"ops/chunked.py:10 f": 3.0, "?": 0.5,
                                       "ops/chunked.py:65 _mm < ops/chunked.py:460 chunk_with_state": 0.25}


@pytest.mark.parametrize("argv, message", [
    (["--batch", "-1"], "--batch must be >= 1"),
    (["--gate", "gentle"], "argument --gate: invalid choice: 'gentle'"),
    (["--seq-len", "-2"], "--seq-len must be >= 1"),
    (["--calls", "0"], "--calls must be >= 1"),
    (["--calls", "99999999999999999999"], "--calls must be at most 1000"),   # ran until killed before
    (["--docs", "200"], "--docs must be at most --seq-len (128), got 200"),
    (["--implementation", "pallas_tpu"], "--implementation pallas_tpu needs a TPU (this backend: cpu)"),
    (["--json", "{tmp}"], "is a directory; expected a file path"),
    (["--json", ""], "--json: expected a file path, got an empty value"),
    (["--json", "/proc/p.json"], "cannot be written (/proc is not a writable directory)"),
    (["--batch", "100000", "--seq-len", "100000"], "the op's inputs, gradients and chunk states alone need"),
    (["--key-dim", "100000"], "--key-dim must be at most 256, got 100000"),   # a traceback (out of memory) before
    (["--top", "1000000000000"], "--top must be at most 100000"),
    (["--json", "{tmp}/file/p.json"], "cannot be written ({tmp}/file is not a writable directory)"),
])
def test_bad_arguments_exit_2_naming_them_before_anything_is_written(tmp_path, capsys, argv, message):
  (tmp_path / "file").write_text("")
  argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
  with pytest.raises(SystemExit) as e:
    top.main(["--smoke", "--json", str(tmp_path / "out" / "p.json"), *argv])
  assert e.value.code == 2 and message.replace("{tmp}", str(tmp_path)) in capsys.readouterr().err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
