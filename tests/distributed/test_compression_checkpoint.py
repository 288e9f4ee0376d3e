"""Error-feedback residuals are training state: saved per rank with the checkpoint, resumed
bit for bit at the same world size, dropped with a warning at another one. One launch of 2 ranks:
W=2, then W=1, each as if launched on its own (harness.run_world_grid)."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

import raggedfsdp as rf
from harness import run_world_grid
from parity_models import OddModel, make_batches
from raggedfsdp.train.checkpoints import load_checkpoint, save_checkpoint

COMPRESSION = rf.CommCompression(
    all_gather=torch.int8, reduce_scatter=torch.int8, error_feedback=True
)
META = {"config": {}, "data": {}}


def _model():
    torch.manual_seed(0)
    model = OddModel()
    rf.FSDPBackend(model, shard_policy=rf.RaggedShard(block_size=4), compression=COMPRESSION)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _train(model, opt, rank, world, batches) -> None:
    per = batches[0][0].shape[0] // world
    for idx, targets in batches:
        opt.zero_grad()
        model(idx[rank * per : (rank + 1) * per], targets[rank * per : (rank + 1) * per]).backward()
        opt.step()


def _save_and_resume(rank: int, world: int, out: str) -> dict:
    batches = make_batches(4, 8)
    model, opt = _model()
    _train(model, opt, rank, world, batches[:2])
    path = save_checkpoint(out, 2, model=model, optimizer=opt, meta=META)
    _train(model, opt, rank, world, batches[2:])
    straight = rf.full_state_dict(model), rf.runtime.error_feedback_state(model)
    model, opt = _model()
    load_checkpoint(path, model=model, optimizer=opt)
    _train(model, opt, rank, world, batches[2:])
    resumed = rf.full_state_dict(model), rf.runtime.error_feedback_state(model)
    same = all(torch.equal(a[k], b[k]) for a, b in zip(straight, resumed, strict=True) for k in a)
    saved = torch.load(path / "residuals" / f"rank_{rank:05d}.pt")
    nonzero = all(bool(r.any()) for r in saved.values()) and len(saved) > 0
    return {"same": same, "nonzero": nonzero, "path": str(path)}


def _other_world(rank: int, world: int, path: str) -> list[str]:
    model, opt = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_checkpoint(path, model=model, optimizer=opt)
    zero = all(not bool(r.any()) for r in rf.runtime.error_feedback_state(model).values())
    return [str(w.message) for w in caught] + ([] if zero else ["residuals not zero"])


def _cases(out: str, rank: int, world: int, group: None) -> dict | list[str]:
    """Saved and resumed at W=2; the same checkpoint loaded at W=1."""
    if world == 2:
        return _save_and_resume(rank, world, out)
    return _other_world(rank, world, str(Path(out) / "checkpoints" / "step_000002"))


def test_residuals_resume_bit_for_bit_and_drop_at_another_world_size(tmp_path):
    grid = run_world_grid(functools.partial(_cases, str(tmp_path)), [2, 1], as_launches=True)
    results = grid[2]
    assert all(r["same"] and r["nonzero"] for r in results), results
    assert results[0]["path"] == str(tmp_path / "checkpoints" / "step_000002")
    messages = grid[1][0]
    assert any("world size 2; resuming at 1" in m and "dropped" in m for m in messages), messages
    assert "residuals not zero" not in messages
