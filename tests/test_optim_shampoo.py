"""Block Shampoo on shards of whole row-blocks equals the single-device run; errors and grafting.

One Gloo launch of 4 ranks runs the grid for every world size W = 1..4 on the group of the first
W ranks; the tests judge its collected results.
"""

from __future__ import annotations

import copy
import itertools
import math
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run_distributed
from raggedfsdp.layout import ShardInfo, ShardLayout, mark_sharded, row_numel
from raggedfsdp.optim import Shampoo

Group = dist.ProcessGroup | None
WORLDS = (1, 2, 3, 4)
DIM = 4  # max_preconditioner_dim: small, so matrices have several blocks and partial edges
SHAPES = [(12, 10), (10, 6), (2, 6, 5), (4, 2, 2, 2), (7,)]  # matrix, partial, stack, conv, bias


def _block_layout(rng: random.Random, shape: tuple[int, ...], world: int) -> ShardLayout:
    """Random cuts on whole blocks of DIM rows (elements for 1-D), empty ranks allowed."""
    numel = math.prod(shape)
    unit = DIM * row_numel(shape) if len(shape) >= 2 else 1
    units = -(-numel // unit)
    cuts = sorted(min(rng.randint(0, units) * unit, numel) for _ in range(world - 1))
    return ShardLayout(shape, unit, tuple(itertools.pairwise([0, *cuts, numel])))


def _shard(full: torch.Tensor, layout: ShardLayout, rank: int, group: Group) -> nn.Parameter:
    param = nn.Parameter(layout.to_local(full, rank).clone())
    mark_sharded(param, ShardInfo(layout, rank, group))
    return param


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
    ours = [_shard(f, lay, rank, group) for f, lay in zip(fulls, layouts, strict=True)]
    single = [nn.Parameter(f.clone()) for f in fulls]
    opts = [Shampoo(ours, **options), Shampoo(single, **options)]
    worst, bitwise = 0.0, True
    for _ in range(5):
        for p, s, lay in zip(ours, single, layouts, strict=True):
            g = torch.randn(s.shape, generator=gen)
            p.grad, s.grad = lay.to_local(g, rank).clone(), g
        for o in opts:
            o.step()
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
    param = _shard(torch.randn(shape), layout, rank, group)
    before = param.detach().clone()
    opt = Shampoo([param], max_preconditioner_dim=DIM)
    param.grad = torch.ones(param.shape)
    if rank == world - 1 and param.numel():
        param.grad.view(-1)[0] = math.inf
    with pytest.warns(RuntimeWarning, match="skipped a step"):
        opt.step()
    return {"skipped": opt.skipped_steps, "unchanged": torch.equal(param.detach(), before)}


def _shampoo_grid(rank: int, world: int) -> dict[int, dict[str, object]]:
    groups = {w: dist.new_group(list(range(w))) if 1 < w < world else None for w in WORLDS}
    out: dict[int, dict[str, object]] = {}
    for w, group in groups.items():
        if rank < w:
            out[w] = {
                "parity": [_parity_case(rank, w, group, seed) for seed in range(3)],
                "nonfinite": _nonfinite_case(rank, w, group),
            }
    return out


@pytest.fixture(scope="module")
def grid() -> list[dict[int, dict[str, object]]]:
    return run_distributed(_shampoo_grid, max(WORLDS))


@pytest.mark.parametrize("world", WORLDS)
def test_sharded_shampoo_equals_single_device(grid, world: int) -> None:
    """Within fp32 round-off (1e-5 relative); bitwise in practice, reported if not."""
    cases = [case for rank in range(world) for case in grid[rank][world]["parity"]]
    worst = max(case["max_rel_diff"] for case in cases)
    assert worst <= 1e-5, worst
    if not all(case["bitwise"] for case in cases):
        print(f"W={world}: Shampoo sharded differs from single device by {worst:.2g} (relative)")


@pytest.mark.parametrize("world", WORLDS)
def test_nonfinite_gradient_skips_on_every_rank(grid, world: int) -> None:
    for rank in range(world):
        assert grid[rank][world]["nonfinite"] == {"skipped": 1, "unchanged": True}


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
    gen = torch.Generator().manual_seed(4)
    params = [nn.Parameter(torch.randn(6, 5, generator=gen).bfloat16()) for _ in range(2)]
    opt = Shampoo([params[0]], max_preconditioner_dim=4)
    params[0].grad = torch.randn(6, 5, generator=gen).bfloat16()
    opt.step()
    params[1].data.copy_(params[0].detach())
    resumed = Shampoo([params[1]], max_preconditioner_dim=4)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    state = resumed.state[params[1]]
    assert all(m.dtype == torch.float32 for key in ("L", "R", "L_inv_root") for m in state[key])
    for p in params:
        p.grad = torch.ones(6, 5, dtype=torch.bfloat16)
    opt.step()
    resumed.step()
    assert torch.equal(params[0], params[1])


def test_bad_hyper_parameters_are_named() -> None:
    param = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="max_preconditioner_dim"):
        Shampoo([param], max_preconditioner_dim=0)
    with pytest.raises(ValueError, match="betas"):
        Shampoo([param], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="start_preconditioning_step"):
        Shampoo([param], start_preconditioning_step=0)
