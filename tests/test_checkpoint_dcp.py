"""DCP checkpoints of ragged shards: save at one world size, load at others and elsewhere."""

from __future__ import annotations

import copy
import tempfile

import torch
import torch.distributed.checkpoint as dcp

import raggedfsdp as rf
from harness import run_distributed
from parity_models import OddModel


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


def test_save_at_4_reload_at_2_3_and_single_process():
    with tempfile.TemporaryDirectory() as path:
        saved = run_distributed(_save, 4, path)[0]
        for world, block in ((2, None), (3, "whole")):
            for got in run_distributed(_load, world, path, block):
                assert got.keys() == saved.keys()
                for k in saved:
                    assert torch.equal(got[k], saved[k]), (world, k)
        # One process, no raggedfsdp at all: DCP fills plain full tensors.
        plain = OddModel()
        state = plain.state_dict()
        dcp.load(state, checkpoint_id=path, no_dist=True)
        for k in saved:
            assert torch.equal(state[k], saved[k]), k


def test_load_full_state_dict_into_sharded_model():
    torch.manual_seed(7)
    full = copy.deepcopy(OddModel().state_dict())
    for got in run_distributed(_load_full, 3, full):
        for k in full:
            assert torch.equal(got[k], full[k]), k
