"""One FSDP2 training script, written against torch's public API only, run with either
``torch.distributed.fsdp.fully_shard`` or ``rf.fully_shard``
(tests/distributed/test_fsdp2_dropin.py).

It trains with gradient accumulation (``set_requires_gradient_sync``), torch's
``clip_grad_norm_`` and an lr scheduler, then reads the model and optimizer state through
``torch.distributed.checkpoint.state_dict`` (full, full on rank 0 only, sharded), saves the
sharded state with DCP, and loads checkpoints of either implementation at any world size.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import raggedfsdp as rf
from parity_models import OddModel, make_batches

IMPLS = {"torch": torch_fully_shard, "rf": rf.fully_shard}
FULL = StateDictOptions(full_state_dict=True)
FULL_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
BROADCAST = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
# torchtitan's options for DCP: optimizer state keyed "state.<fqn>.<key>" (DCP cannot key lists).
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
MICRO, STEPS, LOCAL_BATCH = 2, 3, 2


def _plain(value: Any) -> Any:
    """A reported value as a plain CPU tensor (FSDP2 returns DTensors)."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value


def build(impl: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = OddModel()
    for block in model.blocks:
        IMPLS[impl](block)
    IMPLS[impl](model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    return model, opt, sched


def train(model: Any, opt: Any, sched: Any, rank: int, world: int, steps: int) -> list[float]:
    """``steps`` steps of MICRO micro-batches (no gradient sync but on the last), clipped by
    torch's clip_grad_norm_; returns the norms it reported."""
    norms = []
    batches = make_batches(steps * MICRO, LOCAL_BATCH * world)
    for step in range(steps):
        for micro in range(MICRO):
            idx, targets = batches[step * MICRO + micro]
            mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
            model.set_requires_gradient_sync(micro == MICRO - 1)
            (model(idx[mine], targets[mine]) / MICRO).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        norms.append(float(_plain(norm)))
        opt.step()
        sched.step()
        opt.zero_grad()
    return norms


def full_state(model: Any, opt: Any, options: StateDictOptions = FULL) -> dict[str, Any]:
    """Model and optimizer state through DSD, full (plain CPU tensors)."""
    msd = get_model_state_dict(model, options=options)
    osd = get_optimizer_state_dict(model, opt, options=options)
    return {
        "model": {k: _plain(v) for k, v in msd.items()},
        "optim": {k: {n: _plain(x) for n, x in v.items()} for k, v in osd.get("state", {}).items()},
        "lr": [g["lr"] for g in osd.get("param_groups", [])],
    }


def save(model: Any, opt: Any, path: str) -> None:
    state = {"model": get_model_state_dict(model), "optim": _optim_flat(model, opt)}
    dcp.save(state, checkpoint_id=path)


def _optim_flat(model: Any, opt: Any) -> dict[str, Any]:
    return get_optimizer_state_dict(model, opt, options=FLAT)


def load(impl: str, path: str) -> tuple[Any, Any, Any]:
    """A fresh model and optimizer of ``impl`` loaded from a DCP checkpoint (torchtitan's way)."""
    model, opt, sched = build(impl)
    state = {"model": get_model_state_dict(model), "optim": _optim_flat(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"], options=FLAT)
    return model, opt, sched


def train_and_save(rank: int, world: int, root: str) -> dict[str, Any]:
    """Per implementation: the norms, the full state (on every rank and on rank 0 only), the
    state after a full-state round trip, and a checkpoint under ``root``."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for impl in IMPLS:
        model, opt, sched = build(impl)
        norms = train(model, opt, sched, rank, world, STEPS)
        full = full_state(model, opt)
        rank0 = full_state(model, opt, FULL_RANK0)
        save(model, opt, os.path.join(root, f"{impl}-w{world}"))
        out[impl] = {
            "norms": norms,
            "full": full,
            "rank0_keys": (len(rank0["model"]), len(rank0["optim"])),
            "round_trip": _round_trip(impl, model, opt, FULL, FULL),
            "broadcast": _round_trip(impl, model, opt, FULL_RANK0, BROADCAST),
        }
    return out


def _round_trip(
    impl: str, model: Any, opt: Any, get: StateDictOptions, put: StateDictOptions
) -> dict[str, Any]:
    """The full state of a fresh model and optimizer given ``model``'s and ``opt``'s full state
    (taken with ``get``, set with ``put``)."""
    msd = get_model_state_dict(model, options=get)
    osd = get_optimizer_state_dict(model, opt, options=get)
    again, opt2, _ = build(impl)
    set_model_state_dict(again, msd, options=put)
    set_optimizer_state_dict(again, opt2, osd, options=put)
    return full_state(again, opt2)


def load_and_continue(rank: int, world: int, root: str, saved_world: int) -> dict[str, Any]:
    """Every (checkpoint implementation, loading implementation) pair: the full state after
    loading and the parameters after one more step."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for saved in IMPLS:
        for impl in IMPLS:
            model, opt, sched = load(impl, os.path.join(root, f"{saved}-w{saved_world}"))
            loaded = full_state(model, opt)
            train(model, opt, sched, rank, world, 1)
            out[f"{saved}->{impl}"] = {"loaded": loaded, "stepped": full_state(model, opt)}
    return out
