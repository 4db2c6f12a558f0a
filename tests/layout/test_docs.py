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


def test_paths_named_in_docs_exist():
  """Every project file a page of docs/ names in backticks (`model/loading.py`, ...) exists."""
  bad = []
  for page in sorted((REPO / "docs").glob("*.md")):
    for target in set(re.findall(r"`((?:docs|model|tools|configs|kda_plugin|tests)/[\w./-]+\.(?:md|py|sh))`",
                                  page.read_text())):
      if not (REPO / target).exists():
        bad.append(f"docs/{page.name}: {target}")
  assert (REPO / "docs").is_dir() and not bad, f"paths in docs/ that do not exist: {sorted(bad)}"
