"""Repository hygiene: file names say what a file is, and comments say why rather than cite where.

A comment that cites an issue number, a commit, a review round or a document outside the repository
stops explaining anything once that context is gone; the fact it stood for belongs in the comment.
Upstream evidence (a library's GitHub issue URL, a file under bench/results/) is fine.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREES = ("src", "tests", "bench", "scripts")

# The packages whose comments are checked: all of them.
CHECKED_PACKAGES = (
    "cli",
    "config",
    "data",
    "infer",
    "launch",
    "memory",
    "models",
    "plan",
    "reliability",
    "templates",
    "train",
    "webui",
)

CITATIONS = {
    "an issue number": re.compile(r"\bissue \d+", re.IGNORECASE),
    "a commit hash": re.compile(r"\b(?:commit|before)\s+[0-9a-f]{7,40}\b", re.IGNORECASE),
    "REFERENCE §": re.compile(r"REFERENCE §"),
    "shared/": re.compile(r"\bshared/"),
    "a seed document": re.compile(r"\bseed 00\d"),
}


def _tree_files() -> list[Path]:
    files = []
    for tree in TREES:
        base = ROOT / tree
        if base.is_dir():
            files += [p for p in base.rglob("*") if "__pycache__" not in p.parts and ".venv" not in p.parts]
    return files


def _checked_sources() -> list[Path]:
    pkg = ROOT / "src" / "lmstack"
    files = sorted(pkg.glob("*.py"))
    for name in CHECKED_PACKAGES:
        files += sorted((pkg / name).rglob("*.py"))
    return files


def test_no_file_is_named_for_a_review_or_a_one_off_call():
    bad = [
        str(p.relative_to(ROOT))
        for p in _tree_files()
        if "review" in p.name.lower() or re.match(r"call_[a-z0-9]*", p.name.lower())
    ]
    assert not bad, f"name these for what they do: {bad}"


def test_the_checked_packages_exist():
    pkg = ROOT / "src" / "lmstack"
    assert all((pkg / name).is_dir() for name in CHECKED_PACKAGES)


@pytest.mark.parametrize("what", sorted(CITATIONS))
def test_no_comment_cites_context_outside_the_repository(what):
    pattern = CITATIONS[what]
    hits = []
    for path in _checked_sources():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, f"comments citing {what}; say why instead:\n" + "\n".join(hits)


def test_no_import_below_code_in_src():
    hits = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in _checked_sources()
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if "noqa: E402" in line
    ]
    assert not hits, f"imports belong at the top of the module: {hits}"
