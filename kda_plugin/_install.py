"""Detects a foreign `model`, `configs` or `tools` package that shadows this project's.

The project installs three generic top-level packages beside `kda_plugin` (the design's folders,
kept so that `python -m tools.generate` works from a checkout). A directory that holds its own
`model/` (or `configs/`, `tools/`) package and comes first on `sys.path` (the current directory,
with `python -c`, `python -m` or a notebook) would otherwise break us with a confusing
`ModuleNotFoundError: No module named 'model.data'`. `check_not_shadowed()` runs before anything
imports the host (`kda_plugin.plugin`, `tools/__init__.py`) and raises one line naming both paths.
The console commands (`kda-generate`, ...) do not put the current directory on `sys.path`, so they
are not affected.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

PACKAGES = ("model", "configs", "tools")
ROOT = pathlib.Path(__file__).resolve().parent.parent  # where kda_plugin and its sibling packages live


class ShadowedPackageError(ImportError):
  """Another package of the same name as one of ours comes first on `sys.path`."""


def _location(name: str) -> pathlib.Path | None:
  module = sys.modules.get(name)
  if module is not None:
    paths = list(getattr(module, "__path__", []) or [])
    origin = getattr(module, "__file__", None)
  else:
    spec = importlib.util.find_spec(name)
    if spec is None:
      return None
    paths = list(spec.submodule_search_locations or [])
    origin = spec.origin
  if paths:
    return pathlib.Path(paths[0]).resolve()
  return pathlib.Path(origin).resolve() if origin else None


def check_not_shadowed(names=PACKAGES) -> None:
  """Raises `ShadowedPackageError` when `import <name>` (for each of `names`) would not give this
  project's package: one line, naming the foreign package's path and ours."""
  for name in names:
    ours = ROOT / name
    if not (ours / "__init__.py").is_file():
      continue  # not installed beside us (e.g. a wheel without the tools): nothing to shadow
    found = _location(name)
    if found is not None and found != ours.resolve():
      raise ShadowedPackageError(
          f"a package named {name!r} at {found} shadows kda_plugin's {name!r} at {ours} (it comes first on "
          f"sys.path, e.g. from the current directory): run from another directory, or use the console "
          f"commands (kda-generate, kda-train, ...), which do not put the current directory on sys.path")
