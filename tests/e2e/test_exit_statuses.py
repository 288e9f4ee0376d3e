"""The launcher's exit status is the workers' own (docs/operations.md, "Exit statuses"), and its
line names the worker that failed, never one the agent stopped: torchrun's failure records read
in this process, then a NaN stop and a start the workers refuse, launched for real (torchrun's
agent, Gloo, 2 workers of gpt-tiny on CPU)."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from launches import ok, run_cli, tiny_train
from raggedfsdp.cli.train import _child_failed
from raggedfsdp.train.config import TrainConfig
from raggedfsdp.train.run_dir import COMPLETE, checkpoint_files


def _failure(tmp_path: Path, rank: int, exitcode: int, message: str | None = None):
    error_file = tmp_path / f"error_{rank}.json"
    if message is not None:
        record = {"message": {"message": message, "extraInfo": {"timestamp": "1"}}}
        error_file.write_text(json.dumps(record))
    failure = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode,
                             error_file=str(error_file))  # fmt: skip
    failure.timestamp = 1
    return failure


def test_the_launcher_names_the_failure_not_the_agents_stop(tmp_path, capsys):
    """Once a worker fails, the agent SIGTERMs the others: that is never the failure named,
    and the failed worker's status is the launcher's (a user error's already said, in one
    line, by the worker)."""
    cfg = TrainConfig(out=str(tmp_path / "run"))
    stopped = _failure(tmp_path, 1, -signal.SIGTERM)
    refused = ChildFailedError("w", {0: _failure(tmp_path, 0, 2), 1: stopped})
    assert _child_failed(refused, cfg, restarts=0) == 2
    assert capsys.readouterr().err == ""
    nan = _failure(tmp_path, 0, 1, "step 3: the loss is nan")
    assert _child_failed(ChildFailedError("w", {0: nan, 1: stopped}), cfg, restarts=0) == 1
    assert capsys.readouterr().err == (
        "raggedfsdp: error: training failed: worker rank 0 exited with status 1: step 3: the "
        "loss is nan\n"
    )
    killed = ChildFailedError("w", {1: _failure(tmp_path, 1, -signal.SIGKILL)})
    assert _child_failed(killed, cfg, restarts=0) == 128 + signal.SIGKILL
    assert capsys.readouterr().err == (
        "raggedfsdp: error: training failed: worker rank 1 was killed by SIGKILL\n"
    )


@pytest.mark.slow
def test_nan_stop_is_named_by_the_rank_that_stopped(tmp_path, corpus):
    proc = run_cli(*tiny_train(corpus, tmp_path / "run", "--steps=30", "--lr=1e6"))
    assert proc.returncode == 1, proc.stderr
    first, *rest = proc.stderr.splitlines()
    assert re.fullmatch(
        r"raggedfsdp: error: step \d+: the loss is [-\w.]+ \(gradient norm [-\w.]+\) on some rank; "
        r"stopping \(--on-nan skip would skip such steps\)",
        first,
    ), proc.stderr
    cause = first.removeprefix("raggedfsdp: error: ")
    assert rest == [
        f"raggedfsdp: error: training failed: worker rank 0 exited with status 1: {cause}"
    ]


@pytest.mark.slow
def test_a_start_the_workers_refuse_keeps_its_status_and_the_folder(tmp_path, corpus):
    """A checkpoint whose data were replaced and its records with them passes every check the
    launcher makes, and fails to load in the workers: status 2, their line alone, the folder
    as it was."""
    out = tmp_path / "run"
    ok(run_cli(*tiny_train(corpus, out, "--steps=2")))
    ckpt = out / "checkpoints" / "step_000002"
    data = ckpt / "__0_0.distcp"
    data.write_bytes(bytes(data.stat().st_size))
    meta = json.loads((ckpt / COMPLETE).read_text())
    (ckpt / COMPLETE).write_text(json.dumps({**meta, "files": checkpoint_files(ckpt)}))
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    proc = run_cli(*tiny_train(corpus, out, "--steps=4", "--resume"))
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("raggedfsdp: error")]
    prefix = f"raggedfsdp: error: checkpoint '{ckpt}' could not be read ("
    assert errors[0].startswith(prefix), proc.stderr
    assert all(e == errors[0] or e.startswith("raggedfsdp: error: rank 1: ") for e in errors)
    assert "training failed" not in proc.stderr and "SIGTERM" not in proc.stderr
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
