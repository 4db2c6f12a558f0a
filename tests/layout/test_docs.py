"""Documentation stays inside the project: nothing outside tests/ points at ../shared, and every
relative link of the README files resolves to a file of the repository."""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".sh", ""}


def _tracked() -> list[pathlib.Path]:
  out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                       capture_output=True, text=True, check=True).stdout.split()
  return [REPO / p for p in out if (REPO / p).is_file()]


def _shared_refs(paths) -> list[str]:
  hits = []
  for path in paths:
    if path.suffix not in TEXT_SUFFIXES or path.stat().st_size > 2_000_000:
      continue
    try:
      text = path.read_text()
    except UnicodeDecodeError:
      continue
    for i, line in enumerate(text.splitlines(), 1):
      if "../shared" in line or "/work/shared" in line:
        hits.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
  return hits


def _outside_tests():
  return [p for p in _tracked() if p.relative_to(REPO).parts[0] != "tests"]


def test_nothing_outside_tests_points_at_shared():
  hits = [h for h in _shared_refs(_outside_tests()) if not h.startswith("kda_plugin/ops/")]
  assert not hits, "references to ../shared outside tests/:\n" + "\n".join(hits)


def test_nothing_in_the_ops_points_at_shared():
  hits = [h for h in _shared_refs(_outside_tests()) if h.startswith("kda_plugin/ops/")]
  assert not hits, "references to ../shared in kda_plugin/ops:\n" + "\n".join(hits)


_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("readme", ["README.md", "model/README.md", "docs/README.md"])
def test_readme_links_resolve(readme):
  path = REPO / readme
  if readme == "docs/README.md" and not path.exists():
    pytest.fail("docs/README.md is missing (the docs/ folder is part of the project)")
  bad = []
  for target in _LINK.findall(path.read_text()):
    if re.match(r"^[a-z]+:", target) or target.startswith("#"):
      continue  # a URL or an anchor in the same file
    file = (path.parent / target.split("#", 1)[0]).resolve()
    if not file.exists() or REPO not in file.parents and file != REPO:
      bad.append(target)
  # Backtick paths that name a project file, e.g. `docs/kda.md`, must exist too.
  for target in re.findall(r"`((?:docs|model|tools|configs|kda_plugin|tests)/[\w./-]+\.(?:md|py))`", path.read_text()):
    if not (REPO / target).exists():
      bad.append(target)
  assert not bad, f"{readme}: links that do not resolve inside the repository: {bad}"


def test_doc_references_in_code_resolve():
  """Every `docs/NAME.md` named outside tests exists, and every "docs/NAME.md section 'Title'" names a
  heading of that file (the docstrings point at sections by title, not by number)."""
  bad = []
  for path in _outside_tests():
    if path.suffix not in {".py", ".md", ".toml"} or path.relative_to(REPO).as_posix().startswith("kda_plugin/ops/"):
      continue  # kda_plugin/ops: see test_nothing_in_the_ops_points_at_shared
    text = path.read_text()
    for name in set(re.findall(r"(?<![\w/.])docs/([\w-]+\.md)", text)):
      if not (REPO / "docs" / name).is_file():
        bad.append(f"{path.relative_to(REPO)}: docs/{name} does not exist")
    for name, title in re.findall(r"(?<![\w/.])docs/([\w-]+\.md)\s+sections?\s+'([^']+)'", text):
      doc = REPO / "docs" / name
      headings = {h.strip() for h in re.findall(r"^#+\s+(.+)$", doc.read_text(), re.M)} if doc.is_file() else set()
      title = " ".join(title.split())  # a title may wrap across lines
      if title not in headings:
        bad.append(f"{path.relative_to(REPO)}: docs/{name} has no section {title!r}")
  assert not bad, "\n".join(bad)


def test_readme_sections_named_in_code_and_docs_exist():
  """Every `README, "Title"` / `README section 'Title'` outside tests names a heading of README.md (tools'
  --help texts point at README sections by title)."""
  headings = {h.strip() for h in re.findall(r"^#+\s+(.+)$", (REPO / "README.md").read_text(), re.M)}
  bad, seen = [], 0
  for path in _outside_tests():
    if path.suffix not in {".py", ".md"} or path.relative_to(REPO).as_posix().startswith("kda_plugin/ops/"):
      continue
    for title in re.findall(r"\bREADME(?:\.md)?(?:,|\s+section)\s+[\"']([^\"']+)[\"']", path.read_text()):
      seen += 1
      if " ".join(title.split()) not in headings:
        bad.append(f"{path.relative_to(REPO)}: README.md has no section {title!r}")
  assert seen and not bad, "\n".join(bad)


