"""The continuous engine on a data 4 x tensor 2 mesh of 8 simulated CPU devices gives the one-device
tokens (tests/serving/mesh_engine_check.py, in a subprocess: JAX fixes the device count at start)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


# slow (an 8-device subprocess, about 80 s of CPU): make test's 20-minute budget; make test-slow runs it.
@pytest.mark.slow
def test_mesh_engine_gives_the_one_device_tokens():
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
  proc = subprocess.run([sys.executable, "-m", "tests.serving.mesh_engine_check"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["devices"] == 8 and "data=4" in out["mesh"] and "tensor=2" in out["mesh"]
  # The pool really is split: slots on data, KDA heads on tensor.
  assert out["specs"]["kda_state"].startswith("P(('data', 'fsdp'), 'tensor'")
  assert out["mesh_tokens"] == out["one_tokens"] and len(out["one_tokens"]) == 6
  assert out["max_logprob_diff"] <= 1e-5
  # the one bucket, its one-prompt variant and the decode-only step
  assert out["cached"]["r5"] == 64 and out["compilations"] == 3
