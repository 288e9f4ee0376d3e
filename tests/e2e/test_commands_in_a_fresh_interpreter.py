"""The ``raggedfsdp`` commands as a user runs them, in a fresh interpreter: ``plan`` through
``python -m raggedfsdp.cli`` (JSON on success, one line and status 2 on error), and ``train``
refusing in one line, before any worker starts, a run whose memory no rank has. (The same
commands in this process: tests/unit/test_cli_plan.py and
tests/unit/test_train_preflight_memory.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from launches import run_cli

SRC = Path(__file__).resolve().parents[2] / "src"


def _module_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    return env


def test_module_entry_point() -> None:
    """The real command in a fresh interpreter: JSON on success, one line and 2 on error."""
    cmd = [sys.executable, "-m", "raggedfsdp.cli", "plan", "--model", "gpt-tiny", "--world", "4"]
    ok = subprocess.run(
        [*cmd, "--json"], capture_output=True, text=True, env=_module_env(), timeout=120
    )
    assert ok.returncode == 0, ok.stderr
    (record,) = json.loads(ok.stdout)
    assert record["world_size"] == 4 and record["padding_ratio"] >= 0

    bad = subprocess.run(
        [*cmd, "--block-size", "nope"],
        capture_output=True,
        text=True,
        env=_module_env(),
        timeout=120,
    )
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "nope" in bad.stderr and "Traceback" not in bad.stderr


def test_train_refuses_before_any_worker_starts(tmp_path: Path) -> None:
    """gpt-medium with 8,192 sequences per rank needs far more than this machine's RAM."""
    out = tmp_path / "run"
    proc = run_cli(
        "train", "--model=gpt-medium", "--batch-size=16384", "--nproc=2", "--steps=1",
        f"--out={out}",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr  # one line: no worker started
    assert "raggedfsdp: error: memory: each rank needs about" in proc.stderr
    assert not out.exists()
