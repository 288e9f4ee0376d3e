"""Block Shampoo on shards of whole row-blocks equals the single-device run; errors and grafting.

One Gloo launch of 4 ranks runs the grid for every world size W = 1..4 on the group of the first
W ranks; the tests judge its collected results.
"""

from __future__ import annotations

import functools
import itertools
import math
import random

import pytest
import torch
from torch import nn

from harness import Group, world_grid_fixture
from optim_grid import WORLDS, random_layout, shard, state_dict_round_trip, step_twins, twin_params
from raggedfsdp.layout import ShardInfo, ShardLayout, mark_sharded, row_numel
from raggedfsdp.optim import Shampoo

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
            expected = lay.to_local(s.detach(), rank)
            bitwise &= torch.equal(p.detach(), expected)
            if p.numel():
                scale = expected.abs().max().item()
                worst = max(worst, (p.detach() - expected).abs().max().item() / scale)
    return {"max_rel_diff": worst, "bitwise": bitwise}


def _nonfinite_case(rank: int, world: int, group: Group) -> dict[str, object]:
    """An Inf on the last rank only: every rank skips the step."""
    shape = (8, 3)
    layout = _block_layout(random.Random(0), shape, world)
    param = shard(torch.randn(shape), layout, rank, group)
    before = param.detach().clone()
    opt = Shampoo([param], max_preconditioner_dim=DIM)
    param.grad = torch.ones(param.shape)
    if rank == world - 1 and param.numel():
        param.grad.view(-1)[0] = math.inf
    with pytest.warns(RuntimeWarning, match="skipped a step"):
        opt.step()
    return {"skipped": opt.skipped_steps, "unchanged": torch.equal(param.detach(), before)}


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


def test_layout_cutting_a_block_is_named() -> None:
    # Blocks of 2 rows × 4 columns; rank 0 ends after 3 rows, inside block 1 (rows 2-3).
    layout = ShardLayout((8, 4), 4, ((0, 12), (12, 32)))
    param = nn.Parameter(layout.to_local(torch.zeros(8, 4), 0).clone())
    mark_sharded(param, ShardInfo(layout, 0, None))
    with pytest.raises(ValueError, match=r"'w'.*block 1 \(elements \[8, 16\)\).*unit is 4"):
        Shampoo([("w", param)], max_preconditioner_dim=2)


def test_grafting_gives_each_block_adams_step_length() -> None:
    """Per block, the update's Frobenius norm is lr · the Adam direction's norm."""
    gen = torch.Generator().manual_seed(3)
    param = nn.Parameter(torch.randn(6, 5, generator=gen))
    before = param.detach().clone()
    opt = Shampoo([param], lr=0.1, max_preconditioner_dim=4, epsilon=1e-6)
    param.grad = torch.randn(6, 5, generator=gen)
    opt.step()
    # At step 1 the bias-corrected Adam direction is g / (|g| + eps) elementwise.
    adam = param.grad / (param.grad.abs() + 1e-8)
    step = before - param.detach()
    for rows, cols in itertools.product((slice(0, 4), slice(4, 6)), (slice(0, 4), slice(4, 5))):
        expected = 0.1 * adam[rows, cols].norm()
        assert torch.allclose(step[rows, cols].norm(), expected, rtol=1e-5)
    assert not torch.allclose(step, 0.1 * adam, rtol=1e-3)  # the direction is not Adam's


def test_state_dict_round_trip_keeps_fp32_preconditioners() -> None:
    make = functools.partial(Shampoo, max_preconditioner_dim=4)
    state, equal_after_step = state_dict_round_trip(make, (6, 5), seed=4)
    assert all(m.dtype == torch.float32 for key in ("L", "R", "L_inv_root") for m in state[key])
    assert equal_after_step


def test_bad_hyper_parameters_are_named() -> None:
    param = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="max_preconditioner_dim"):
        Shampoo([param], max_preconditioner_dim=0)
    with pytest.raises(ValueError, match="betas"):
        Shampoo([param], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="start_preconditioning_step"):
        Shampoo([param], start_preconditioning_step=0)
