"""Shared pytest set-up: CPU only, deterministic hypothesis profile."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Compiling dominates this suite's time (tiny models, hundreds of distinct XLA:CPU programs). LLVM at -O0
# roughly halves each compile (one Generator call on the demo model: 24.3 -> 15.5 CPU s) and leaves XLA's
# optimised HLO, the graph whose numerics the tests check, unchanged (dumped `after_optimizations` of
# the prefill and decode programs diff empty); only machine-code optimisation is skipped.
# KDA_TEST_XLA_OPT=default tests with XLA's default instead. Compile-venv subprocesses drop the flag
# (tests/aot/runner.py): their TPU/GPU compiles and memory figures stay the real ones.
TEST_XLA_FLAG = "--xla_backend_optimization_level=0"
if os.environ.get("KDA_TEST_XLA_OPT", "o0") != "default" and TEST_XLA_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAG}".strip()

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.load_profile("ci")


def pytest_collection_modifyitems(config, items):
  """Runs the ahead-of-time compile checks last: under `make test` their venvs are still being
  installed while the rest of the suite runs (the Makefile's test_recipe), so running them first
  would leave the workers waiting. The order is otherwise kept (a stable sort)."""
  items.sort(key=lambda item: bool({"tpu_aot", "gpu_aot"} & set(getattr(item, "fixturenames", ()))))
