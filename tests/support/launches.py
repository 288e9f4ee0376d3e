"""What the tests that launch real ``raggedfsdp train`` jobs share: the environment, the command
in a fresh interpreter, and the comparisons they make of the results."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

#: One thread per worker makes runs bit-for-bit comparable whatever the launcher's process count.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def cli_command(*args: str) -> list[str]:
    """``raggedfsdp ARGS`` in a fresh interpreter (the launcher then starts the workers)."""
    return [sys.executable, "-m", "raggedfsdp.cli", *args]


def run_cli(
    *args: str, timeout: float = 180, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``raggedfsdp ARGS`` to the end; its exit status and output."""
    return subprocess.run(
        cli_command(*args), capture_output=True, text=True, env=env or ENV, timeout=timeout
    )


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """``proc``, after asserting it exited 0 (the output in the message when not)."""
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """The same keys, and every tensor equal bit for bit, in the same dtype."""
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), key


def free_port() -> int:
    """A TCP port free on loopback now (for a rendezvous endpoint)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (torchrun starts workers in sessions of their own, so
    a process group does not hold them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and everything it started (a test's ``finally``: nothing outlives it)."""
    for pid in [*descendants(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def one_error_line(err: str, *fragments: str) -> None:
    """``err`` is one ``raggedfsdp: error:`` line holding every fragment, and no traceback."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("raggedfsdp: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
