"""One way to run `tools.serve` as a subprocess for a test module: start it on a free port, wait until
it listens and /health answers 200, hand out a `Server` (the official `openai` client plus raw HTTP),
and kill it afterwards. Used by tests/serving/test_server.py and tests/serving/test_chat.py."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import pathlib
import re
import subprocess
import sys
import time
import urllib.request

REPO = pathlib.Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 600      # load + warm-up compile on a contended 2-core host
HEALTH_TIMEOUT_S = 60


def read_line(stream, pattern, deadline, proc, log):
  """The first line of `stream` matching `pattern` (a re.Match); RuntimeError with the server's stderr
  when it exits first, TimeoutError past `deadline` (time.monotonic())."""
  while time.monotonic() < deadline:
    line = stream.readline()
    if not line:
      if proc.poll() is not None:
        log.seek(0)
        raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read()}")
      continue
    m = re.search(pattern, line)
    if m:
      return m
  raise TimeoutError(f"no line matching {pattern!r} in {START_TIMEOUT_S} s")


class Server:
  """A running server: `client` (openai.OpenAI on its /v1), `get`, `raw` and `metric`."""

  def __init__(self, proc, port):
    import openai
    self.proc, self.port = proc, port
    self.url = f"http://127.0.0.1:{port}"
    self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=300)

  def get(self, path):
    with urllib.request.urlopen(self.url + path, timeout=30) as r:
      return r.status, r.read().decode()

  def raw(self, method, path, body: bytes, headers=None, with_headers=False):
    """(status, parsed JSON body[, response headers]) of one raw request."""
    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
    try:
      conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
      r = conn.getresponse()
      data = r.read()
      out = r.status, json.loads(data) if data else None
      return (*out, {k.lower(): v for k, v in r.getheaders()}) if with_headers else out
    finally:
      conn.close()

  def metric(self, name):
    _, text = self.get("/metrics")
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} missing from /metrics:\n{text}"
    return float(m.group(1))


@contextlib.contextmanager
def running_server(args, log_dir: pathlib.Path):
  """Yields a `Server` running `python -m tools.serve port=0 *args` on CPU (stderr in log_dir/stderr.log,
  a file: a full pipe would block the server); kills it on exit."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  log = open(pathlib.Path(log_dir) / "stderr.log", "w+")
  argv = [sys.executable, "-m", "tools.serve", "port=0", *map(str, args)]
  proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
  try:
    m = read_line(proc.stdout, r"listening on http://127\.0\.0\.1:(\d+)", time.monotonic() + START_TIMEOUT_S,
                  proc, log)
    srv = Server(proc, int(m.group(1)))
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while True:
      try:
        if srv.get("/health")[0] == 200:
          break
      except OSError:
        pass
      assert time.monotonic() < deadline, "/health never answered 200"
      time.sleep(0.2)
    yield srv
  finally:
    reap(proc, log)


def reap(proc, log) -> None:
  """Kills a server process still running, waits for it, and closes its stdout pipe and log file."""
  if proc.poll() is None:
    proc.kill()
  proc.wait(timeout=30)
  proc.stdout.close()
  log.close()
