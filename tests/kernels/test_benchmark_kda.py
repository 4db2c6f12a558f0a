"""tools/benchmark_kda.py: the table and JSON it writes, paired ratios, and a failing backend reported
(not hiding the other figures, non-zero exit). Tiny shapes: this checks the script, not speed."""

import json

import numpy as np
import pytest

from tools import benchmark_kda as bk

ARGS = ["--seq-lens", "64", "--dtypes", "float32", "--heads", "2", "--key-dim", "16", "--value-dim", "16",
        "--runs", "5", "--warmup", "0"]


def test_table_json_and_paired_ratios(tmp_path, capsys):
  out = tmp_path / "b.json"
  rc = bk.main(ARGS + ["--backends", "kda_inference_xla", "kda_chunked", "tokamax_xla_chunked",
                       "fla_chunk_kda", "--output", str(out)])
  assert rc == 0
  text = capsys.readouterr().out
  assert "| 64 | float32 | kda_inference_xla |" in text
  assert "skipped fla_chunk_kda: needs a GPU" in text
  d = json.loads(out.read_text())
  rows = {r["backend"]: r for r in d["results"]}
  assert set(rows) == {"kda_inference_xla", "kda_chunked", "tokamax_xla_chunked"}
  ours, peer = rows["kda_inference_xla"], rows["tokamax_xla_chunked"]
  assert len(ours["times_ms"]) == len(peer["times_ms"]) == 5
  # The reported ratio is the median of the per-round ratios, recomputed here from the raw times.
  paired = np.median(np.asarray(peer["times_ms"]) / np.asarray(ours["times_ms"]))
  assert ours["speedup_vs"]["tokamax_xla_chunked"] == pytest.approx(paired, rel=1e-9)
  # Every backend computes the same op on the same inputs.
  assert rows["kda_chunked"]["max_abs_diff"] < 1e-5
  assert peer["max_abs_diff"] < 1e-5
  assert d["failed"] == {}


def test_failing_backend_is_reported_and_exit_is_nonzero(tmp_path, capsys, monkeypatch):
  def broken(case):
    raise RuntimeError("kernel did not compile")

  monkeypatch.setitem(bk.OUR_BACKENDS, "broken", bk.Backend("broken", broken))
  out = tmp_path / "b.json"
  rc = bk.main(ARGS + ["--backends", "broken", "kda_inference_xla", "--output", str(out)])
  assert rc == 1
  text = capsys.readouterr().out
  assert "| 64 | float32 | kda_inference_xla |" in text
  assert "FAILED broken (T=64 float32): RuntimeError: kernel did not compile" in text
  assert json.loads(out.read_text())["failed"] == {
      "broken (T=64 float32)": "RuntimeError: kernel did not compile"}


@pytest.mark.parametrize("argv, message", [
    (["--seq-lens", "0"], "--seq-lens must be at least 1, got 0"),
    (["--batch", "0"], "--batch must be at least 1"),
    (["--heads", "-1"], "--heads must be at least 1"),
    (["--warmup", "-3"], "--warmup must be at least 0"),
    (["--runs", "3"], "--runs must be at least 5"),
    (["--backends", "nope"], "unknown backend(s) ['nope']"),
    (["--backends", "kda_inference_pallas_gpu"], "nothing to run here: kda_inference_pallas_gpu: needs a GPU"),
])
def test_bad_arguments_exit_2_before_any_work(argv, message, capsys, tmp_path):
  with pytest.raises(SystemExit) as e:
    bk.main(argv + ["--output", str(tmp_path / "b.json")])
  assert e.value.code == 2
  assert message in capsys.readouterr().err
  assert not (tmp_path / "b.json").exists()


def test_bad_output_paths(capsys, tmp_path):
  for out, message in ((tmp_path, "is a directory"), (tmp_path / "missing" / "b.json", "does not exist")):
    with pytest.raises(SystemExit) as e:
      bk.main(["--output", str(out)])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
