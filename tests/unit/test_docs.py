"""The repository's prose stands on its own: it cites only files inside the repository, its
guides stay short enough to read, and its markdown links lead somewhere.

- Nothing under src/, tests/, docs/, benchmarks/, experiments/, tools/ or README.md names the
  founding notes that live outside the repository; the contract they held is docs/design.md,
  the published figures docs/references.md.
- Every guide (``docs/*.md``, not the measurement logs in docs/results/) has at most 2,000 words.
- Every relative link in README.md and docs/**/*.md resolves to an existing file, and its
  ``#anchor``, if any, to a heading of that page.
- Every citation of a section of docs/design.md in the code (``docs/design.md, "Section"`` or
  ``docs/design.md ("Section")``) names one of its headings.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: What may be cited only inside the repository: the founding notes outside it.
OUTSIDE_NAMES = ("DESIGN.md", "REFERENCES.md", "STYLE.md", "../shared")
#: Where the repository's own text lives.
SCANNED = ("src", "tests", "docs", "benchmarks", "experiments", "tools", "README.md")
#: Generated or binary content: not the repository's prose.
SKIPPED_DIRS = {"__pycache__"}
SKIPPED_SUFFIXES = {".png", ".pyc", ".so"}
#: This file spells out the names it forbids and a section it cites as an example: both scans
#: skip it.
THIS_FILE = Path(__file__).resolve()

MAX_GUIDE_WORDS = 2000

_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#+ (.*)$", re.MULTILINE)
_DESIGN_CITATION = re.compile(r'docs/design\.md(?:, | \()"([^"]+)"')


def word_count(text: str) -> int:
    """Words as a reader meets them: whitespace-separated tokens."""
    return len(text.split())


def outside_citations(roots: list[Path]) -> list[str]:
    """``path:line: name`` for each line under ``roots`` that names a file outside the repo."""
    found = []
    for root in roots:
        files = [root] if root.is_file() else sorted(root.rglob("*"))
        for path in files:
            if (
                not path.is_file()
                or path.resolve() == THIS_FILE
                or path.suffix in SKIPPED_SUFFIXES
                or any(part in SKIPPED_DIRS or part.endswith(".egg-info") for part in path.parts)
            ):
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            for number, line in enumerate(text.splitlines(), 1):
                found += [f"{path}:{number}: {name}" for name in OUTSIDE_NAMES if name in line]
    return found


def headings(page: Path) -> list[str]:
    """The headings of a markdown page, outside code blocks."""
    return _HEADING.findall(_FENCE.sub("", page.read_text(encoding="utf-8")))


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(page: Path) -> list[str]:
    """The relative link targets of a markdown page (outside code) that name no existing file,
    or an anchor that no heading of the markdown page they name gives."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", page.read_text(encoding="utf-8")))
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # a URL
        path, _, fragment = target.partition("#")
        linked = page.parent / path if path else page
        if not linked.exists() or (
            fragment != ""
            and linked.suffix == ".md"
            and fragment not in {anchor(h) for h in headings(linked)}
        ):
            broken.append(target)
    return broken


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_nothing_cites_a_file_outside_the_repository() -> None:
    assert outside_citations([REPO / name for name in SCANNED]) == []


def test_the_scan_finds_an_outside_citation(tmp_path: Path) -> None:
    # Negative control: a file naming the founding notes, one that does not, a skipped folder.
    (tmp_path / "a.py").write_text("x = 1\n# see DESIGN.md, 'Public API'\n")
    (tmp_path / "b.md").write_text("see [design](docs/design.md)\n")
    (tmp_path / "pkg.egg-info").mkdir()
    (tmp_path / "pkg.egg-info" / "PKG-INFO").write_text("REFERENCES.md\n")
    assert outside_citations([tmp_path]) == [f"{tmp_path / 'a.py'}:2: DESIGN.md"]


def test_word_count_counts_whitespace_separated_words() -> None:
    assert word_count("one two\tthree\n\nfour  `five`") == 5
    assert word_count("") == 0


@pytest.mark.parametrize("guide", sorted((REPO / "docs").glob("*.md")), ids=lambda p: p.name)
def test_guide_is_at_most_2000_words(guide: Path) -> None:
    words = word_count(guide.read_text(encoding="utf-8"))
    assert words <= MAX_GUIDE_WORDS, f"{guide.name}: {words} words (at most {MAX_GUIDE_WORDS})"


def test_every_guide_is_checked() -> None:
    # The guides the project names, so a misplaced glob cannot check nothing.
    names = {p.name for p in (REPO / "docs").glob("*.md")}
    assert {"design.md", "architecture.md", "runtime.md", "planner.md"} <= names


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


def test_the_link_check_finds_a_broken_link(tmp_path: Path) -> None:
    # Negative control: good links and anchors, a missing file, a missing anchor on each page,
    # a URL, and links inside code, which are not links.
    (tmp_path / "there.md").write_text("# There\n\n## The model, in full (W=2)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Here\n[ok](there.md#there) [ok](there.md#the-model-in-full-w2) [ok](#here)\n"
        "[gone](missing.md) [no](there.md#nowhere) [no](#nowhere) [web](https://e.com/x.md)\n"
        "`[code](nowhere.md)`\n```\n[fenced](nowhere-either.md)\n```\n"
    )
    assert broken_links(page) == ["missing.md", "there.md#nowhere", "#nowhere"]


def design_citations(roots: list[Path]) -> list[tuple[str, str]]:
    """``(where, section)`` for each citation of a section of docs/design.md under ``roots``."""
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if path.resolve() == THIS_FILE:
                continue
            text = path.read_text(encoding="utf-8")
            found += [(str(path), section) for section in _DESIGN_CITATION.findall(text)]
    return found


def test_cited_sections_of_the_design_exist() -> None:
    sections = set(headings(REPO / "docs" / "design.md"))
    cited = design_citations([REPO / name for name in ("src", "tests", "benchmarks")])
    assert cited, "the scan found no citation: its pattern no longer matches the code's form"
    assert [(where, s) for where, s in cited if s not in sections] == []


def test_the_citation_scan_reads_both_forms(tmp_path: Path) -> None:
    # Negative control: both citation forms are found, so a section renamed in docs/design.md
    # cannot hide behind a pattern that reads nothing.
    (tmp_path / "m.py").write_text(
        '# see docs/design.md, "Benchmark protocol"\n"""As docs/design.md ("No such section")."""\n'
    )
    sections = set(headings(REPO / "docs" / "design.md"))
    cited = design_citations([tmp_path])
    assert [s for _, s in cited] == ["Benchmark protocol", "No such section"]
    assert [s for _, s in cited if s not in sections] == ["No such section"]
