"""Optimizer state reshards through DCP with its blocks: Shampoo's per-block factors and
AdamW8bit's codes and scales, saved at W=2, loaded at W=1 and W=3 with another layout: one
launch of 3 ranks, each world size as if launched on its own (harness.run_world_grid)."""

from __future__ import annotations

import functools
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import raggedfsdp as rf
from harness import run_world_grid
from raggedfsdp.checkpoint import (
    init_optimizer_state,
    load_optim_state_dict,
    optim_state_dict,
)

DIM = 4  # Shampoo's max_preconditioner_dim and the 8-bit tile rows


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(12, 12, bias=False) for _ in range(2))
        self.out = nn.Linear(12, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.out(x).square().mean()


def _build(kind: str, block_size):
    torch.manual_seed(0)
    model = Net()
    if kind == "shampoo":
        planner = rf.StructAwarePlanner(
            "shampoo", rf.RaggedShard(block_size=block_size), max_preconditioner_dim=DIM
        )
        rf.FSDPBackend(model, planner=planner)
        opt = rf.optim.Shampoo(model.parameters(), lr=0.01, max_preconditioner_dim=DIM)
    else:
        planner = rf.StructAwarePlanner("adamw8bit", rf.RaggedShard(block_size=block_size))
        rf.FSDPBackend(model, planner=planner)
        opt = rf.optim.AdamW8bit(
            model.parameters(), lr=0.01, min_8bit_numel=0, block_shape=(DIM, DIM)
        )
    return model, opt


def _flat_state(model, opt) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        for key, value in opt.state[p].items():
            if key == "step":
                continue
            parts = value if isinstance(value, list) else [value]
            out[f"{name}:{key}"] = torch.cat(
                [t.reshape(-1).float() for t in parts] or [torch.empty(0)]
            )
    return out


KINDS = ("shampoo", "adamw8bit")


def _save(rank: int, world: int, path: str) -> dict[str, dict[str, torch.Tensor]]:
    return {kind: _save_one(kind, rank, f"{path}/{kind}") for kind in KINDS}


def _load(rank: int, world: int, path: str, block_size) -> dict[str, dict[str, torch.Tensor]]:
    return {kind: _load_one(kind, f"{path}/{kind}", block_size) for kind in KINDS}


def _save_one(kind: str, rank: int, path: str) -> dict[str, torch.Tensor]:
    model, opt = _build(kind, DIM)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 12, generator=g)).backward()
        opt.step()
    dcp.save({"optim": optim_state_dict(model, opt)}, checkpoint_id=path)
    return _flat_state(model, opt)


def _load_one(kind: str, path: str, block_size) -> dict[str, torch.Tensor]:
    model, opt = _build(kind, block_size)
    init_optimizer_state(model, opt)
    state = {"optim": optim_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    load_optim_state_dict(model, opt, state["optim"])
    return _flat_state(model, opt)


def _concat(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([r[k] for r in per_rank]) for k in per_rank[0]}


def _cases(path: str, rank: int, world: int, group: None) -> dict[str, dict[str, torch.Tensor]]:
    """Saved at W=2; loaded at W=1 (blocks of DIM rows) and W=3 (blocks of 2 * DIM rows)."""
    if world == 2:
        return _save(rank, world, path)
    return _load(rank, world, path, DIM if world == 1 else 2 * DIM)


def test_block_state_reshards_bitwise():
    with tempfile.TemporaryDirectory() as path:
        grid = run_world_grid(functools.partial(_cases, path), [2, 1, 3], as_launches=True)
        saved_runs = grid[2]
        saved = {kind: _concat([r[kind] for r in saved_runs]) for kind in KINDS}
        assert any(k.endswith(":L") for k in saved["shampoo"])
        assert any(k.endswith("_scales") for k in saved["adamw8bit"])
        for world in (1, 3):
            runs = grid[world]
            for kind in KINDS:
                loaded = _concat([r[kind] for r in runs])
                assert loaded.keys() == saved[kind].keys()
                for k in saved[kind]:
                    assert torch.equal(loaded[k], saved[kind][k]), (kind, world, k)
