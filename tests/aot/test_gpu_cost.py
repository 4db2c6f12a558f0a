"""tools/gpu_cost.py: the estimated H200 kernel time from a real deviceless compile (small shape here).

The seed-shape figure is reported in the commit / issue note (a figure, not a timed test).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.aot.conftest import ROOT


@pytest.mark.aot
def test_estimate_from_a_small_compile(gpu_aot, tmp_path):
  out = tmp_path / "cost.json"
  report = gpu_aot.run("tools.gpu_cost", "seq_len=512", "heads=2", "key_dim=64", "value_dim=64",
                       "num_segments=3", f"output_json={out}")
  saved = json.loads(out.read_text())
  assert report["estimated_ms"] == pytest.approx(saved["estimated_ms"])
  assert "ESTIMATE" in saved["label"]
  prep, state = saved["chunk_prep"], saved["state_pass"]
  assert prep["programs"] == 8 * 2 and prep["waves"] == 1  # 8 chunks x (B*H = 2) programs
  assert prep["tensor_cores"] and state["tensor_cores"]
  assert state["programs_with_work"] == (64 // 32) * 2 * 3  # V blocks x B*H x documents
  parts = prep["estimated_ms"] + state["estimated_ms"] + saved["glue_ms"]
  assert saved["estimated_ms"] == pytest.approx(parts)
  assert 0 < saved["estimated_ms"] < 1.0


@pytest.mark.parametrize("arg,message", [("seq_len=zero", "seq_len must be an integer"),
                                          ("dtype=int8", "dtype must be bfloat16 or float32"),
                                          ("key_dim=256", "<= 128"), ("bogus=1", "unknown argument"),
                                          ("ptx_dir=/nonexistent", "cannot read launches.json")])
def test_bad_input_exits_2(arg, message):
  proc = subprocess.run([sys.executable, "-m", "tools.gpu_cost", arg], cwd=ROOT, capture_output=True,
                        text=True, timeout=60)
  assert proc.returncode == 2
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], proc.stderr


def test_help():
  proc = subprocess.run([sys.executable, "-m", "tools.gpu_cost", "--help"], cwd=ROOT, capture_output=True,
                        text=True, timeout=60)
  assert proc.returncode == 0 and "output_json=OUT" in proc.stdout
