"""DCP checkpoints of ragged shards: save at one world size, load at others and elsewhere.

One launch of 4 ranks saves at W=4, then loads at W=2 and W=3, each as if launched on W ranks
(harness.run_world_grid, ``as_launches``); the tests judge the collected results."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh

import raggedfsdp as rf
from harness import run_world_grid
from parity_models import OddModel, make_batches


def _model(block_size, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = OddModel()
    rf.FSDPBackend(model, shard_policy=rf.RaggedShard(block_size=block_size))
    return model


def _save(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    model = _model(4, seed=1)
    dcp.save(model.state_dict(), checkpoint_id=path)
    return rf.full_state_dict(model)


def _load(rank: int, world: int, path: str, block_size) -> dict[str, torch.Tensor]:
    model = _model(block_size, seed=2)  # different values, different plan
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)
    return rf.full_state_dict(model)


def _load_full(rank: int, world: int, full: dict) -> dict[str, torch.Tensor]:
    model = _model("whole", seed=3)
    model.load_state_dict(full)
    return rf.full_state_dict(model)


def test_save_at_4_reload_at_2_3_and_single_process(runs):
    path = runs["paths"]["saved"]
    saved = runs[4][0]["saved"]
    for world in (2, 3):
        for rank in runs[world]:
            got = rank["loaded"]
            assert got.keys() == saved.keys()
            for k in saved:
                assert torch.equal(got[k], saved[k]), (world, k)
    # One process, no raggedfsdp at all: DCP fills plain full tensors.
    plain = OddModel()
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=path, no_dist=True)
    for k in saved:
        assert torch.equal(state[k], saved[k]), k


def test_load_full_state_dict_into_sharded_model(runs):
    full = runs["full"]
    for rank in runs[3]:
        got = rank["loaded_full"]
        for k in full:
            assert torch.equal(got[k], full[k]), k


def _async_save(rank: int, world: int, path: str) -> dict[str, Any]:
    """torchtitan's asynchronous checkpoint: ``dcp.async_save`` of the model's and the
    optimizer's state (DSD, sharded) over a subgroup's mesh, the parameters changed by the next
    step before the write is waited on; then a synchronous load into a fresh model."""
    torch.set_num_threads(1)
    mesh = DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu")

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(5)
        model = OddModel()
        rf.FSDPBackend(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        idx, targets = make_batches(1, 2 * world)[0]
        model(idx[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2]).backward()
        optimizer.step()
        optimizer.zero_grad()

    model, optimizer = build()
    step(model, optimizer)
    snapshot = rf.full_state_dict(model)
    model_state, optim_state = get_state_dict(model, optimizer)
    future = dcp.async_save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    step(model, optimizer)  # changes the parameters in place while the write may be running
    future.result()
    fresh, fresh_optimizer = build()
    model_state, optim_state = get_state_dict(fresh, fresh_optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])  # fmt: skip
    loaded = rf.full_state_dict(fresh)
    # the same next step from the loaded state reproduces the original's
    step(fresh, fresh_optimizer)
    return {"snapshot": snapshot, "loaded": loaded, "stepped": rf.full_state_dict(model),
            "loaded_then_stepped": rf.full_state_dict(fresh)}  # fmt: skip


def test_async_save_writes_the_state_as_it_was_when_called(runs):
    for rank in runs[2]:
        rank = rank["async"]
        for key, value in rank["snapshot"].items():
            assert torch.equal(rank["loaded"][key], value), key
            trained = not key.startswith("frozen")
            assert trained != torch.equal(rank["stepped"][key], value), key  # it changed
            assert torch.equal(rank["loaded_then_stepped"][key], rank["stepped"][key]), key


def _cases(paths: dict[str, str], full: dict, rank: int, world: int, group: None) -> dict:
    """W=4 saves; W=2 loads it (element policy) and saves asynchronously; W=3 loads it (whole
    tensors) and loads a full state dict."""
    if world == 4:
        return {"saved": _save(rank, world, paths["saved"])}
    if world == 2:
        return {
            "loaded": _load(rank, world, paths["saved"], None),
            "async": _async_save(rank, world, paths["async"]),
        }
    return {
        "loaded": _load(rank, world, paths["saved"], "whole"),
        "loaded_full": _load_full(rank, world, full),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[Any, Any]:
    root: Path = tmp_path_factory.mktemp("dcp")
    paths = {"saved": str(root / "saved"), "async": str(root / "async")}
    torch.manual_seed(7)
    full = copy.deepcopy(OddModel().state_dict())
    cases = functools.partial(_cases, paths, full)
    grid = run_world_grid(cases, [4, 2, 3], as_launches=True, timeout=600)
    return {**grid, "paths": paths, "full": full}
