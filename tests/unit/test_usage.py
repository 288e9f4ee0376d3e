"""Which parameters any rank used (``runtime/_usage.py``), in a group of one: units on two
meshes (two groups, each its own all-reduce and its own padded mask), parameters used or not in
each, read back to the right units. In a group of one there is nothing to agree with: no
all-reduce and no host read (FSDP2 issues no collective at world size 1), the flags still right.
(Two ranks read once per backward: tests/distributed/test_host_syncs.py.)"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import raggedfsdp as rf


class Unit(nn.Module):
    """``width`` small Linears, of which forward runs those in ``use``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(width))

    def forward(self, x: torch.Tensor, use: set[int]) -> torch.Tensor:
        return sum((layer(x) for i, layer in enumerate(self.layers) if i in use), x)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Unit(9)  # 18 parameters: its mask is padded to 32 bytes
        self.b = Unit(3)

    def forward(self, x: torch.Tensor, use_a: set[int], use_b: set[int]) -> torch.Tensor:
        return self.b(self.a(x, use_a), use_b).sum()


def _none(unit: Unit) -> list[bool]:
    return [layer.weight.grad is None for layer in unit.layers]


def test_units_on_two_meshes_get_their_own_flags(group_of_one) -> None:
    torch.manual_seed(0)
    model = Model()
    meshes = [DeviceMesh.from_group(dist.new_group([0]), "cpu") for _ in range(2)]
    rf.fully_shard(model.a, mesh=meshes[0])
    rf.fully_shard(model.b, mesh=meshes[1])
    rf.fully_shard(model, mesh=meshes[1])
    x = torch.randn(3, 2)
    model(x, {0, 8}, {2}).backward()
    assert _none(model.a) == [i not in {0, 8} for i in range(9)]
    assert _none(model.b) == [True, True, False]
    assert model.stats()["usage_all_reduces"] == 0  # alone on both meshes
    # Kept where held before the backward (as torch adds to it), None where it was none.
    model(x, {1}, {0}).backward()
    assert _none(model.a) == [i not in {0, 1, 8} for i in range(9)]
    assert _none(model.b) == [False, True, False]


def test_nothing_sent_or_read_alone(group_of_one, monkeypatch) -> None:
    model = Model()
    rf.fully_shard(model.a)
    rf.fully_shard(model)
    model(torch.randn(3, 2), set(range(9)), set(range(3))).backward()  # checks the plans once
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or tolist(t))
    model(torch.randn(3, 2), set(range(9)), set(range(3))).backward()
    model(torch.randn(3, 2), set(range(8)), set(range(3))).backward()
    assert reads == [] and model.stats()["usage_all_reduces"] == 0
    assert model.a.layers[8].weight.grad is not None  # held from the first backward
