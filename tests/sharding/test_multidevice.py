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


def run_inner(*paths: pathlib.Path, timeout: int = 900, marks: str = "") -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
  env.pop("PYTEST_XDIST_WORKER", None)
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly",
         "-rA", *(["-m", marks] if marks else []), *(str(p.relative_to(ROOT)) for p in paths)]
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# The files of one group run in one 8-device process: one jax start-up, and programs that several
# files compile alike (the tiny model's) are compiled once.
# `make test` runs the equivalence and checkpoint checks not marked slow inside those files (the model's
# train loss, gradients, prefill and greedy tokens on four meshes, the split rules, checkpoints across
# meshes); `make test-slow` the rest: the tools on the mesh, the train library's step, a converted
# checkpoint restored sharded, kda-train on 8 devices (~90 s of the 8-device process together).
@pytest.mark.parametrize("names, marks", [
    (("md_equivalence.py", "md_checkpoint.py"), "not slow"),
    pytest.param(("md_equivalence.py", "md_checkpoint.py"), "slow", marks=pytest.mark.slow),
    pytest.param(("md_train_tool.py",), "", marks=pytest.mark.slow)],
    ids=["equivalence+checkpoint", "equivalence+checkpoint_slow", "train_tool"])
def test_eight_device_checks(names, marks):
  proc = run_inner(*(HERE / "multidevice" / n for n in names), marks=marks)
  report = proc.stdout[-12000:] + proc.stderr[-4000:]
  assert proc.returncode == 0, f"8-device checks in {', '.join(names)} failed:\n{report}"
  last = proc.stdout.strip().splitlines()[-1]
  assert " passed" in last and "skipped" not in last, report
  assert ("deselected" in last) == bool(marks), report   # a marker expression splits the files, else all ran
  for name in names:  # every file ran: -rA lists each passed test with its file
    assert f"PASSED tests/sharding/multidevice/{name}::" in proc.stdout, f"no test of {name} ran:\n{report}"


def _free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow  # ~20 CPU-seconds (two JAX processes); `make test-slow` runs it
def test_two_process_job_through_the_distributed_keys():
  """Two processes of 4 CPU devices each start through `distributed_init=true` and the explicit
  coordinator keys; the 8-device mesh spans both (its data axis crosses the processes) and the
  loss on it equals each process's one-device loss. Three training steps on that mesh, each process
  building only its half of every global batch, give the losses of the same steps on one device
  fed the whole batch."""
  import json
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, "-m", "tests.sharding.multidevice.md_two_processes", str(port), str(i)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = [p.communicate(timeout=300) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, f"process failed:\n{out}\n{err[-4000:]}"
  views = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
  assert sorted(v["process"] for v in views) == [0, 1]
  for v in views:
    assert (v["processes"], v["devices"], v["local_devices"]) == (2, 8, 4)
    assert v["data_row_processes"] == [[0], [1]], v  # data axis = across hosts, tensor axis inside one
    assert abs(v["mesh_loss"] - v["local_loss"]) <= 1e-5 * (1 + abs(v["local_loss"])), v
    # Training with per-host input: each process built only its 4 rows of the 8-row global batch.
    assert v["process_rows"] == [4 * v["process"], 4 * v["process"] + 4] and v["local_batch_rows"] == 4, v
    want, got = v["one_device_train_losses"], v["mesh_train_losses"]
    assert len(got) == len(want) == 3 and len(set(want)) == 3, v  # three different steps
    for g, w in zip(got, want):
      assert abs(g - w) <= 1e-5 * (1 + abs(w)), v
    # A checksum of a parameter spread over both processes is the whole array's (issue 17 item 4).
    assert v["sharded_crc"]["fully_addressable"] is False and v["sharded_crc"]["crc32"] == v["sharded_crc"]["whole"], v
  # Both processes report the same global losses (one global computation, not two local ones).
  assert views[0]["mesh_train_losses"] == views[1]["mesh_train_losses"], views
