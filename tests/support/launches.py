"""What the tests that launch real ``raggedfsdp train`` jobs share: the environment, the command
in a fresh interpreter, independent launches side by side, the comparisons they make of the
results, and how they start, watch and kill launchers and their workers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

#: One thread per worker makes runs bit-for-bit comparable whatever the launcher's process count.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


#: A short run's options (the model aside): five steps of 8 sequences of 32 bytes, every loss
#: logged, the end's evaluation, a step-3 checkpoint to resume from.
FIVE_STEPS = [
    "--steps=5",
    "--batch-size=8",
    "--seq-len=32",
    "--warmup-steps=2",
    "--lr=1e-2",
    "--log-every=1",
    "--eval-every=0",
    "--eval-batches=1",
    "--checkpoint-every=3",
]


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


def run_side_by_side(
    *commands: list[str], timeout: float = 600, env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess]:
    """Run ``commands`` at once, each to the end (within ``timeout`` seconds in all), for
    independent jobs: a launch spends much of its time waiting (its workers' imports, its agent,
    teardown), and these waits overlap. Their exit statuses and outputs, in order; whatever is
    still running when this returns or fails is killed."""
    with contextlib.ExitStack() as files:
        # Files, not pipes: a pipe nobody reads yet would stop a command that fills it.
        outputs = [
            [files.enter_context(tempfile.TemporaryFile("w+")) for _ in ("stdout", "stderr")]
            for _ in commands
        ]
        procs = [
            subprocess.Popen(
                command, stdout=out, stderr=err, text=True, env=env or ENV, start_new_session=True
            )
            for command, (out, err) in zip(commands, outputs, strict=True)
        ]
        try:
            deadline = time.monotonic() + timeout
            for proc in procs:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    kill_tree(proc)
        done = []
        for command, proc, (out, err) in zip(commands, procs, outputs, strict=True):
            out.seek(0)
            err.seek(0)
            done.append(
                subprocess.CompletedProcess(command, proc.returncode, out.read(), err.read())
            )
        return done


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """``proc``, after asserting it exited 0 (the output in the message when not)."""
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def workers_in_one_process(*argvs: list[str]) -> list[str]:
    """The command that runs the training worker without torchrun (a group of one) once per
    ``argv``, in turn, in one interpreter: single-process references without a launch's
    start-up each; it exits with the largest status."""
    code = (
        "import json, sys\nfrom raggedfsdp.train import main\n"
        "sys.exit(max(main(json.loads(a)) for a in sys.argv[1:]))"
    )
    return [sys.executable, "-c", code, *map(json.dumps, argvs)]


def metrics(out: Path, kind: str) -> list[dict]:
    """The records of ``kind`` (``train``, ``eval``) a run wrote to ``out/metrics.jsonl``."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


def train_losses(out: Path) -> dict[int, float]:
    """Step -> the loss a run logged (``--log-every 1`` logs them all)."""
    return {r["step"]: r["loss"] for r in metrics(out, "train")}


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


#: How long a test waits for any one thing (a loaded machine is slow to start workers).
DEADLINE_S = 120


def tiny_train(corpus: Path, out: Path, *extra: str) -> list[str]:
    """``train`` arguments of a small gpt-tiny run on ``corpus`` into ``out``."""
    return [
        "train",
        "--model=gpt-tiny",
        "--batch-size=4",
        "--eval-batches=1",
        "--eval-every=0",
        "--log-every=10",
        "--warmup-steps=1",
        f"--data={corpus}",
        f"--out={out}",
        *extra,
    ]


def start_launcher(args: list[str], log: Path) -> subprocess.Popen:
    """``raggedfsdp ARGS`` in a session of its own; its stderr in ``log``, stdout in
    ``log.out``."""
    with open(log, "w") as err, open(f"{log}.out", "w") as out:
        return subprocess.Popen(
            cli_command(*args), stdout=out, stderr=err, env=ENV, start_new_session=True
        )


def wait_for(what: str, condition: Callable[[], object]) -> object:
    """Poll ``condition`` until it is true (its value then), failing after DEADLINE_S."""
    deadline = time.monotonic() + DEADLINE_S
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return value


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie has died)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def workers_of(launcher: subprocess.Popen) -> list[int]:
    """The launcher's workers that run ``python -m raggedfsdp.train`` (past their exec)."""

    def command(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""

    return [pid for pid in descendants(launcher.pid) if b"raggedfsdp.train" in command(pid)]


def kill_launcher(launcher: subprocess.Popen) -> list[int]:
    """SIGKILL the launcher alone, as the OOM killer would; its workers, once they are dead."""
    workers = workers_of(launcher)
    launcher.kill()
    launcher.wait()
    wait_for("the workers to die", lambda: not any(alive(pid) for pid in workers))
    return workers
