"""The package's layering, as a user of each room sees it (the import-linter contracts in
pyproject.toml check the static imports; these check what a fresh interpreter really loads)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "raggedfsdp"

#: What torchrun's worker (``python -m raggedfsdp.train``) imports.
WORKER_MODULES = (
    "raggedfsdp.train",
    "raggedfsdp.train.__main__",
    "raggedfsdp.train.job",
    "raggedfsdp.train.build",
    "raggedfsdp.train.config",
    "raggedfsdp.train.checkpoints",
    "raggedfsdp.train.run_dir",
    "raggedfsdp.train.monitor",
    "raggedfsdp.train.health",
    "raggedfsdp.train.step",
    "raggedfsdp.train.preemption",
    "raggedfsdp.train.failures",
)
#: Launcher-side code a worker must never pay for (the bench, the plan report, the commands
#: and their tables, the launch, the run-folder lock and the rendezvous store), as packages or
#: modules.
LAUNCHER_PREFIXES = (
    "raggedfsdp.bench",
    "raggedfsdp.cli",
    "raggedfsdp.capacity.report",
    "raggedfsdp.train.launch",
    "raggedfsdp.train.run_lock",
    "raggedfsdp.train.rendezvous",
)


def _loaded_after_importing(modules: tuple[str, ...]) -> list[str]:
    """The raggedfsdp modules a fresh interpreter holds after importing ``modules``."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {list(modules)!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('raggedfsdp'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _launcher_modules(loaded: list[str]) -> list[str]:
    return [m for m in loaded if any(m == p or m.startswith(f"{p}.") for p in LAUNCHER_PREFIXES)]


def test_worker_loads_no_launcher_bench_or_plan_report_code() -> None:
    loaded = _loaded_after_importing(WORKER_MODULES)
    assert "raggedfsdp.train.job" in loaded and "raggedfsdp.runtime" in loaded
    assert _launcher_modules(loaded) == []


def test_the_command_does_load_them() -> None:
    """Negative control: the same check sees launcher code when it is there."""
    loaded = _loaded_after_importing(("raggedfsdp.cli",))
    assert {"raggedfsdp.bench", "raggedfsdp.capacity.report", "raggedfsdp.train.launch"} <= set(
        _launcher_modules(loaded)
    )


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_is_small(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= 600


def _long_functions(path: Path, limit: int = 60) -> list[str]:
    """Functions over ``limit`` lines whose docstring gives no reason ("long by nature")."""
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            doc = ast.get_docstring(node) or ""
            if length > limit and "long by nature" not in doc.lower():
                out.append(f"{node.name} ({length} lines)")
    return out


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_functions_are_short(path: Path) -> None:
    assert _long_functions(path) == []


#: The most lines a module docstring may have: what the module holds and why, the first line
#: a one-sentence summary; design notes live at the code they explain.
DOCSTRING_LINES = 8


def _docstring_problems(source: str) -> list[str]:
    """What is wrong with the module docstring in ``source``: over :data:`DOCSTRING_LINES` lines,
    or a summary that runs past its first line."""
    doc = ast.get_docstring(ast.parse(source), clean=False) or ""
    lines = doc.splitlines()
    problems = [f"{len(lines)} lines"] if len(lines) > DOCSTRING_LINES else []
    if len(lines) > 1 and lines[1].strip():
        problems.append("summary over one line")
    return problems


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_docstring_is_short(path: Path) -> None:
    assert _docstring_problems(path.read_text()) == []


def test_a_long_module_docstring_is_seen() -> None:
    """Negative controls: a nine-line docstring, and a summary wrapped onto a second line."""
    nine = '"""Summary.\n\n' + "\n".join(f"line {i}" for i in range(7)) + '"""\nx = 1\n'
    assert _docstring_problems(nine) == ["9 lines"]
    assert _docstring_problems('"""A summary\nwrapped."""\n') == ["summary over one line"]
    assert _docstring_problems('"""Summary.\n\nBody."""\n') == []


ROOT = PACKAGE.parents[1]
#: A citation: one or more notes (joined by "and") and the file they are in.
_CITATION = re.compile(
    r"((?:\[Note: [^\]]+\](?:\s+and\s+)?)+)\)?,?\s+in\s+`*([\w/.]+\.py)\b", re.MULTILINE
)
_NOTE = re.compile(r"\[Note: ([^\]]+)\]")


def _flat(text: str) -> str:
    """``text`` with line breaks, and the comment markers that follow them, as single spaces."""
    return re.sub(r"\s*\n\s*(?:#:?\s*)?", " ", text)


def _cited_file(cited: str, citing: Path) -> list[Path]:
    """The files a citation's path may name: beside the citing module first, else any module of
    the package whose path ends with it."""
    beside = citing.parent / cited
    if citing.is_relative_to(PACKAGE) and beside.is_file():
        return [beside]
    return [p for p in _modules() if str(p).endswith(f"/{cited}")]


def _holds(text: str, note: str) -> bool:
    """Whether ``text`` defines ``[Note: note]``: the note opens a line (of prose, a docstring or
    a comment) and names no file after it, where a citation sits inside a sentence or does."""
    name = r"\s+(?:#:?\s*)?".join(map(re.escape, note.split()))
    cites = r"\)?,?\s+in\s+`*[\w/.]+\.py"
    return re.search(rf"^[ \t#:\"]*\[Note: {name}\](?!{cites})", text, re.MULTILINE) is not None


def _broken_citations(text: str, citing: Path) -> list[str]:
    """Each ``[Note: NAME] in path`` in ``text`` whose file does not define ``[Note: NAME]``."""
    broken = []
    for notes, cited in _CITATION.findall(_flat(text)):
        held = [p.read_text() for p in _cited_file(cited, citing)]
        broken += [
            f"{n} in {cited}" for n in _NOTE.findall(notes) if not any(_holds(t, n) for t in held)
        ]
    return broken


def _citing_files() -> list[Path]:
    return [*_modules(), *sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]


@pytest.mark.parametrize("path", _citing_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_notes_are_where_cited(path: Path) -> None:
    """Every ``[Note: NAME] in path`` names a file that defines the note (its name opening a
    line). The forms read: ``[Note: A] in path`` and ``[Note: A] and [Note: B] in path``, with an
    optional ``)`` or ``,`` before ``in``; the path bare or in single or double backquotes,
    beside the citing module first, else any module of the package ending with it; the names free
    to wrap across lines of prose, ``#``/``#:`` comments or markdown."""
    assert _broken_citations(path.read_text(), path) == []


def test_a_citation_to_the_wrong_file_is_seen() -> None:
    """Negative control: a note cited in a file that only cites it, and one in a file without it;
    the note cited where it is defined passes."""
    text = (
        "([Note: streams and events] in ``_comm.py``), [Note: one strategy per\n"
        "    #: bucket] and [Note: streams and events] in `runtime/_streams.py`"
    )
    assert _broken_citations(text, PACKAGE / "runtime" / "_hooks.py") == [
        "streams and events in _comm.py",
        "one strategy per bucket in runtime/_streams.py",
    ]
