"""A user's own `model` package in the current directory: a clear line naming both packages (for
`import kda_plugin.plugin` and `python -m tools.X`), and the console commands are unaffected.
The choice (keep the design's generic folder names, detect shadowing) is explained in the README."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def _foreign_model(tmp_path: pathlib.Path) -> pathlib.Path:
  (tmp_path / "model").mkdir()
  (tmp_path / "model" / "__init__.py").write_text("WHOSE = 'the user'\n")
  return tmp_path


def _run(argv, cwd):
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"JAX_PLATFORMS": "cpu"}
  return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def test_plugin_import_names_both_packages(tmp_path):
  cwd = _foreign_model(tmp_path)
  r = _run([sys.executable, "-c", "import kda_plugin.plugin"], cwd)
  assert r.returncode != 0
  last = r.stderr.strip().splitlines()[-1]
  assert last == (f"kda_plugin._install.ShadowedPackageError: a package named 'model' at {cwd / 'model'} shadows "
                  f"kda_plugin's 'model' at {REPO / 'model'} (it comes first on sys.path, e.g. from the current "
                  f"directory): run from another directory, or use the console commands (kda-generate, kda-train, "
                  f"...), which do not put the current directory on sys.path"), r.stderr
  assert "ModuleNotFoundError" not in r.stderr


def test_tool_names_both_packages_and_the_console_command_works(tmp_path):
  cwd = _foreign_model(tmp_path)
  r = _run([sys.executable, "-m", "tools.generate", "--help"], cwd)
  assert r.returncode == 2  # the tools' one-line error contract
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"error: a package named 'model' at {cwd / 'model'} shadows"), r.stderr
  assert str(REPO / "model") in lines[0]
  r = _run([str(pathlib.Path(sys.executable).parent / "kda-generate"), "--help"], cwd)
  assert r.returncode == 0 and "load_parameters_path" in r.stdout, r.stderr


def test_ops_alone_do_not_need_the_host(tmp_path):
  """`kda_plugin.ops` imports no host package, so a foreign `model/` does not matter to it."""
  r = _run([sys.executable, "-c", "import kda_plugin.ops; print('ok')"], _foreign_model(tmp_path))
  assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
