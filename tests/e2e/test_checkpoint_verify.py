"""Checkpoints verify themselves: ``COMPLETE.json`` records the size and sha256 of every file,
``--resume`` falls back past a damaged checkpoint to the newest one that verifies (and says so in
one line), ``--strict-resume`` refuses, and ``raggedfsdp export`` of a run folder skips it too.

The launches are real ``raggedfsdp train`` runs (torchrun's agent, Gloo, 2 workers on CPU) of
gpt-tiny for 6 steps with a checkpoint every 2: one uninterrupted run is the yardstick; the others
resume a copy of its checkpoints of steps 2 and 4 (a run stopped after step 4) whose step 4 is
damaged. (verify_checkpoint on hand-made folders: tests/unit/test_verify_checkpoint.py.)
"""

from __future__ import annotations

import functools
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from launches import assert_same_tensors, ok, run_cli, train_losses
from raggedfsdp import cli
from raggedfsdp.train.checkpoints import load_full
from raggedfsdp.train.run_dir import COMPLETE, verify_checkpoint

COMMON = [
    "--model=gpt-tiny",
    "--steps=6",
    "--batch-size=4",
    "--warmup-steps=1",
    "--log-every=1",
    "--eval-every=0",
    "--eval-batches=1",
    "--checkpoint-every=2",
]
_run = functools.partial(run_cli, timeout=120)
STEP2, STEP4, STEP6 = (f"checkpoints/step_{step:06d}" for step in (2, 4, 6))


def _flip_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def _truncate(file: Path) -> tuple[int, int]:
    """Cut ``file`` to half its size; (new size, old size)."""
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    return len(data) // 2, len(data)


def _one_error_naming(stderr: str, fragment: str) -> str:
    """Rank 0's one error line naming ``fragment`` (the message). Another rank may repeat it,
    as ``rank N: message``, when it outlives its grace wait; no other line may name it."""
    prefix = "raggedfsdp: error: "
    naming = [line for line in stderr.splitlines() if fragment in line]
    first = [line for line in naming if line.startswith(prefix) and " rank " not in line[:25]]
    assert len(first) == 1, stderr
    message = first[0].removeprefix(prefix)
    copies = [line for line in naming if line != first[0]]
    assert all(re.fullmatch(rf"{prefix}rank \d+: {re.escape(message)}", c) for c in copies), stderr
    return message


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus) -> dict[str, Any]:
    """The uninterrupted run: its folder, its losses and its final parameters."""
    out = tmp_path_factory.mktemp("reference") / "run"
    ok(_run("train", *COMMON, f"--data={corpus}", f"--out={out}"))
    return {"out": out, "losses": train_losses(out), "final": load_full(out / STEP6)}


@pytest.fixture
def damaged(reference, tmp_path) -> Path:
    """A run folder holding copies of the reference's checkpoints of steps 2 and 4, to damage."""
    out = tmp_path / "run"
    for step in (STEP2, STEP4):
        shutil.copytree(reference["out"] / step, out / step)
    return out


def test_saved_checkpoints_record_every_file(reference):
    path = reference["out"] / STEP6
    records = json.loads((path / COMPLETE).read_text())["files"]
    on_disk = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert sorted([*records, COMPLETE]) == on_disk
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "rng/rank_00001.pt"} <= records.keys()
    assert verify_checkpoint(path) is None


def test_truncated_checkpoint_falls_back_exactly(reference, damaged, corpus):
    size, expected = _truncate(damaged / STEP4 / "__0_0.distcp")
    proc = ok(_run("train", *COMMON, f"--data={corpus}", f"--out={damaged}", "--resume"))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("resume:")]
    assert lines == [
        f"resume: skipped {STEP4} (__0_0.distcp: {size:,} bytes, expected {expected:,}); "
        f"resuming from {STEP2}"
    ], proc.stdout
    assert "resumed from" in proc.stdout and "step_000002" in proc.stdout
    losses = train_losses(damaged)
    assert losses == {step: reference["losses"][step] for step in (3, 4, 5, 6)}  # bit for bit
    assert_same_tensors(load_full(damaged / STEP6), reference["final"])
    assert verify_checkpoint(damaged / STEP4) is None  # saved again, whole


def test_strict_resume_refuses_a_truncated_checkpoint(damaged, corpus):
    size, expected = _truncate(damaged / STEP4 / "__0_0.distcp")
    proc = _run(
        "train", *COMMON, f"--data={corpus}", f"--out={damaged}", "--resume", "--strict-resume"
    )
    assert proc.returncode == 2, f"{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    line = _one_error_naming(proc.stderr, "__0_0.distcp")
    assert line.startswith(f"--strict-resume: checkpoint '{damaged / STEP4}' does not verify (")
    assert f"__0_0.distcp: {size:,} bytes, expected {expected:,}" in line
    assert not (damaged / "metrics.jsonl").exists()  # nothing trained
    assert verify_checkpoint(damaged / STEP4) is not None  # nothing overwritten


def test_flipped_byte_is_caught_by_the_checksum(reference, damaged, corpus, tmp_path, capsys):
    payload = damaged / STEP4 / "__1_0.distcp"
    size = payload.stat().st_size
    _flip_byte(payload)
    assert payload.stat().st_size == size
    reason = verify_checkpoint(damaged / STEP4)
    assert reason is not None and reason.startswith("__1_0.distcp: sha256 "), reason

    # export of the run folder takes the newest checkpoint that verifies, and says so.
    status = cli.main(["export", "--checkpoint", str(damaged), "--out", str(tmp_path / "m.pt")])
    _, err = capsys.readouterr()
    assert status == 0
    assert f"export: skipped {STEP4} ({reason}); using {STEP2}" in err.splitlines()
    assert_same_tensors(torch.load(tmp_path / "m.pt"), load_full(reference["out"] / STEP2))

    proc = _run(
        "train", *COMMON, f"--data={corpus}", f"--out={damaged}", "--resume", "--strict-resume"
    )
    assert proc.returncode == 2, f"{proc.stdout}\n{proc.stderr}"
    assert f"does not verify ({reason})" in _one_error_naming(proc.stderr, "__1_0.distcp")
