"""tools/serve.py over a unix-domain socket (`--uds PATH`: the lent TPU machine opens no TCP socket): the
official `openai` client streams a completion through an httpx unix-socket transport, the streamed ids
are the non-streamed ones, start-up prints its compile report, and a SIGTERM drain removes the socket.

The server: the demo checkpoint, the continuous engine at small sizes (2 slots, 16-token steps: three
step executables), so it starts quickly on a shared CPU."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")

from tests.helpers.server import reap  # noqa: E402
from tools.bench import uds_client  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
DEMO = REPO / "kda_plugin" / "assets" / "demo"
START_TIMEOUT_S = 600


def _serve(argv, log):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  return subprocess.Popen([sys.executable, "-m", "tools.serve", *argv], cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=log, text=True)


def test_openai_client_streams_over_a_unix_socket(tmp_path):
  # a short path: unix socket paths are limited to about 107 bytes
  sock = pathlib.Path(f"/tmp/kda-uds-test-{os.getpid()}.sock")
  log = open(tmp_path / "stderr.log", "w+")
  proc = _serve([f"load_parameters_path={DEMO}", "--uds", str(sock), "max_num_seqs=2", "max_model_len=64",
                 "max_num_batched_tokens=16"], log)
  try:
    deadline = time.monotonic() + START_TIMEOUT_S
    line = ""
    while time.monotonic() < deadline and "listening on" not in line:
      line = proc.stdout.readline()
      if not line and proc.poll() is not None:
        log.seek(0)
        pytest.fail(f"server exited with {proc.returncode}:\n{log.read()}")
    assert line.strip() == f"listening on unix:{sock}"
    assert sock.is_socket()
    assert uds_client.http_client(str(sock)).get("http://localhost/health").status_code == 200
    client = uds_client.openai_client(str(sock))
    prompt = [5, 17, 99, 3, 250, 7]
    whole = client.completions.create(model="demo", prompt=prompt, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    expected = whole.choices[0].model_extra["token_ids"]
    assert len(expected) == 6
    streamed, chunks = [], 0
    for chunk in client.completions.create(model="demo", prompt=prompt, max_tokens=6, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True, "return_token_ids": True}):
      if chunk.choices:
        streamed += chunk.choices[0].model_extra.get("token_ids") or []
        chunks += 1
    assert streamed == expected and chunks >= 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    log.seek(0)
    text = log.read()
    assert re.search(r"compiled 3 step executables in [0-9.]+ s: 3 compiled", text), text
    assert re.search(r"start-up [0-9.]+ s \(compile [0-9.]+ s", text), text
    assert "compilation cache: off" in text     # tests/conftest.py: KDA_COMPILATION_CACHE_DIR=none
    assert not sock.exists()
  finally:
    reap(proc, log)
    sock.unlink(missing_ok=True)


def test_uds_path_that_is_not_a_socket_is_refused_before_loading(tmp_path):
  taken = tmp_path / "file"
  taken.write_text("x")
  log = open(tmp_path / "stderr.log", "w+")
  proc = _serve([f"load_parameters_path={DEMO}", f"uds={taken}"], log)
  assert proc.wait(timeout=300) == 2
  log.seek(0)
  err = log.read()
  assert f"error: uds={str(taken)!r} exists and is not a socket" in err
  assert "loading" not in err
  proc.stdout.close()
  log.close()
