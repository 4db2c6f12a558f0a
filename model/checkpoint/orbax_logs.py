"""Orbax's log output around checkpoint reads, filtered to what a user needs.

`held_absl_warnings` holds back the multi-line warnings Orbax logs through absl, so that the reader
can turn them into one error line; `quiet_orphaned_reads` drops the asyncio noise of the reads a
failed Orbax load abandons. Used by model/checkpoint/format.py's readers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import sys


@contextlib.contextmanager
def held_absl_warnings():
  """Holds back the records Orbax logs through absl (logger 'absl') in the block and yields them as
  a list: Orbax reports an unreadable array metadata as a multi-line WARNING (with the TensorStore
  spec) and returns None; the caller turns that into one error line or passes the records on."""
  held: list = []

  class _Hold(logging.Filter):
    def filter(self, record):
      held.append(record)
      return False

  log, hold = logging.getLogger("absl"), _Hold()
  log.addFilter(hold)
  try:
    yield held
  finally:
    log.removeFilter(hold)



# When one array of an Orbax load fails, Orbax closes its event loop while TensorStore still reads the
# other arrays; as each of those reads completes, its callback hits the closed loop and Python prints
# a "RuntimeError: Event loop is closed" traceback through sys.unraisablehook (dozens of them, some
# after the load has raised), plus "Exception ignored in <coroutine ...>" for the abandoned Orbax
# coroutines and asyncio's "... exception was never retrieved" log records. They carry no
# information beyond the error already raised. `quiet_orphaned_reads` drops exactly these (matched
# by type, message and the Orbax/event-loop frames they come from); anything else goes to the hooks
# that were there before. After a successful load the filter is removed and whatever it held back
# is passed on; after a failed one it stays (the stragglers arrive later) but still only drops those.
_filter_state: dict = {"previous": None, "held": None, "failed": False, "paths": set()}


def _in_orbax(tb) -> bool:
  while tb is not None:
    if f"{os.sep}orbax{os.sep}" in tb.tb_frame.f_code.co_filename:
      return True
    tb = tb.tb_next
  return False


def _is_orphan_noise(exc: BaseException | None, obj=None) -> bool:
  if exc is None:
    return False
  if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
      tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_name.endswith("_check_closed")
  code = getattr(obj, "cr_code", None)
  if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
    return True
  # TensorStore's own read errors (asyncio tasks around its futures) name the checkpoint's files.
  return _in_orbax(exc.__traceback__) or any(path in str(exc) for path in _filter_state["paths"])


def _unraisable_hook(unraisable) -> None:
  if _is_orphan_noise(unraisable.exc_value, unraisable.object):
    if _filter_state["held"] is not None:
      _filter_state["held"].append(unraisable)
    return
  (_filter_state["previous"] or sys.__unraisablehook__)(unraisable)


class _AsyncioNoise:
  """logging.Filter for the 'asyncio' logger: drops unretrieved-exception records of Orbax reads."""

  def filter(self, record) -> bool:
    if not record.exc_info or not _is_orphan_noise(record.exc_info[1]):
      return True
    if _filter_state["held"] is not None:
      _filter_state["held"].append(record)
    return False


_asyncio_filter = _AsyncioNoise()


@contextlib.contextmanager
def quiet_orphaned_reads(params_dir: pathlib.Path):
  log = logging.getLogger("asyncio")
  if sys.unraisablehook is not _unraisable_hook:
    _filter_state["previous"] = sys.unraisablehook
    sys.unraisablehook = _unraisable_hook
  log.addFilter(_asyncio_filter)  # no-op when already there
  held: list = []
  _filter_state["held"] = held
  _filter_state["paths"].add(os.fspath(params_dir))
  try:
    yield
  except BaseException:
    _filter_state.update(held=None, failed=True)  # keep dropping the stragglers for good
    raise
  _filter_state["held"] = None
  _filter_state["paths"].discard(os.fspath(params_dir))
  if not _filter_state["failed"]:  # no earlier failure left stragglers behind: take the filter off
    if sys.unraisablehook is _unraisable_hook:
      sys.unraisablehook = _filter_state["previous"] or sys.__unraisablehook__
    log.removeFilter(_asyncio_filter)
  for item in held:  # this load succeeded, so these were no leftovers of a failure: show them
    if isinstance(item, logging.LogRecord):
      logging.getLogger(item.name).handle(item)
    else:
      (_filter_state["previous"] or sys.__unraisablehook__)(item)