def test_readme_lists_every_remat_policy():
  """README's `remat_policy=a|b|...` is the set the config accepts (model.config.REMAT_POLICY_NAMES)."""
  from model.config import REMAT_POLICY_NAMES
  lists = [m for m in re.findall(r"`remat_policy=([\w|\s]+)`", (REPO / "README.md").read_text()) if "|" in m]
  assert len(lists) == 1, f"README.md should list the remat_policy values once, as remat_policy=a|b|...: {lists}"
  assert sorted("".join(lists[0].split()).split("|")) == sorted(REMAT_POLICY_NAMES)


@pytest.mark.parametrize("doc", ["README.md", "docs/serving.md"])
def test_docs_list_every_matmul_precision(doc):
  """README's `matmul_precision=a|b|c` and docs/serving.md's key table name the values the config
  accepts (model.config.MATMUL_PRECISIONS), and configs/base.py's comment does too."""
  from model.config import MATMUL_PRECISIONS
  text = (REPO / doc).read_text()
  if doc == "README.md":
    lists = re.findall(r"`matmul_precision=([\w|]+)`", text)
    assert lists == ["|".join(MATMUL_PRECISIONS)], f"README.md should list the values once: {lists}"
  else:
    row = [line for line in text.splitlines() if line.startswith("| `matmul_precision` |")]
    assert len(row) == 1 and all(f"`{v}`" in row[0] for v in MATMUL_PRECISIONS), row
  line = next(ln for ln in (REPO / "configs" / "base.py").read_text().splitlines() if "c.matmul_precision =" in ln)
  assert all(v in line.split("#", 1)[1] for v in MATMUL_PRECISIONS), line


def test_paths_named_in_docs_exist():
  """Every project file a page of docs/ names in backticks (`model/loading.py`, ...) exists."""
  bad = []
  for page in sorted((REPO / "docs").glob("*.md")):
    for target in set(re.findall(r"`((?:docs|model|tools|configs|kda_plugin|tests)/[\w./-]+\.(?:md|py|sh))`",
                                  page.read_text())):
      if not (REPO / target).exists():
        bad.append(f"docs/{page.name}: {target}")
  assert (REPO / "docs").is_dir() and not bad, f"paths in docs/ that do not exist: {sorted(bad)}"


# ------------------------------------------------------------------------------------------------
# README's Layout table against the tree
# ------------------------------------------------------------------------------------------------
# Rows name paths (first column, in backticks); a directory row names the modules inside it in its
# second column. Under these roots every module and sub-package must be covered: by a row of its own,
# or (for a child of a directory row) by its name in backticks in that row's contents. The other top-
# level folders (configs/, tests/, docs/) need only a row. `python -m tests.layout.test_docs` prints
# what is missing and what is stale, to regenerate the table after modules move.
LAYOUT_ROOTS = ("model", "tools", "kda_plugin")
_CHILD_SUFFIXES = (".py", ".sh")


def layout_rows(text: str | None = None) -> list[tuple[list[str], str]]:
  """`[(paths, contents)]` of README.md's Layout table, paths without a trailing slash."""
  text = (REPO / "README.md").read_text() if text is None else text
  section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
  rows = []
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 2 or not cells[0].startswith("`"):
      continue
    rows.append(([p.rstrip("/") for p in re.findall(r"`([^`]+)`", cells[0])], cells[1]))
  return rows


def _children(directory: pathlib.Path) -> list[str]:
  """Modules (without suffix), scripts and sub-packages of `directory` as a user sees them in the
  tree (tracked or untracked-but-not-ignored files), `__init__.py` and caches left out."""
  rel = directory.relative_to(REPO)
  out = set()
  for path in _tracked():
    parts = path.relative_to(REPO).parts
    if parts[:len(rel.parts)] != rel.parts or len(parts) == len(rel.parts):
      continue
    name = parts[len(rel.parts)]
    if len(parts) > len(rel.parts) + 1:
      out.add(name)  # a sub-directory
    elif name.endswith(_CHILD_SUFFIXES) and name != "__init__.py":
      out.add(name)
  return sorted(out)


