"""What the optimizer tests share: the world sizes of their grid (run by
:func:`harness.run_world_grid`), sharded parameters on random layouts, stepping them beside their
single-device twins, the state dict round trip, gradients given to the parameters of a sharded
model from whole tensors, Muon on one device, and each structure-aware optimizer with the planner
that keeps its structures whole."""

from __future__ import annotations

import copy
import itertools
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import raggedfsdp as rf
from harness import Group, sharded_param
from raggedfsdp.layout import ShardLayout
from raggedfsdp.tensor import local_piece, local_range, placed_like

# One launch of max(WORLDS) ranks runs each optimizer's grid for all of them.
WORLDS = (1, 2, 3, 4)


def random_layout(rng: random.Random, shape: tuple[int, ...], unit: int, world: int) -> ShardLayout:
    """A layout of ``shape`` on ``world`` ranks, cut at random multiples of ``unit`` elements (or
    at the end); returns it. Empty ranks are allowed."""
    numel = math.prod(shape)
    units = -(-numel // unit)
    cuts = sorted(min(rng.randint(0, units) * unit, numel) for _ in range(world - 1))
    return ShardLayout(shape, unit, tuple(itertools.pairwise([0, *cuts, numel])))


def shard(full: torch.Tensor, layout: ShardLayout, rank: int, group: Group) -> nn.Parameter:
    """Returns rank's piece of ``full`` under ``layout`` as a parameter sharded on ``group``."""
    return sharded_param(layout.to_local(full, rank).clone(), layout, group)


def give_grad(param: nn.Parameter, piece: torch.Tensor) -> None:
    """Give the sharded ``param`` this rank's ``piece`` of its gradient."""
    param.grad = placed_like(piece, param)


def twin_params(
    fulls: Sequence[torch.Tensor], layouts: Sequence[ShardLayout], rank: int, group: Group
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Returns rank's sharded parameters of ``fulls`` and their single-device twins (copies)."""
    ours = [shard(f, lay, rank, group) for f, lay in zip(fulls, layouts, strict=True)]
    return ours, [nn.Parameter(f.clone()) for f in fulls]


def step_twins(
    ours: Sequence[nn.Parameter],
    single: Sequence[nn.Parameter],
    layouts: Sequence[ShardLayout],
    rank: int,
    gen: torch.Generator,
    opts: Sequence[torch.optim.Optimizer],
) -> None:
    """One step of every optimizer in ``opts`` on a fresh random gradient per parameter (drawn
    from ``gen`` in parameter order): the whole to each twin, rank's piece to its shard."""
    for p, s, lay in zip(ours, single, layouts, strict=True):
        g = torch.randn(s.shape, generator=gen)
        give_grad(p, lay.to_local(g, rank).clone())
        s.grad = g
    for o in opts:
        o.step()


def state_dict_round_trip(
    make: Callable[[list[nn.Parameter]], torch.optim.Optimizer], shape: tuple[int, ...], seed: int
) -> tuple[dict[str, Any], bool]:
    """One step of ``make([p])`` on a random bf16 parameter, then a fresh ``make`` on a copy of it,
    loaded from the original's state dict. Returns the resumed state of that copy as loaded (a
    deep copy) and whether both parameters are still bitwise equal after one more step of each
    on a gradient of ones."""
    gen = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(shape, generator=gen).bfloat16()) for _ in range(2)]
    opt = make([params[0]])
    params[0].grad = torch.randn(shape, generator=gen).bfloat16()
    opt.step()
    params[1].data.copy_(params[0].detach())
    resumed = make([params[1]])
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    # Copied: the tests check the state as loaded, not as the step below leaves it.
    state = copy.deepcopy(resumed.state[params[1]])
    for p in params:
        p.grad = torch.ones(shape, dtype=torch.bfloat16)
    opt.step()
    resumed.step()
    return state, torch.equal(params[0], params[1])


def set_whole_grads(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    """Give each parameter of the sharded ``model`` this rank's piece of ``grads[name]`` (whole
    gradients, the same on every rank): its tensor- or expert-parallel slice (``Shard``
    placements, split as DTensor splits), then its ragged range of that slice."""
    for name, param in model.named_parameters():
        whole = grads[name]
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            for dim, placement in enumerate(param.placements):
                if isinstance(placement, Shard):
                    whole = whole.chunk(mesh.size(dim), placement.dim)[mesh.get_local_rank(dim)]
        start, end = local_range(param)
        param.grad = torch.zeros_like(param)
        local_piece(param.grad).view(-1).copy_(whole.reshape(-1)[start:end])


def muon_on_one_device(
    model: nn.Module, steps: Sequence[dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """What ``rf.optim.Muon(model.named_parameters(), adamw_params=<not a matrix>)`` at its
    defaults must give: torch's Muon on the matrices of the unsharded ``model`` (changed in
    place) and the auxiliary AdamW on the rest, each step given ``steps[i]``'s whole gradients;
    the state dict after."""
    matrices = [p for p in model.parameters() if p.dim() == 2]
    others = [p for p in model.parameters() if p.dim() != 2]
    adamw = torch.optim.AdamW(others, lr=3e-4, weight_decay=0.01)  # Muon's auxiliary AdamW
    optimizers = [torch.optim.Muon(matrices), adamw]
    for step in steps:
        for name, p in model.named_parameters():
            p.grad = step[name].clone()
        for optimizer in optimizers:
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def structured_optimizer(
    kind: str, model: nn.Module, aux: Callable[[str], bool], min_8bit_numel: int
) -> torch.optim.Optimizer:
    """``rf.optim``'s ``kind`` (muon, shampoo, adamw8bit) over ``model``'s parameters, with the
    settings of :func:`structured_planner`; Muon hands the parameters ``aux`` names (and every
    one below 2-D) to its AdamW."""
    params = list(model.parameters())
    if kind == "muon":
        to_adamw = {id(p) for name, p in model.named_parameters() if aux(name)}
        return rf.optim.Muon(
            params, lr=0.02, adamw_params=lambda p, shape: id(p) in to_adamw or len(shape) < 2
        )
    if kind == "shampoo":
        return rf.optim.Shampoo(
            params, lr=1e-2, max_preconditioner_dim=16, precondition_frequency=1
        )
    return rf.optim.AdamW8bit(params, lr=1e-2, min_8bit_numel=min_8bit_numel)


def structured_planner(kind: str) -> rf.StructAwarePlanner:
    """The planner that keeps ``kind``'s structures whole (Shampoo's blocks of 16)."""
    if kind == "shampoo":
        return rf.StructAwarePlanner("shampoo", max_preconditioner_dim=16)
    return rf.StructAwarePlanner(kind)
