"""Workers die with their launcher, from their first instruction (:mod:`raggedfsdp._lifeline`):
a real ``raggedfsdp train`` launch (torchrun's agent, Gloo, 2 workers of gpt-tiny on CPU) whose
launcher is SIGKILLed while its workers start, and single workers whose parent is gone."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from launches import (
    ENV,
    alive,
    kill_launcher,
    kill_tree,
    start_launcher,
    tiny_train,
    wait_for,
    workers_of,
)
from raggedfsdp._lifeline import LAUNCHER_PID
from raggedfsdp.train.run_dir import LOCK


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 1.0], ids=["at-once", "a-second-later"])
def test_workers_die_with_a_launcher_killed_while_they_start(tmp_path, corpus, delay):
    """Killed the moment its workers exist, or a second later (where they used to be re-parented
    to PID 1 and train to the last step): they die within the poll, before training."""
    out = tmp_path / "run"
    launcher = start_launcher(tiny_train(corpus, out, "--steps=1000"), tmp_path / "launcher.txt")
    try:
        wait_for("the workers", lambda: len(workers_of(launcher)) == 2)
        time.sleep(delay)
        killed = time.monotonic()
        assert len(kill_launcher(launcher)) == 2
        assert time.monotonic() - killed < 2  # the kernel's signal, not a timeout
        assert not (out / "metrics.jsonl").exists()  # nothing trained
        assert [p.name for p in out.iterdir()] == [LOCK]  # the dead job's lock, nothing else
    finally:
        kill_tree(launcher)


def test_lifeline_is_held_before_torch_loads():
    """A worker whose launcher died before it could ask the kernel to watch (here: its
    launcher is named as PID 1, not its parent) ends at once, before importing torch."""
    env = {**ENV, LAUNCHER_PID: "1"}
    command = [sys.executable, "-X", "importtime", "-m", "raggedfsdp.train", "--help"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    imported = [line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if "|" in line]
    assert "raggedfsdp._lifeline" in imported
    assert not [name for name in imported if name.split(".")[0] == "torch"]


def test_lifeline_thread_where_the_kernel_cannot_watch():
    """Without prctl (not Linux), a thread notices the lost parent within its poll."""
    child = (
        "import os, time\n"
        "from raggedfsdp import _lifeline\n"
        "_lifeline._kernel_watches = lambda: False  # as off Linux: the lifeline's thread\n"
        "_lifeline.hold(os.getppid())\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = (
        "import subprocess, sys\n"
        f"child = subprocess.Popen([sys.executable, '-c', {child!r}])\n"
        "print(child.pid, flush=True)\n"
        "child.wait()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True, env=ENV
    )
    try:
        assert proc.stdout is not None
        pid = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "held"
        proc.kill()
        proc.wait()
        wait_for("the child to die", lambda: not alive(pid))
    finally:
        kill_tree(proc)