def layout_problems(rows=None) -> tuple[list[str], list[str]]:
  """`(missing, stale)`: tree entries the table does not cover, and table entries the tree lacks."""
  rows = layout_rows() if rows is None else rows
  listed = {p for paths, _ in rows for p in paths}
  contents = {p: c for paths, c in rows for p in paths}
  stale = [f"row `{p}`: no such path" for p in sorted(listed) if not (REPO / p).exists()]
  missing = []
  top = sorted({p.relative_to(REPO).parts[0] for p in _tracked() if len(p.relative_to(REPO).parts) > 1
                and not p.relative_to(REPO).parts[0].startswith(".")})
  for name in top:
    if not any(p == name or p.startswith(name + "/") for p in listed):
      missing.append(f"`{name}/`: no row")

  def walk(directory: str):
    row = contents.get(directory)
    named = set(re.findall(r"`([\w.]+)`", row)) if row is not None else set()
    for child in _children(REPO / directory):
      path, stem = f"{directory}/{child}", child.removesuffix(".py")
      if path in listed:
        if (REPO / path).is_dir():
          walk(path)
      elif row is not None and (stem in named or child in named):
        continue
      elif (REPO / path).is_dir() and any(p.startswith(path + "/") for p in listed):
        walk(path)
      else:
        missing.append(f"`{path}`" + (f": not named in the `{directory}/` row" if row is not None else ": no row"))
    if row is not None:  # names in the contents that are no module of the directory (a rename)
      kids = {c.removesuffix(".py") for c in _children(REPO / directory)} | set(_children(REPO / directory))
      for name in sorted(named):
        looks_like_module = re.fullmatch(r"_?[a-z][a-z0-9_]*(\.py|\.sh)?", name) is not None
        if looks_like_module and name not in kids and not any(p == f"{directory}/{name}" for p in listed):
          stale.append(f"`{directory}/` row names `{name}`, which is not in {directory}/")

  for root in LAYOUT_ROOTS:
    walk(root)
  return missing, stale


def test_layout_table_matches_the_tree():
  """Every row's path exists, every module of model/, tools/ and kda_plugin/ (at the table's
  granularity) is listed, and no row names a module that is gone."""
  missing, stale = layout_problems()
  assert not missing and not stale, ("README.md's Layout table does not match the tree "
                                     "(`python -m tests.layout.test_docs` lists it all):\n"
                                     + "\n".join(["missing: " + m for m in missing] + ["stale: " + s for s in stale]))


def test_layout_check_catches_a_missing_and_a_stale_entry():  # the check itself can fail
  rows = [r for r in layout_rows() if r[0] != ["model/loading.py"]]
  rows.append((["model/no_such_module.py"], "nothing"))
  rows = [(paths, c.replace("`scan`", "`no_such_scan`") if paths == ["model/nn"] else c) for paths, c in rows]
  missing, stale = layout_problems(rows)
  assert "`model/loading.py`: no row" in missing and "`model/nn/scan.py`: not named in the `model/nn/` row" in missing
  assert "row `model/no_such_module.py`: no such path" in stale
  assert "`model/nn/` row names `no_such_scan`, which is not in model/nn/" in stale


def test_layout_rows_point_imports_one_way():
  """Top to bottom of the table, a row's modules import only from rows above it (or their own)."""
  from tests.layout.test_imports import MODULES, _graph  # the import walk lives there
  rows = layout_rows()
  order = {}
  for i, (paths, _) in enumerate(rows):
    for p in paths:
      order[p] = i

  def row_of(module: str):
    path = MODULES[module].relative_to(REPO).as_posix()
    best = None
    for p in order:
      if path == p or path.startswith(p + "/") or path.removesuffix("/__init__.py") == p:
        if best is None or len(p) > len(best):
          best = p
    return None if best is None else order[best]

  bad = []
  for module, targets in _graph().items():
    here = row_of(module)
    for target in targets:
      there = row_of(target)
      if here is not None and there is not None and there > here:
        bad.append(f"{module} (row {here}) imports {target} (row {there})")
  assert not bad, "the Layout table's order is not the import order:\n" + "\n".join(sorted(bad))


if __name__ == "__main__":
  problems = layout_problems()
  for kind, items in zip(("missing", "stale"), problems):
    for item in items:
      print(f"{kind}: {item}")
  if not any(problems):
    print("README.md's Layout table matches the tree")
