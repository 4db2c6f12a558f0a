"""Fixtures for the ahead-of-time compile checks.

jax's real TPU compiler (libtpu) and CUDA compiler (the jax CUDA plugin, LLVM and ptxas) run on this
CPU-only host, but each lives in its own venv (`make test` creates `.venv-tpu-aot` and
`.venv-gpu-aot` when missing): libtpu prints TPU-init warnings at every jax start on a host without
a TPU, so it must stay out of `.venv`, which `make demo` gives users. The tests run in `.venv` and
drive the compile venvs as subprocesses, one compile per process (a Mosaic CHECK failure aborts the
process, and libtpu holds a lock file).

Under `make test` (KDA_AOT_REQUIRED=1, or CI=true) a missing compile venv is a failure; a bare
`pytest` run without them skips these tests with a line saying how to get them.
"""

from __future__ import annotations

import os
import pathlib
import time

import pytest

from tests.aot.helpers.runner import AotRunner

ROOT = pathlib.Path(__file__).resolve().parents[2]


# `make test` installs the compile venvs in the background while the rest of the suite runs and
# writes the install's exit status to this file when it ends (see the Makefile's test_recipe).
INSTALL_WAIT_S = 1800


def _wait_for_install() -> None:
  rc_path = os.environ.get("KDA_AOT_INSTALL_RC")
  if not rc_path:
    return
  rc_file = pathlib.Path(rc_path)
  deadline = time.monotonic() + INSTALL_WAIT_S
  while not rc_file.exists():
    if time.monotonic() > deadline:
      pytest.fail(f"the compile venvs' install did not finish in {INSTALL_WAIT_S} s (log: "
                  f"{rc_file.with_suffix('')})")
    time.sleep(2)
  rc = rc_file.read_text().strip()
  if rc != "0":
    log = rc_file.with_suffix("")
    tail = log.read_text()[-2000:] if log.exists() else "(no log)"
    pytest.fail(f"`make install-aot` failed (exit {rc}); the end of {log}:\n{tail}")


def _python(kind: str) -> pathlib.Path | None:
  _wait_for_install()
  env = os.environ.get(f"KDA_AOT_{kind.upper()}_PYTHON")
  base, _, suffix = kind.partition("_")
  venv = f".venv-{base}-aot" + (f"-{suffix}" if suffix else "")
  path = pathlib.Path(env) if env else ROOT / venv / "bin" / "python"
  return path if path.exists() else None


def _runner(kind: str) -> AotRunner:
  python = _python(kind)
  if python is None:
    message = (f"the {kind.upper()} compile venv for {kind} is missing; `make test` creates it "
               f"(or `make install-aot`)")
    if os.environ.get("KDA_AOT_REQUIRED") == "1" or os.environ.get("CI") == "true":
      pytest.fail(message)
    pytest.skip(message)
  return AotRunner(kind=kind.partition("_")[0], python=python, root=ROOT)


@pytest.fixture(scope="session")
def tpu_aot() -> AotRunner:
  """Runs scripts under the libtpu venv (`.venv-tpu-aot`)."""
  return _runner("tpu")


@pytest.fixture(scope="session")
def tpu_aot_jax0102() -> AotRunner:
  """Runs scripts under the oldest supported end (`.venv-tpu-aot-jax0102`: Python 3.11, jax 0.10.2,
  libtpu 0.0.42.1, the lent TPU's image)."""
  return _runner("tpu_jax0102")


@pytest.fixture(scope="session")
def gpu_aot() -> AotRunner:
  """Runs scripts under the CUDA-plugin venv (`.venv-gpu-aot`)."""
  return _runner("gpu")
