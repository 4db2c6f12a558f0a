"""Runs the 8-device checks of tests/sharding/multidevice/ in subprocesses.

JAX fixes the number of (simulated) CPU devices when it starts, so these checks cannot share the
pytest worker's process: each file runs in its own `python -m pytest` with
`XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu`, and its report is shown on
failure.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parent.parent


def run_inner(path: pathlib.Path, timeout: int = 600) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
  env.pop("PYTEST_XDIST_WORKER", None)
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly",
         "-rA", str(path.relative_to(ROOT))]
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("name", ["md_equivalence.py", "md_checkpoint.py"])
def test_eight_device_checks(name):
  proc = run_inner(HERE / "multidevice" / name)
  report = proc.stdout[-12000:] + proc.stderr[-4000:]
  assert proc.returncode == 0, f"8-device checks in {name} failed:\n{report}"
  assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], report
