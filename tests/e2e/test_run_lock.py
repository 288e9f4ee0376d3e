"""One job per run folder (:mod:`raggedfsdp.train.run_lock`): two real ``raggedfsdp train`` jobs
on one folder (torchrun's agent, Gloo, 2 workers of gpt-tiny on CPU), the lock of a dead job taken
over; in this process, a lock held on another host, a refused start that leaves nothing, and a
save over another job's step folder."""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from pathlib import Path

import pytest
import torch

from launches import (
    kill_launcher,
    kill_tree,
    ok,
    run_cli,
    start_launcher,
    tiny_train,
    wait_for,
)
from raggedfsdp.train.checkpoints import save_checkpoint
from raggedfsdp.train.run_dir import COMPLETE, LOCK, latest_checkpoint
from raggedfsdp.train.run_lock import Holder, run_lock


def _refusal(out: Path, holder: Holder) -> str:
    return (
        f"raggedfsdp: error: output folder '{out}' is in use by another job: "
        f"{holder.describe()} holds its lock; wait for it to end, or choose another --out\n"
    )


@pytest.mark.slow
def test_one_job_per_run_folder(tmp_path, corpus):
    """Two fresh jobs 0.5 s apart: one trains, the other is refused before launch naming it,
    as is a --resume of the folder meanwhile. Killed, the first leaves a lock that the next
    --resume takes over, naming it, and then releases."""
    out = tmp_path / "run"
    args = tiny_train(corpus, out, "--steps=100000", "--checkpoint-every=10")
    first = start_launcher(args, tmp_path / "first.txt")
    time.sleep(0.5)
    second = start_launcher(args, tmp_path / "second.txt")
    launchers = {first: tmp_path / "first.txt", second: tmp_path / "second.txt"}
    try:
        refused = wait_for("a refusal", lambda: [p for p in launchers if p.poll() is not None])
        (loser,) = refused  # type: ignore[misc]
        (winner,) = [p for p in launchers if p is not loser]
        holder = Holder(**json.loads((out / LOCK).read_text()))
        assert holder.pid == winner.pid and holder.host == socket.gethostname()
        assert loser.returncode == 2
        assert launchers[loser].read_text() == _refusal(out, holder)
        resumed = run_cli(*args, "--resume")
        assert (resumed.returncode, resumed.stderr) == (2, _refusal(out, holder))
        assert winner.poll() is None  # undisturbed

        wait_for("a checkpoint", lambda: latest_checkpoint(out))
        kill_launcher(winner)
        step = int(latest_checkpoint(out).name.removeprefix("step_"))  # type: ignore[union-attr]
        again = tiny_train(corpus, out, f"--steps={step + 2}", "--lr=1e-3", "--resume")
        after = ok(run_cli(*again))
        assert after.stderr.splitlines()[0] == (
            f"raggedfsdp: took over the lock '{out / LOCK}' of a job that is gone "
            f"({holder.describe()})"
        )
        assert f"resumed from {out}/checkpoints/step_{step:06d}" in after.stdout
        assert not (out / LOCK).exists()  # released at the end
        assert json.loads((out / "config.json").read_text())["lr"] == 1e-3
        jobs = [
            json.loads((p / COMPLETE).read_text())["job"] for p in (out / "checkpoints").iterdir()
        ]
        assert jobs.count(holder.job) == len(jobs) - 1  # the dead job's steps are all there
    finally:
        for launcher in launchers:
            kill_tree(launcher)


def test_a_lock_held_on_another_host(tmp_path):
    """A holder elsewhere cannot be checked: refused, naming it and the file to delete; a node
    of the same job joins it and leaves the lock to it."""
    out = tmp_path / "run"
    out.mkdir()
    holder = Holder("elsewhere", 4242, None, 0.0, "node0:29400/job7")
    (out / LOCK).write_text(json.dumps(dataclasses.asdict(holder)))
    with pytest.raises(ValueError) as refused, run_lock(out, job=None):
        pass
    assert str(refused.value) == (
        f"output folder '{out}' is in use by another job: {holder.describe()} holds its lock; "
        f"if that job is gone (it ran on another host, where its PID cannot be checked), "
        f"delete '{out / LOCK}', or choose another --out"
    )
    with run_lock(out, job="node0:29400/job7") as lock:
        assert (lock.holder, lock.holding, lock.job) == (holder, False, "node0:29400/job7")
    assert (out / LOCK).exists()


def test_a_refused_start_leaves_nothing(command, tmp_path):
    out = tmp_path / "new" / "run"
    status, _, err = command("train", f"--out={out}", f"--data={tmp_path / 'missing'}")
    assert status == 2
    assert err == f"raggedfsdp: error: data: corpus path '{tmp_path / 'missing'}' does not exist\n"
    assert not (tmp_path / "new").exists()  # the lock's folders, made for it, are gone


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_save_never_replaces_another_jobs_step_folder(tmp_path, capsys):
    """This job's own step folder is replaced; another job's intact one is refused; a damaged
    one (which --resume skipped) is moved aside, not deleted."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())

    def save(job: str) -> Path:
        meta = {"config": {}, "data": {"step": 2}, "job": job}
        return save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer, meta=meta)

    path = save("job-a")
    save("job-a")
    with pytest.raises(ValueError) as refused:
        save("job-b")
    assert str(refused.value) == (
        f"checkpoint '{path}' exists, written by another job (job-a): not replacing it; is "
        f"another job using this --out?"
    )
    (path / ".metadata").write_bytes(b"damaged")
    save("job-b")
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"checkpoint: moved the damaged {path} aside, to step_000002.unverified"
    )
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "step_000002",
        "step_000002.unverified",
    ]
