"""Runs one ahead-of-time compile in a compile venv, in its own process, and returns its JSON report.

The child is `python -m MODULE ARGS...` from the repository root (the checkout on PYTHONPATH, so the
code under test is this tree's). It must print its report as one JSON object on the last line of
stdout. GPU compiles are serialised across pytest-xdist workers by an exclusive file lock (two 40 s
Triton + ptxas compiles on two cores only slow each other down); TPU compiles run side by side
(ALLOW_MULTIPLE_LIBTPU_LOAD lets a second process load libtpu while another holds its lock file).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import pathlib
import subprocess
import tempfile

# What the TPU compiler needs on a host with no TPU attached (no metadata server to query).
TPU_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost",
           "TPU_ACCELERATOR_TYPE": "v5litepod-1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


class AotFailed(AssertionError):
  """The child exited non-zero or printed no JSON report; carries its output."""


@dataclasses.dataclass(frozen=True)
class AotRunner:
  kind: str  # "tpu" or "gpu"
  python: pathlib.Path
  root: pathlib.Path

  def run(self, module: str, *args: str, timeout: float = 300, env: dict | None = None,
          returncodes: tuple[int, ...] = (0,)) -> dict:
    """Runs `python -m module *args` in the compile venv; returns the JSON report of its last line.

    Raises AotFailed with the child's output when its exit status is not in `returncodes` (e.g. 3 is
    tools.aot_compile's "does not fit") or it prints no JSON.
    """
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("KDA_AOT_", "PYTEST_"))}
    child_env["PYTHONPATH"] = str(self.root)
    # tests/conftest.py's XLA:CPU -O0 must not reach the TPU/GPU compilers.
    flags = child_env.pop("XLA_FLAGS", "").replace("--xla_backend_optimization_level=0", "").strip()
    if flags:
      child_env["XLA_FLAGS"] = flags
    child_env.pop("JAX_PLATFORMS", None)  # tests/conftest.py sets cpu; each script chooses its own
    if self.kind == "tpu":
      child_env.update(TPU_ENV)
    child_env.update(env or {})
    lock_path = pathlib.Path(tempfile.gettempdir()) / f"kda_aot_{self.kind}.lock"
    with open(lock_path, "w") as lock:
      if self.kind == "gpu":
        fcntl.flock(lock, fcntl.LOCK_EX)
      proc = subprocess.run([str(self.python), "-m", module, *args], cwd=self.root, env=child_env,
                            capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    report = None
    if lines:
      try:
        report = json.loads(lines[-1])
      except json.JSONDecodeError:
        report = None
    if proc.returncode not in returncodes or not isinstance(report, dict):
      raise AotFailed(f"{module} {' '.join(args)} exited {proc.returncode}\n--- stdout\n"
                      f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return report
