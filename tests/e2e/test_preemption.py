"""Graceful preemption with real ``raggedfsdp train`` launches: SIGTERM at a random step saves
that step's checkpoint, exits 143, and ``--resume`` ends bit for bit where the uninterrupted run
ends."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from launches import ENV, cli_command
from raggedfsdp.train.checkpoints import export_checkpoint
from raggedfsdp.train.preemption import PREEMPTED_EXIT_CODE
from raggedfsdp.train.run_dir import latest_checkpoint

STEPS = 24
ARGS = [
    "--model=gpt-tiny",
    f"--steps={STEPS}",
    "--batch-size=4",
    "--log-every=1",
    "--eval-every=0",
    "--eval-batches=1",
    "--checkpoint-every=10",
    "--warmup-steps=2",
]


def _command(out: Path, *extra: str) -> list[str]:
    return cli_command("train", *ARGS, f"--out={out}", *extra)


def _final(out: Path, tmp: Path) -> dict[str, torch.Tensor]:
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and ckpt.name == f"step_{STEPS:06d}"
    export_checkpoint(ckpt, tmp / f"{out.name}.pt")
    return torch.load(tmp / f"{out.name}.pt")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    # Judged by the checkpoint it leaves (_final), not the exit status: Gloo may abort at exit.
    subprocess.run(_command(tmp / "run"), capture_output=True, text=True, env=ENV)
    return _final(tmp / "run", tmp)


def _preempt(out: Path, at_step: int, *, whole_group: bool) -> tuple[int, str, float]:
    """Run until step ``at_step`` is logged, then SIGTERM the launcher (and, as Slurm does, every
    worker with it when ``whole_group``); the exit status, the output, the seconds to exit."""
    proc = subprocess.Popen(
        _command(out),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    assert proc.stdout is not None
    lines, sent = [], None
    for line in proc.stdout:
        lines.append(line)
        if sent is None and line.startswith(f"step {at_step:>2}/{STEPS}"):
            sent = time.monotonic()
            if whole_group:
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
    assert sent is not None, "".join(lines)
    return code, "".join(lines), time.monotonic() - sent


@pytest.mark.parametrize("whole_group", [True, False], ids=["slurm-all-tasks", "launcher-only"])
def test_sigterm_saves_and_resume_is_exact(tmp_path, uninterrupted, whole_group) -> None:
    at_step = random.Random(int(whole_group)).randrange(3, STEPS - 6)
    out = tmp_path / "run"
    code, output, seconds = _preempt(out, at_step, whole_group=whole_group)
    assert code == PREEMPTED_EXIT_CODE, output
    saved = latest_checkpoint(out)
    assert saved is not None
    step = int(saved.name.removeprefix("step_"))
    assert at_step <= step <= at_step + 2, output  # the step in flight, not the last periodic
    assert f"preempted (SIGTERM): checkpoint of step {step} saved" in output
    assert "raggedfsdp: stopped by SIGTERM" in output
    assert seconds < 25  # within the default grace period
    proc = subprocess.run(_command(out, "--resume"), capture_output=True, text=True, env=ENV)
    assert f"resumed from {saved}" in proc.stdout, proc.stderr
    final = _final(out, tmp_path)
    assert final.keys() == uninterrupted.keys()
    for key in final:
        assert torch.equal(final[key], uninterrupted[key]), key
