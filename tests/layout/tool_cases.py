"""Runs several invocations of one tool in one process, each exactly as `python -m tools.<tool> ARGS`
runs (runpy as `__main__`, `sys.argv` set), with file descriptors 1 and 2 pointed at a file of their
own per invocation, so everything the invocation writes (print, logging, C libraries) is captured.

Usage (tests/layout/test_cli_contract.py): `python -m tests.layout.tool_cases TOOL JSON`, JSON a list of
argument lists; prints one JSON list of {"argv", "code", "stdout", "stderr"} on the original stdout.
One process per tool instead of one per invocation: the jax start-up is paid once.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
import traceback


def _run_one(tool: str, argv: list[str]) -> dict:
  saved = os.dup(1), os.dup(2)
  with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
    sys.argv = [f"-m tools.{tool}", *argv]
    try:
      runpy.run_module(f"tools.{tool}", run_name="__main__", alter_sys=True)
      code = 0
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:   # what the interpreter would print for an uncaught exception, and its status
      traceback.print_exc()
      code = 1
    finally:
      sys.stdout.flush(), sys.stderr.flush()
      os.dup2(saved[0], 1), os.dup2(saved[1], 2)
      os.close(saved[0]), os.close(saved[1])
    out.seek(0), err.seek(0)
    return {"argv": argv, "code": code, "stdout": out.read(), "stderr": err.read()}


def main() -> None:
  tool, cases = sys.argv[1], json.loads(sys.argv[2])
  results = [_run_one(tool, argv) for argv in cases]
  sys.stdout.write(json.dumps(results) + "\n")


if __name__ == "__main__":
  main()
