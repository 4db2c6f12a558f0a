"""Shared pytest set-up: CPU only, deterministic hypothesis profile."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.load_profile("ci")


def pytest_collection_modifyitems(config, items):
  """Runs the ahead-of-time compile checks last: under `make test` their venvs are still being
  installed while the rest of the suite runs (the Makefile's test_recipe), so running them first
  would leave the workers waiting. The order is otherwise kept (a stable sort)."""
  items.sort(key=lambda item: bool({"tpu_aot", "gpu_aot"} & set(getattr(item, "fixturenames", ()))))
