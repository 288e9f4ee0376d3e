"""The package's layering, as a user of each room sees it (the import-linter contracts in
pyproject.toml check the static imports; these check what a fresh interpreter really loads)."""

from __future__ import annotations

import ast
import json
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
