"""Optimizer state reshards through DCP with its blocks: Shampoo's per-block factors and
AdamW8bit's codes and scales, saved at W=2, loaded at W=1 and W=3 with another layout, through
``rf.optim_state_dict`` (one launch of 3 ranks, each world size as if launched on its own:
harness.run_world_grid); and every raggedfsdp optimizer's own ``optimizer.state_dict()`` through
plain ``dcp.save`` / ``dcp.load`` and through DSD's helpers, with what ``load_state_dict``
refuses."""

from __future__ import annotations

import functools
import os
import tempfile
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

import raggedfsdp as rf
from harness import error_message, run_distributed, run_world_grid
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
    if kind == "muon":
        planner = rf.StructAwarePlanner("muon", rf.RaggedShard(block_size=block_size))
        rf.FSDPBackend(model, planner=planner)
        opt = rf.optim.Muon(model.parameters(), lr=0.01, adamw_params=lambda p, s: len(s) < 2)
    elif kind == "shampoo":
        planner = rf.StructAwarePlanner(
            "shampoo", rf.RaggedShard(block_size=block_size), max_preconditioner_dim=DIM
        )
        rf.FSDPBackend(model, planner=planner)
        opt = rf.optim.Shampoo(
            model.parameters(), lr=0.01, max_preconditioner_dim=DIM, precondition_frequency=1
        )
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
            out[f"{name}:{key}"] = value.to_local().reshape(-1).float()
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


# ---------------------------------------------------------------------------------------------
# optimizer.state_dict() as it is: plain DCP, DSD (sharded and full), and what load refuses.

ALL_KINDS = ("muon", "shampoo", "adamw8bit")
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # torchtitan's DCP options
FULL = StateDictOptions(full_state_dict=True)


def _trained(kind: str, rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, opt = _build(kind, DIM)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 12, generator=g)).backward()
        opt.step()
    return model, opt


def _fresh(kind: str, block_size) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, opt = _build(kind, block_size)
    init_optimizer_state(model, opt)
    return model, opt


def _pieces(state_dict: dict[str, Any], whole: bool = False) -> dict[str, Any]:
    """``state_dict`` with its sharded tensors as this rank's plain pieces (a per-rank
    ``torch.save`` of older runs), or as whole tensors (``whole``: a collective)."""

    def plain(value: Any) -> Any:
        if not isinstance(value, DTensor):
            return value
        return value.full_tensor() if whole else value.to_local().clone()

    state = {i: {k: plain(v) for k, v in s.items()} for i, s in state_dict["state"].items()}
    return {"state": state, "param_groups": state_dict["param_groups"]}


def _save_state_dicts(rank: int, world: int, path: str) -> dict[str, Any]:
    out = {}
    for kind in ALL_KINDS:
        model, opt = _trained(kind, rank)
        dcp.save({"optim": opt.state_dict()}, checkpoint_id=f"{path}/{kind}/plain")
        dcp.save(
            get_optimizer_state_dict(model, opt, options=FLAT), checkpoint_id=f"{path}/{kind}/dsd"
        )
        torch.save(_pieces(opt.state_dict()), f"{path}/{kind}/rank{rank}.pt")
        out[kind] = _flat_state(model, opt)
    return out


def _load_state_dicts(rank: int, world: int, path: str) -> dict[str, Any]:
    return {kind: _load_kind(kind, rank, f"{path}/{kind}") for kind in ALL_KINDS}


def _load_kind(kind: str, rank: int, path: str) -> dict[str, Any]:
    """At another world size and plan: the plain DCP load (in place?), DSD's sharded load, a
    full state and this rank's own pieces into fresh optimizers, and the refusals."""
    model, opt = _fresh(kind, 2 * DIM)
    state_dict = opt.state_dict()
    before = [id(v) for s in opt.state.values() for v in s.values()]
    dcp.load({"optim": state_dict}, checkpoint_id=f"{path}/plain")
    opt.load_state_dict(state_dict)
    in_place = before == [id(v) for s in opt.state.values() for v in s.values()]
    dsd_model, dsd_opt = _build(kind, 2 * DIM)  # DSD makes the state itself
    dsd_state = get_optimizer_state_dict(dsd_model, dsd_opt, options=FLAT)
    dcp.load(dsd_state, checkpoint_id=f"{path}/dsd")
    set_optimizer_state_dict(dsd_model, dsd_opt, dsd_state, options=FLAT)
    full_model, full_opt = _build(kind, 2 * DIM)
    full = get_optimizer_state_dict(model, opt, options=FULL)
    set_optimizer_state_dict(full_model, full_opt, full, options=FULL)
    own_model, own_opt = _fresh(kind, 2 * DIM)
    own_opt.load_state_dict(_pieces(opt.state_dict()))
    _, other_plan = _fresh(kind, DIM)  # the same world size, another plan
    old_pieces = torch.load(f"{path}/rank{min(rank, 1)}.pt", weights_only=False)
    return {
        "plain": _flat_state(model, opt),
        "in_place": in_place,
        "dsd": _flat_state(dsd_model, dsd_opt),
        "dsd_full": _flat_state(full_model, full_opt),
        "own_pieces": _flat_state(own_model, own_opt),
        "other_plan": error_message(lambda: opt.load_state_dict(other_plan.state_dict())),
        "old_pieces": error_message(lambda: own_opt.load_state_dict(old_pieces)),
    }


def test_optimizer_state_dict_through_dcp_and_dsd_reshards_bitwise():
    with tempfile.TemporaryDirectory() as path:
        for kind in ALL_KINDS:
            os.makedirs(f"{path}/{kind}")
        saved_runs = run_distributed(_save_state_dicts, 2, path)
        runs = run_distributed(_load_state_dicts, 3, path)
    for kind in ALL_KINDS:
        saved = _concat([r[kind] for r in saved_runs])
        for how in ("plain", "dsd", "dsd_full", "own_pieces"):
            loaded = _concat([r[kind][how] for r in runs])
            assert loaded.keys() == saved.keys(), (kind, how)
            for k in saved:
                assert torch.equal(loaded[k], saved[k]), (kind, how, k)
        for rank, run in enumerate(runs):
            result = run[kind]
            assert result["in_place"], (kind, rank)  # dcp.load wrote into the state itself
            # Negative controls: another plan's RaggedTensors, and W=2's plain pieces at W=3.
            assert "do not match this rank's layout" in result["other_plan"], (kind, rank)
            assert "optimizer state '" in result["other_plan"], (kind, rank)  # names the key
            assert "nor rank" in result["old_pieces"], (kind, rank)
