"""The one engine-loop thread: it owns the engine (and so the device); request handlers only enqueue.

Handlers call `submit(request, sink)` and `cancel(request_id)` from any thread (the asyncio event
loop's, in the server); both put a command on a queue. The loop thread applies the queued commands,
runs `engine.step`, and hands every `TokenEvent` to the request's `sink` (the server's sink puts it on
the request's asyncio queue with `loop.call_soon_threadsafe`). A request whose `add_request` raised
gets the exception instead of events. A failing step (a bug, or the device out of memory) fails the
requests it held, not the server: they get the exception, are cancelled in the engine, and the loop
goes on.

Engines that run long steps (the static batcher runs a whole group per step) may expose a `poll`
attribute: the loop sets it to its command drain, which the engine calls between decode chunks, so a
cancellation reaches a request that is mid-group.
"""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from collections.abc import Callable

from model.engine.api import Engine, EngineStats, Request, TokenEvent

Sink = Callable[[object], None]   # receives TokenEvents, or one Exception


class EngineLoop:
  """Runs `engine` on a thread of its own (see the module docstring).

  Args:
    engine: a `model.engine.api.Engine`.
    idle_wait_s: how long an idle loop waits for a command before looking again (seconds).
  """

  def __init__(self, engine: Engine, *, idle_wait_s: float = 0.5):
    self.engine = engine
    self._commands: queue.SimpleQueue = queue.SimpleQueue()
    self._sinks: dict[str, Sink] = {}
    self._lock = threading.Lock()
    self._pending_adds = 0
    self._idle_wait_s = float(idle_wait_s)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
    self.snapshot: EngineStats = engine.stats()
    if hasattr(engine, "poll"):
      engine.poll = self._apply_commands

  # --- any thread ---------------------------------------------------------------------------------
  def start(self) -> None:
    self._thread.start()

  def submit(self, request: Request, sink: Sink) -> None:
    """Queues `request`; its events (or the exception add_request raised) go to `sink`."""
    with self._lock:
      self._pending_adds += 1
    self._commands.put(("add", request, sink))

  def cancel(self, request_id: str) -> None:
    """Queues a cancellation (unknown or finished ids are ignored)."""
    self._commands.put(("cancel", request_id))

  def cancel_all(self) -> None:
    """Queues a cancellation of every live request."""
    self._commands.put(("cancel_all",))

  def num_waiting(self) -> int:
    """Requests that will wait for a slot: those the engine holds without one and those queued to
    the loop but not yet added, beyond the free slots they take at the next step (a burst on an
    idle server is not waiting: it fills the slots first)."""
    with self._lock:
      s = self.snapshot
      return max(0, s.num_waiting + self._pending_adds - s.num_free_slots)

  def stop(self, timeout: float | None = 10.0) -> None:
    """Stops the thread after its current step (live requests get no more events)."""
    self._stop.set()
    self._commands.put(("wake",))
    if self._thread.is_alive():
      self._thread.join(timeout)

  @property
  def alive(self) -> bool:
    return self._thread.is_alive()

  # --- the loop thread ----------------------------------------------------------------------------
  def _emit(self, event: TokenEvent) -> None:
    sink = self._sinks.get(event.request_id)
    if sink is None:
      return
    if event.finish_reason is not None:
      del self._sinks[event.request_id]
    self._deliver(sink, event)

  @staticmethod
  def _deliver(sink: Sink, item) -> None:
    try:
      sink(item)
    except Exception:  # the handler's event loop is gone (shutdown): nobody to tell
      pass

  def _apply(self, command) -> None:
    kind = command[0]
    if kind == "add":
      _, request, sink = command
      with self._lock:
        self._pending_adds -= 1
      try:
        self.engine.add_request(request)
      except Exception as e:  # GenerationError (the schema should have caught it) or a bug: the caller's
        self._deliver(sink, e)
        return
      self._sinks[request.request_id] = sink
    elif kind == "cancel":
      self.engine.cancel(command[1])
    elif kind == "cancel_all":
      for rid in list(self._sinks):
        self.engine.cancel(rid)

  def _apply_commands(self, block: bool = False) -> None:
    # Also the engine's `poll` inside a long step: the snapshot is refreshed even with no command, so
    # /metrics sees the running group.
    try:
      command = self._commands.get(timeout=self._idle_wait_s) if block else self._commands.get_nowait()
    except queue.Empty:
      command = None
    while command is not None:
      self._apply(command)
      try:
        command = self._commands.get_nowait()
      except queue.Empty:
        command = None
    self._refresh()

  def _refresh(self) -> None:
    stats = self.engine.stats()
    with self._lock:
      self.snapshot = stats

  def _fail_all(self, error: Exception) -> None:
    for rid, sink in list(self._sinks.items()):
      self._deliver(sink, error)
      try:
        self.engine.cancel(rid)
      except Exception:
        pass
    self._sinks.clear()

  def _run(self) -> None:
    while not self._stop.is_set():
      self._apply_commands(block=not self.engine.has_unfinished())
      if self._stop.is_set() or not self.engine.has_unfinished():
        continue
      try:
        self.engine.step(self._emit)
      except Exception as e:
        print(f"engine step failed; its requests are failed, the server goes on:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        self._fail_all(e)
        try:  # drain the engine's cancellation events
          while self.engine.has_unfinished():
            self.engine.step(self._emit)
        except Exception:
          pass
      self._refresh()
