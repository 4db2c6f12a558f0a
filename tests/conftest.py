"""Shared pytest set-up: CPU only, deterministic hypothesis profile."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tools turn jax's persistent compilation cache on (model/engine/compilation_cache.py); tests do not
# write to the user's ~/.cache: those that check the cache give it a directory of their own.
os.environ.setdefault("KDA_COMPILATION_CACHE_DIR", "none")

# Compiling dominates this suite's time (tiny models, hundreds of distinct XLA:CPU programs). LLVM at -O0
# roughly halves each compile (one Generator call on the demo model: 24.3 -> 15.5 CPU s) and leaves XLA's
# optimised HLO, the graph whose numerics the tests check, unchanged (dumped `after_optimizations` of
# the prefill and decode programs diff empty); only machine-code optimisation is skipped.
# KDA_TEST_XLA_OPT=default tests with XLA's default instead. Compile-venv subprocesses drop the flag
# (tests/aot/helpers/runner.py): their TPU/GPU compiles and memory figures stay the real ones.
TEST_XLA_FLAG = "--xla_backend_optimization_level=0"
if os.environ.get("KDA_TEST_XLA_OPT", "o0") != "default" and TEST_XLA_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAG}".strip()

import gc  # noqa: E402

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.load_profile("ci")


# The longest test files (seconds on a quiet 2-core host, `make test PYTEST_ARGS=--durations=0`):
# started first, so that the two xdist workers (whole files each: Makefile PYTEST_DIST) finish
# together instead of one waiting on a long file dealt last.
LONGEST_FIRST = ("tests/sharding/test_multidevice.py",   # 122 s
                 "tests/model/test_scan_layers.py",       # 91 s
                 "tests/serving/test_continuous.py",      # 75 s
                 "tests/layout/test_cli_contract.py",     # 69 s
                 "tests/kernels/test_inference_numerics.py",  # 64 s
                 "tests/serving/test_server.py")          # 62 s


def _order(item) -> tuple[bool, int]:
  path = item.nodeid.split("::", 1)[0]
  compile_check = bool({"tpu_aot", "tpu_aot_jax0102", "gpu_aot"} & set(getattr(item, "fixturenames", ())))
  return compile_check, LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
  """Runs the longest files first (`LONGEST_FIRST`) and the ahead-of-time compile checks last:
  under `make test` their venvs are still being installed while the rest of the suite runs (the
  Makefile's test_recipe), so running them first would leave the workers waiting. The order is
  otherwise kept (a stable sort)."""
  items.sort(key=_order)


# XLA:CPU maps memory for every compiled program's machine code (three mappings each) and unmaps it
# only when the executable is freed. A test worker that keeps every program of ~600 tests alive reaches
# the kernel's per-process limit (vm.max_map_count, 65530 by default): compiles then fail with "LLVM
# compilation error: Cannot allocate memory" / "Failed to materialize symbols" (seen in CI). Past half
# the limit, the worker drops jax's caches and the engine's executable cache between tests: later
# tests recompile what they need, and no test is slowed before the limit comes near. What fixtures
# still hold stays mapped, so the next release comes halfway between that and the limit (not after
# every test). KDA_TEST_MAX_MAPPINGS=N pretends the limit is N (e.g. a low one, to run the suite with
# releases exercised).
def _max_mappings() -> int | None:
  if os.environ.get("KDA_TEST_MAX_MAPPINGS"):
    return int(os.environ["KDA_TEST_MAX_MAPPINGS"])
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):
    return None   # not Linux: nothing to watch


def _mapping_count() -> int:
  with open("/proc/self/maps", "rb") as f:
    return sum(1 for _ in f)


_MAX_MAPPINGS = _max_mappings()
_next_release = None if _MAX_MAPPINGS is None else _MAX_MAPPINGS // 2
# Reading /proc/self/maps costs ~40 ms at 30,000 mappings, so it is read every CHECK_EVERY tests; a
# test adds at most about a thousand (a few hundred programs), far below half the limit between checks.
CHECK_EVERY = 16
_tests_to_check = CHECK_EVERY


@pytest.fixture(autouse=True)
def _free_compiled_code_near_the_mapping_limit():
  global _next_release, _tests_to_check
  yield
  _tests_to_check -= 1
  if _next_release is None or _tests_to_check > 0:
    return
  _tests_to_check = CHECK_EVERY
  if _mapping_count() > _next_release:
    import jax

    from model.engine import executables
    executables.clear()
    jax.clear_caches()
    gc.collect()
    held = _mapping_count()
    _next_release = held + (_MAX_MAPPINGS - held) // 2
