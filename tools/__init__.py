"""The command-line tools (`kda-*` console commands, or `python -m tools.X` from a checkout).

The root holds the console commands (pyproject `[project.scripts]`) and their shared helpers
(`cli.py`); each parses `key=value` arguments, calls the library in `model/` and prints. The
benchmarks and the serving load generator are scripts under `tools/bench/`. Importing this package first checks that `model` and `configs` are this project's (a
package of the same name in the current directory would shadow them): one clear line instead of a
`ModuleNotFoundError` deep inside.
"""

import sys

from kda_plugin._install import ShadowedPackageError, check_not_shadowed

try:
  check_not_shadowed()
except ShadowedPackageError as e:
  if sys.argv[:1] == ["-m"]:  # `python -m tools.X` (argv[0] is "-m" while runpy finds the module)
    print(f"error: {e}", file=sys.stderr)  # the tools' one-line contract (tools/cli.py)
    raise SystemExit(2) from None
  raise
