"""A model built on the meta device, sharded, then loaded with ``load_state_dict(assign=True)``:
the values assigned in place of the meta shards become the shards (what DSD's
``set_model_state_dict`` does to a meta model and accelerate's ``cpu_ram_efficient_loading``
does after sharding on meta). rf and FSDP2 in one launch (2 Gloo ranks)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import distribute_tensor

import raggedfsdp as rf
from harness import run_distributed

IMPLS = {"rf": rf.fully_shard, "fsdp2": fsdp2_fully_shard}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 10)
        self.b = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _on_meta(impl: str) -> Net:
    with torch.device("meta"):
        model = Net()
    IMPLS[impl](model.a)
    IMPLS[impl](model)
    return model


def _outcome(model: Net) -> dict[str, Any]:
    devices = sorted({str(p.to_local().device) for p in model.parameters()})
    try:
        output = model(torch.ones(2, 6)).detach()
    except RuntimeError as e:
        output = str(e)
    return {"devices": devices, "output": output}


def _cases(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = Net()
    full = reference.state_dict()
    out: dict[str, Any] = {"reference": reference(torch.ones(2, 6)).detach()}
    for impl in IMPLS:
        # load_state_dict(assign=True) of values placed like the meta shards
        model = _on_meta(impl)
        placed = {
            k: distribute_tensor(full[k], v.device_mesh, v.placements)
            for k, v in model.state_dict().items()
        }
        model.load_state_dict(placed, assign=True)
        out[f"{impl}/assign"] = _outcome(model)
        # DSD: the full state from rank 0 only, broadcast into the meta model
        model = _on_meta(impl)
        given = {k: v.clone() for k, v in full.items()} if rank == 0 else {}  # DSD mutates it
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, given, options=options)
        out[f"{impl}/dsd"] = _outcome(model)
    # negative control: a meta model nothing was loaded into refuses to run, naming a parameter
    out["unloaded"] = _outcome(_on_meta("rf"))
    return out


def test_values_assigned_in_place_of_meta_shards_become_the_shards():
    for rank in run_distributed(_cases, 2):
        for impl in IMPLS:
            for case in ("assign", "dsd"):
                got = rank[f"{impl}/{case}"]
                assert got["devices"] == ["cpu"], (impl, case, got)
                torch.testing.assert_close(got["output"], rank["reference"], msg=(impl, case))
        assert rank["unloaded"]["devices"] == ["meta"]
        assert "still on the meta device" in rank["unloaded"]["output"]
        assert "a.weight" in rank["unloaded"]["output"]
