"""Runs the application under uvicorn on a bound socket, with a SIGTERM drain that exits cleanly.

SIGTERM (or Ctrl-C) starts a drain instead of uvicorn's immediate shutdown: the server stops admitting
(new completions get 503 `draining`, /health 503), waits up to `drain_timeout_s` for the requests the
engine holds to finish, cancels those still running after that, and only then lets uvicorn close the
connections and return. The signal is not re-raised afterwards (uvicorn's default, which would end
the process by the signal instead of exit status 0). A second Ctrl-C forces the exit.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import stat
import sys
import time

import uvicorn

from model.errors import UsageError
from model.server.protocol import plural

CANCEL_GRACE_S = 5.0   # after cancel_all, how long the drain waits for the cancellations to land


def bind(host: str, port: int) -> socket.socket:
  """A listening TCP socket on (host, port); port 0 picks a free one (read it from getsockname()).

  Raises:
    UsageError: the address cannot be bound (in use, not local, no permission), naming host and port.
  """
  try:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, int(port)))
    sock.listen(2048)
  except OSError as e:
    raise UsageError(f"cannot listen on host={host!r} port={port}: {e.strerror or e}") from None
  sock.set_inheritable(True)
  return sock


def bind_unix(path: str) -> socket.socket:
  """A listening unix-domain socket at `path` (where TCP cannot be opened, e.g. the lent TPU machine;
  clients connect with a unix-socket transport: `httpx.HTTPTransport(uds=path)`, `curl --unix-socket`).
  A socket file left by an earlier server that no longer answers is replaced.

  Raises:
    UsageError: naming uds: the path exists and is not a socket, another server answers there, the
      directory is missing, or the path is too long for a unix socket (about 107 bytes).
  """
  path = os.path.abspath(path)
  if os.path.lexists(path):
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
      raise UsageError(f"uds={path!r} exists and is not a socket: give a new path (the server creates the socket)")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
      probe.connect(path)
    except OSError:   # a stale socket file: nobody listens there any more
      os.unlink(path)
    else:
      raise UsageError(f"uds={path!r}: another server is listening there")
    finally:
      probe.close()
  try:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(2048)
  except OSError as e:
    raise UsageError(f"cannot listen on uds={path!r}: {e.strerror or e}") from None
  sock.set_inheritable(True)
  return sock


class DrainingServer(uvicorn.Server):
  """`uvicorn.Server` whose exit signals drain `state` (a `model.server.app.ServerState`) first."""

  def __init__(self, config: uvicorn.Config, state, *, drain_timeout_s: float, on_started=None):
    super().__init__(config)
    self.state, self.drain_timeout_s, self.on_started = state, float(drain_timeout_s), on_started
    self._aloop: asyncio.AbstractEventLoop | None = None
    self._draining = False

  async def startup(self, sockets=None) -> None:
    self._aloop = asyncio.get_running_loop()
    await super().startup(sockets)
    if self.on_started is not None and not self.should_exit:
      self.on_started()

  def handle_exit(self, sig: int, frame) -> None:
    if self._draining:
      if sig == signal.SIGINT:
        self.force_exit = True
      return
    self._draining = True
    self.state.draining = True
    print(f"{signal.Signals(sig).name}: draining ({plural(len(self.state.live), 'request')} in flight)",
          file=sys.stderr, flush=True)
    if self._aloop is None:       # not started yet: nothing to drain
      self.should_exit = True
      return
    self._aloop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

  async def _drain(self) -> None:
    state = self.state
    deadline = time.monotonic() + self.drain_timeout_s
    while state.live and time.monotonic() < deadline:
      await asyncio.sleep(0.05)
    if state.live:
      print(f"drain timeout ({self.drain_timeout_s:g} s): cancelling {plural(len(state.live), 'request')}",
            file=sys.stderr, flush=True)
      state.loop.cancel_all()
      deadline = time.monotonic() + CANCEL_GRACE_S
      while state.live and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)      # the handlers write their last bytes
    self.should_exit = True


def serve(app, state, sock: socket.socket, *, drain_timeout_s: float = 30.0, on_started=None,
          log_level: str = "warning") -> None:
  """Serves `app` on `sock` until a drain (see the module docstring) ends; returns normally."""
  config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="off",
                          timeout_graceful_shutdown=max(1, int(drain_timeout_s)))
  DrainingServer(config, state, drain_timeout_s=drain_timeout_s, on_started=on_started).run(sockets=[sock])
