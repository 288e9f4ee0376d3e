"""8-bit AdamW on block-aligned shards: codes, scales and parameters bitwise the single-device
ones; eligibility by global size; a non-finite gradient skipped on every rank. (The maps, the
quantizer and the errors, in one process: tests/unit/test_optim_adamw8bit_one_device.py.)

One Gloo launch of 4 ranks runs the grid for every world size W = 1..4 on the group of the first
W ranks; the tests judge its collected results.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from harness import Group, assert_no_failures, world_grid_fixture
from optim_grid import WORLDS, give_grad, random_layout, shard, step_twins, twin_params
from raggedfsdp.layout import ShardLayout
from raggedfsdp.optim import AdamW8bit
from raggedfsdp.tensor import local_piece

FLAT_SHAPES = [(64, 96), (5000,), (16, 16), (8192,)]  # 2-D, partial last block, small, global-only
TILE_SHAPES = [(96, 64), (100, 48), (4500,)]  # whole tiles, partial edge tiles, 1-D (flat blocks)


def _torchao_rule(local_numel: int, block_size: int = 256) -> bool:
    """torchao's eligibility test, made on the LOCAL shard's size (ao#4912)."""
    return local_numel >= 4096 and local_numel % block_size == 0


def _local_scales(scales: torch.Tensor, layout: ShardLayout, rank: int, rows: int) -> torch.Tensor:
    """The single-device scales of the blocks rank holds: ``rows`` elements per block row."""
    start, end = layout.ranges[rank]
    return scales[start // rows : -(-end // rows)] if end > start else scales[:0]


def _parity_case(
    rank: int, world: int, group: Group, seed: int, tiles: bool
) -> tuple[list[str], dict[str, bool]]:
    """Sharded vs single-device AdamW8bit over 3 steps; returns mismatches and decisions."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    shapes = TILE_SHAPES if tiles else FLAT_SHAPES
    options = {"lr": 0.01, "weight_decay": 0.1, "block_shape": (32, 32) if tiles else None}

    def unit(shape: tuple[int, ...]) -> int:
        return 32 * shape[-1] if tiles and len(shape) == 2 else 256

    fulls = [torch.randn(s, generator=gen) for s in shapes]
    # Cuts at multiples of a quantization block: a block row of tiles, else 256 elements.
    layouts = [random_layout(rng, s, unit(s), world) for s in shapes]
    ours, single = twin_params(fulls, layouts, rank, group)
    opts = [AdamW8bit(ours, **options), AdamW8bit(single, **options)]
    failures: list[str] = []
    for step in range(3):
        step_twins(ours, single, layouts, rank, gen, opts)
        for i, (p, s, lay) in enumerate(zip(ours, single, layouts, strict=True)):
            where = f"seed {seed} step {step} {shapes[i]} {lay.ranges}"
            if not torch.equal(local_piece(p).detach(), lay.to_local(s.detach(), rank)):
                failures.append(f"{where}: parameter")
            mine = {k: local_piece(v) for k, v in opts[0].state[p].items()}
            ref = opts[1].state[s]
            if "exp_avg_codes" not in ref:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                if not torch.equal(mine[f"{key}_codes"], lay.to_local(ref[f"{key}_codes"], rank)):
                    failures.append(f"{where}: {key} codes")
                # Tile rows of 32 matrix rows, or one row of flat 256-element blocks.
                scales = ref[f"{key}_scales"]
                expected = (
                    _local_scales(scales, lay, rank, unit(shapes[i]))
                    if tiles and len(shapes[i]) == 2
                    else _local_scales(scales[0], lay, rank, 256)[None]
                )
                if not torch.equal(mine[f"{key}_scales"], expected):
                    failures.append(f"{where}: {key} scales")
    decisions = {}
    if not tiles:
        # The (8192,) parameter: quantized by its global size on every rank.
        p, lay = ours[-1], layouts[-1]
        decisions = {
            "ours": "exp_avg_codes" in opts[0].state[p],
            "torchao_local": _torchao_rule(lay.local_numel(rank)),
        }
    return failures, decisions


def _even_eligibility(rank: int, world: int, group: Group) -> dict[str, bool]:
    """An (8192,) parameter split evenly: torchao's local rule changes its mind from W=3."""
    piece = 256 * -(-32 // world)  # as even as whole 256-element blocks allow
    cuts = [min(r * piece, 8192) for r in range(world + 1)]
    layout = ShardLayout((8192,), 256, tuple(itertools.pairwise(cuts)))
    param = shard(torch.randn(8192), layout, rank, group)
    opt = AdamW8bit([param])
    give_grad(param, torch.randn(local_piece(param).shape))
    opt.step()
    return {
        "ours": "exp_avg_codes" in opt.state[param],
        "torchao_local": _torchao_rule(layout.local_numel(rank)),
    }


def _nonfinite_case(rank: int, world: int, group: Group) -> dict[str, object]:
    layout = random_layout(random.Random(1), (4096,), 256, world)
    param = shard(torch.randn(4096), layout, rank, group)
    before = local_piece(param).detach().clone()
    opt = AdamW8bit([param])
    grad = torch.zeros(before.shape)
    if rank == 0 and grad.numel():
        grad[0] = math.nan
    give_grad(param, grad)
    with pytest.warns(RuntimeWarning, match="skipped a step"):
        opt.step()
    return {"skipped": opt.skipped_steps, "unchanged": torch.equal(local_piece(param), before)}


def _adamw8bit_cases(rank: int, world: int, group: Group) -> dict[str, object]:
    """Every case of one world size on this rank; returns their results by name."""
    failures, decisions = [], []
    for seed, tiles in itertools.product(range(3), (False, True)):
        fails, decided = _parity_case(rank, world, group, seed, tiles)
        failures += fails
        if decided:
            decisions.append(decided)
    return {
        "failures": failures,
        "random_decisions": decisions,
        "even_decision": _even_eligibility(rank, world, group),
        "nonfinite": _nonfinite_case(rank, world, group),
    }


grid = world_grid_fixture(_adamw8bit_cases, WORLDS)


@pytest.mark.parametrize("world", WORLDS)
def test_sharded_codes_scales_params_bitwise(grid, world: int) -> None:
    assert_no_failures(grid, world)


@pytest.mark.parametrize("world", WORLDS)
def test_eligibility_is_global(grid, world: int) -> None:
    """Quantized on every rank by global numel; torchao's local rule disagrees from W=3 (and on
    ragged layouts), which would change the maths with the mesh."""
    results = grid[world]
    assert all(d["ours"] for r in results for d in [r["even_decision"], *r["random_decisions"]])
    local = [r["even_decision"]["torchao_local"] for r in results]
    assert local == [world <= 2] * world  # ~8192/W elements: >= 4096 only for W <= 2


@pytest.mark.parametrize("world", WORLDS)
def test_nonfinite_gradient_skips_on_every_rank(grid, world: int) -> None:
    for result in grid[world]:
        assert result["nonfinite"] == {"skipped": 1, "unchanged": True}
