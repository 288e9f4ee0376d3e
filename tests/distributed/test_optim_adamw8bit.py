"""8-bit AdamW on block-aligned shards: codes, scales and parameters bitwise the single-device
ones; eligibility by global size; errors; the quantization maps.

One Gloo launch of 4 ranks runs the grid for every world size W = 1..4 on the group of the first
W ranks; the tests judge its collected results.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch import nn

from harness import Group, assert_no_failures, world_grid_fixture
from optim_grid import WORLDS, random_layout, shard, state_dict_round_trip, step_twins, twin_params
from raggedfsdp.layout import ShardInfo, ShardLayout, mark_sharded
from raggedfsdp.optim import AdamW8bit
from raggedfsdp.optim.adamw8bit import dequantize_blocks, dynamic_map, quantize_blocks

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
            if not torch.equal(p.detach(), lay.to_local(s.detach(), rank)):
                failures.append(f"{where}: parameter")
            mine, ref = opts[0].state[p], opts[1].state[s]
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
    param.grad = torch.randn(param.shape)
    opt.step()
    return {
        "ours": "exp_avg_codes" in opt.state[param],
        "torchao_local": _torchao_rule(layout.local_numel(rank)),
    }


def _nonfinite_case(rank: int, world: int, group: Group) -> dict[str, object]:
    layout = random_layout(random.Random(1), (4096,), 256, world)
    param = shard(torch.randn(4096), layout, rank, group)
    before = param.detach().clone()
    opt = AdamW8bit([param])
    param.grad = torch.zeros(param.shape)
    if rank == 0 and param.numel():
        param.grad[0] = math.nan
    with pytest.warns(RuntimeWarning, match="skipped a step"):
        opt.step()
    return {"skipped": opt.skipped_steps, "unchanged": torch.equal(param.detach(), before)}


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


def test_dynamic_maps() -> None:
    signed, unsigned = dynamic_map(signed=True), dynamic_map(signed=False)
    for qmap in (signed, unsigned):
        assert qmap.shape == (256,) and qmap.dtype == torch.float32
        assert torch.all(qmap[1:] > qmap[:-1])  # sorted, no duplicates
        assert qmap[-1] == 1.0 and 0.0 in qmap
    assert signed[0] < -0.99 and (signed < 0).sum() == 127
    assert unsigned[0] == 0.0
    # Dense near zero: the smallest non-zero magnitude is 10^-6 scale.
    assert unsigned[1] < 1e-6


@pytest.mark.parametrize("block_shape", [(1, 256), (32, 32), (5, 7)])
def test_quantize_round_trip_error_is_small(block_shape: tuple[int, int]) -> None:
    x = torch.randn(70, 90, generator=torch.Generator().manual_seed(5))
    for qmap, values in ((dynamic_map(True), x), (dynamic_map(False), x * x)):
        codes, scales = quantize_blocks(values, block_shape, qmap)
        assert codes.dtype == torch.uint8 and codes.shape == values.shape
        assert scales.shape == (-(-70 // block_shape[0]), -(-90 // block_shape[1]))
        back = dequantize_blocks(codes, scales, block_shape, qmap)
        # The map's widest gap is ~0.03 of the block absmax, so the error is at most ~0.015.
        error = (back - values).abs().max() / values.abs().max()
        assert error < 0.02, error


def test_close_to_fp32_adamw() -> None:
    gen = torch.Generator().manual_seed(6)
    ours = nn.Parameter(torch.randn(64, 80, generator=gen))
    ref = nn.Parameter(ours.detach().clone())
    start = ours.detach().clone()
    opts = [AdamW8bit([ours], lr=0.01), torch.optim.AdamW([ref], lr=0.01)]
    for _ in range(10):
        g = torch.randn(64, 80, generator=gen)
        ours.grad, ref.grad = g.clone(), g
        for o in opts:
            o.step()
    relative = (ours - ref).norm() / (ref - start).norm()
    assert relative < 0.05, relative


def test_small_parameters_get_torch_adamw_exactly() -> None:
    gen = torch.Generator().manual_seed(7)
    ours = nn.Parameter(torch.randn(16, 16, generator=gen))
    ref = nn.Parameter(ours.detach().clone())
    opts = [AdamW8bit([ours], lr=0.01), torch.optim.AdamW([ref], lr=0.01)]
    for _ in range(3):
        g = torch.randn(16, 16, generator=gen)
        ours.grad, ref.grad = g.clone(), g
        for o in opts:
            o.step()
    assert torch.equal(ours, ref)


@pytest.mark.parametrize(
    ("ranges", "options", "message"),
    [
        (((0, 100), (100, 6144)), {}, r"'w'.*block 0 \(elements \[0, 256\)\).*unit is 1"),
        (((0, 16 * 96), (16 * 96, 6144)), {"block_shape": (32, 32)}, r"'w'.*32×32 tiles"),
    ],
)
def test_layout_cutting_a_block_is_named(ranges, options, message) -> None:
    layout = ShardLayout((64, 96), 1, ranges)
    param = nn.Parameter(layout.to_local(torch.zeros(64, 96), 0).clone())
    mark_sharded(param, ShardInfo(layout, 0, None))
    with pytest.raises(ValueError, match=message):
        AdamW8bit([("w", param)], **options)


def test_state_dict_round_trip_keeps_codes_and_scales() -> None:
    state, equal_after_step = state_dict_round_trip(AdamW8bit, (64, 64), seed=8)
    assert state["exp_avg_codes"].dtype == torch.uint8
    assert state["exp_avg_sq_scales"].dtype == torch.float32
    assert equal_after_step


def test_bad_hyper_parameters_are_named() -> None:
    param = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="block_numel"):
        AdamW8bit([param], block_numel=0)
    with pytest.raises(ValueError, match="block_shape"):
        AdamW8bit([param], block_shape=(32,))
    with pytest.raises(ValueError, match="betas"):
        AdamW8bit([param], betas=(1.5, 0.9))


def test_table_quantizer_equals_bucketize_exactly() -> None:
    """The table lookup of quantize_blocks picks the same code as a binary search everywhere,
    including on every midpoint, its float neighbours, signed zeros and tiny values."""
    from raggedfsdp.optim.adamw8bit import _NearestCode

    g = torch.Generator().manual_seed(0)
    for signed in (True, False):
        qmap = dynamic_map(signed)
        mids = (qmap[:-1] + qmap[1:]) / 2
        x = torch.rand(200_000, generator=g) * (2 if signed else 1) - (1 if signed else 0)
        x = x * torch.rand(200_000, generator=g) ** 8  # dense near 0, where the map is
        edges = [mids, mids.nextafter(torch.tensor(2.0)), mids.nextafter(torch.tensor(-2.0))]
        specials = torch.tensor([0.0, -0.0, 1.0, 1e-30, -1e-30, 1e-45, qmap[0].item()])
        x = torch.cat([x, *edges, specials])
        want = torch.bucketize(x, mids, out_int32=True).to(torch.uint8)
        assert torch.equal(_NearestCode.of(qmap, x.device)(x), want)
