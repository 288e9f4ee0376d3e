"""Block Shampoo on shards of whole row-blocks equals the single-device run; a non-finite
gradient is skipped on every rank. (Errors and grafting, in one process:
tests/unit/test_optim_shampoo_one_device.py.)

One Gloo launch of 4 ranks runs the grid for every world size W = 1..4 on the group of the first
W ranks; the tests judge its collected results.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from harness import Group, world_grid_fixture
from optim_grid import WORLDS, give_grad, random_layout, shard, step_twins, twin_params
from raggedfsdp.layout import ShardLayout, row_numel
from raggedfsdp.optim import Shampoo
from raggedfsdp.tensor import local_piece

DIM = 4  # max_preconditioner_dim: small, so matrices have several blocks and partial edges
SHAPES = [(12, 10), (10, 6), (2, 6, 5), (4, 2, 2, 2), (7,)]  # matrix, partial, stack, conv, bias


def _block_layout(rng: random.Random, shape: tuple[int, ...], world: int) -> ShardLayout:
    """Random cuts on whole blocks of DIM rows (elements for 1-D), empty ranks allowed."""
    unit = DIM * row_numel(shape) if len(shape) >= 2 else 1
    return random_layout(rng, shape, unit, world)


def _parity_case(rank: int, world: int, group: Group, seed: int) -> dict[str, float | bool]:
    """Sharded vs single-device Shampoo over 5 steps (preconditioning from step 2, every 2)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    fulls = [torch.randn(s, generator=gen) for s in SHAPES]
    layouts = [_block_layout(rng, s, world) for s in SHAPES]
    options = {
        "lr": 0.01,
        "weight_decay": 0.01,
        "max_preconditioner_dim": DIM,
        "precondition_frequency": 2,
        "start_preconditioning_step": 2,
        "shampoo_beta2": 1.0 if seed % 2 == 0 else 0.99,
        "epsilon": 1e-6,
    }
    ours, single = twin_params(fulls, layouts, rank, group)
    opts = [Shampoo(ours, **options), Shampoo(single, **options)]
    worst, bitwise = 0.0, True
    for _ in range(5):
        step_twins(ours, single, layouts, rank, gen, opts)
        for p, s, lay in zip(ours, single, layouts, strict=True):
            mine, expected = local_piece(p).detach(), lay.to_local(s.detach(), rank)
            bitwise &= torch.equal(mine, expected)
            if mine.numel():
                scale = expected.abs().max().item()
                worst = max(worst, (mine - expected).abs().max().item() / scale)
    return {"max_rel_diff": worst, "bitwise": bitwise}


def _nonfinite_case(rank: int, world: int, group: Group) -> dict[str, object]:
    """An Inf on the last rank only: every rank skips the step."""
    shape = (8, 3)
    layout = _block_layout(random.Random(0), shape, world)
    param = shard(torch.randn(shape), layout, rank, group)
    before = local_piece(param).detach().clone()
    opt = Shampoo([param], max_preconditioner_dim=DIM)
    grad = torch.ones(before.shape)
    if rank == world - 1 and grad.numel():
        grad.view(-1)[0] = math.inf
    give_grad(param, grad)
    with pytest.warns(RuntimeWarning, match="skipped a step"):
        opt.step()
    return {"skipped": opt.skipped_steps, "unchanged": torch.equal(local_piece(param), before)}


def _shampoo_cases(rank: int, world: int, group: Group) -> dict[str, object]:
    """Every case of one world size on this rank; returns their results by name."""
    return {
        "parity": [_parity_case(rank, world, group, seed) for seed in range(3)],
        "nonfinite": _nonfinite_case(rank, world, group),
    }


grid = world_grid_fixture(_shampoo_cases, WORLDS)


@pytest.mark.parametrize("world", WORLDS)
def test_sharded_shampoo_equals_single_device(grid, world: int) -> None:
    """Within fp32 round-off (1e-5 relative); bitwise in practice, reported if not."""
    cases = [case for result in grid[world] for case in result["parity"]]
    worst = max(case["max_rel_diff"] for case in cases)
    assert worst <= 1e-5, worst
    if not all(case["bitwise"] for case in cases):
        print(f"W={world}: Shampoo sharded differs from single device by {worst:.2g} (relative)")


@pytest.mark.parametrize("world", WORLDS)
def test_nonfinite_gradient_skips_on_every_rank(grid, world: int) -> None:
    for result in grid[world]:
        assert result["nonfinite"] == {"skipped": 1, "unchanged": True}
