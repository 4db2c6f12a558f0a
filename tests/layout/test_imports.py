"""The import graph of the package modules: no cycle, imports pointing one way, function-body imports
only with a reason written next to them.

Layers (each imports only from those before it): configs -> model.errors -> model.atomic ->
model.partitioning -> model.config -> model.nn / model.checkpoint -> model.loading -> model.engine /
model.training / model.hf -> tools. The host `model/` imports nothing from `tools/` or `kda_plugin/`.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("kda_plugin", "model", "configs", "tools")
# Owned by the kernel issues, which run alongside (the ops and their benchmark): their function-body
# imports are theirs to judge (the cycle and layering checks below still cover them).
NOT_OURS: tuple[str, ...] = ()


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for pkg in PACKAGES:
    for path in sorted((REPO / pkg).rglob("*.py")):
      rel = path.relative_to(REPO).with_suffix("")
      parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
      out[".".join(parts)] = path
  return out


MODULES = _modules()


def _resolve(name: str, current: str, level: int, is_package: bool) -> str:
  if level:
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    name = ".".join(base + ([name] if name else []))
  return name


def _targets(node, current: str, is_package: bool) -> list[str]:
  """The package modules an import statement loads (the most specific module of each name)."""
  out = []
  if isinstance(node, ast.Import):
    names = [a.name for a in node.names]
  else:
    mod = _resolve(node.module or "", current, node.level, is_package)
    names = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
  for name in names:
    while name and name not in MODULES:
      name = name.rpartition(".")[0]
    if name:
      out.append(name)
  return out


def _imports(module: str):
  """`(target, lineno, in_function)` for every import of a package module in `module`."""
  path = MODULES[module]
  tree = ast.parse(path.read_text(), str(path))
  is_package = path.name == "__init__.py"
  found = []

  def visit(node, in_function):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.Import, ast.ImportFrom)):
        for target in _targets(child, module, is_package):
          found.append((target, child.lineno, in_function))
        if in_function:
          found.append((None, child.lineno, True))  # every function-body import, for the reason check
      visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

  visit(tree, False)
  return found


def _graph() -> dict[str, set[str]]:
  return {m: {t for t, _, _ in _imports(m) if t is not None and t != m} for m in MODULES}


def _cycle(graph) -> list[str] | None:
  state: dict[str, int] = {}
  stack: list[str] = []

  def dfs(node):
    state[node] = 1
    stack.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 1:
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        found = dfs(nxt)
        if found:
          return found
    stack.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state:
      found = dfs(node)
      if found:
        return found
  return None


def test_the_walk_sees_every_layer():
  graph = _graph()
  assert {"model.loading", "model.partitioning", "model.nn.kimi_linear", "tools.cli", "kda_plugin.plugin"} <= set(graph)
  assert "model.checkpoint.format" in graph["model.loading"] and "model.partitioning" in graph["model.nn.kda"]
  assert "model.loading" in graph["model.hf.convert"] and "model.checkpoint.checksums" in graph["model.checkpoint.format"]


def test_no_import_cycle():
  cycle = _cycle(_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_cycle_is_detected():  # the check itself can fail
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


@pytest.mark.parametrize("lower, forbidden", [
    ("model", ("tools", "kda_plugin")),  # the host never imports the tools or the plugin
    ("configs", ("model", "tools", "kda_plugin")),
    ("model.partitioning", ("model.nn", "model.loading", "model.checkpoint", "model.engine", "model.training")),
    ("model.checkpoint.format", ("model.nn", "model.loading", "model.engine", "model.training")),
    # The checkpoint package is the on-disk format only: no model loading, no HF interchange above it.
    ("model.checkpoint", ("model.nn", "model.loading", "model.hf", "model.engine", "model.training",
                          "model.server", "model.data")),
    ("model.atomic", ("model.config", "model.partitioning", "model.nn", "model.checkpoint", "model.loading")),
    ("model.loading", ("model.hf", "model.engine", "model.training", "model.server")),
    ("model.nn", ("model.loading", "model.checkpoint", "model.engine", "model.training", "model.data")),
])
def test_imports_point_one_way(lower, forbidden):
  bad = [(m, t) for m, targets in _graph().items() if m == lower or m.startswith(lower + ".")
         for t in targets if any(t == f or t.startswith(f + ".") for f in forbidden)]
  assert not bad, f"{lower} must not import {forbidden}: {bad}"


def test_function_body_imports_say_why():
  """An import inside a function needs its reason on its line or the comment line(s) just above."""
  bad = []
  for module, path in MODULES.items():
    rel = path.relative_to(REPO).as_posix()
    if rel.startswith(NOT_OURS):
      continue
    lines = path.read_text().splitlines()
    for lineno in sorted({n for _, n, f in _imports(module) if f}):
      line = lines[lineno - 1]
      i = lineno - 2  # the first line above this run of import lines must be the comment
      while i >= 0 and lines[i].strip().startswith(("import ", "from ")) and "#" not in lines[i]:
        i -= 1
      if "#" not in line and not (i >= 0 and (lines[i].strip().startswith("#") or
                                              lines[i].strip().startswith(("import ", "from ")))):
        bad.append(f"{rel}:{lineno}: {line.strip()}")
  assert not bad, "function-body imports without a reason:\n" + "\n".join(bad)
