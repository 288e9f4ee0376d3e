"""clip_grad_norm_ over ragged shards: torch's result on the full gradients, the same on every
rank, with one all-reduce per shard process group.

One Gloo launch of 4 ranks runs the grid for every world size W = 1..4 on the group of the first
W ranks; the tests judge its collected results.
"""

from __future__ import annotations

import itertools
import math
import random
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run_distributed, sharded_param
from raggedfsdp.clip import clip_grad_norm_
from raggedfsdp.layout import ShardLayout
from raggedfsdp.tensor import local_piece, placed_like

WORLDS = (1, 2, 3, 4)
SHAPES = [(5, 7), (3, 4, 6), (11,), (2, 3)]
NORMS = (2.0, 1.0, 3.0, math.inf)


def _ragged_layout(rng: random.Random, shape: tuple[int, ...], world: int) -> ShardLayout:
    """Random cuts at element or row granularity, empty ranks allowed."""
    numel = math.prod(shape)
    unit = rng.choice([1, shape[-1]])
    units = -(-numel // unit)
    cuts = sorted(min(rng.randint(0, units) * unit, numel) for _ in range(world - 1))
    return ShardLayout(shape, unit, tuple(itertools.pairwise([0, *cuts, numel])))


def _case(rank: int, world: int, groups: list, seed: int, norm_type: float, max_norm: float):
    """Sharded params on two process groups plus one replicated param, vs torch on full grads."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(s, generator=gen) * 10 ** rng.uniform(-1, 1) for s in SHAPES]
    layouts = [_ragged_layout(rng, s, world) for s in SHAPES[:-1]]
    ours = []
    for i, (g, lay) in enumerate(zip(grads, layouts, strict=False)):
        p = sharded_param(torch.zeros(lay.local_shape(rank)), lay, groups[i % 2])
        p.grad = placed_like(lay.to_local(g, rank).clone(), p)
        ours.append(p)
    replicated = nn.Parameter(torch.zeros(SHAPES[-1]))
    replicated.grad = grads[-1].clone()
    ours.append(replicated)
    full = [nn.Parameter(torch.zeros(s)) for s in SHAPES]
    for p, g in zip(full, grads, strict=True):
        p.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(full, max_norm, norm_type)
    with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as all_reduce:
        total = clip_grad_norm_(ours, max_norm, norm_type)
    clipped_ok = all(
        torch.allclose(local_piece(p.grad), lay.to_local(f.grad, rank), rtol=1e-5, atol=0)
        for p, f, lay in zip(ours, full, layouts, strict=False)
    ) and torch.allclose(replicated.grad, full[-1].grad, rtol=1e-5, atol=0)
    return {
        "total": total.item(),
        "expected": expected.item(),
        "clipped_ok": clipped_ok,
        "all_reduces": all_reduce.call_count,
    }


def _nonfinite(rank: int, world: int, group) -> str:
    layout = ShardLayout((world, 2), 2, tuple((2 * r, 2 * r + 2) for r in range(world)))
    p = sharded_param(torch.zeros(1, 2), layout, group)
    p.grad = placed_like(torch.tensor([[math.nan if rank == world - 1 else 1.0, 1.0]]), p)
    try:
        clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    except RuntimeError as error:
        return str(error)
    return "no error"


def _clip_grid(rank: int, world: int) -> dict[int, dict[str, object]]:
    # Per world size two distinct process groups over the same ranks (the default one at W=4).
    groups = {
        w: [
            dist.new_group(list(range(w))) if 1 < w < world else None,
            dist.new_group(list(range(w))) if w > 1 else None,
        ]
        for w in WORLDS
    }
    out: dict[int, dict[str, object]] = {}
    for w, pair in groups.items():
        if rank >= w:
            continue
        cases = [
            _case(rank, w, pair, seed, norm_type, max_norm)
            for seed, norm_type, max_norm in itertools.product(range(3), NORMS, (0.5, 1e6))
        ]
        out[w] = {"cases": cases, "nonfinite": _nonfinite(rank, w, pair[0])}
    return out


@pytest.fixture(scope="module")
def grid() -> list[dict[int, dict[str, object]]]:
    return run_distributed(_clip_grid, max(WORLDS))


@pytest.mark.parametrize("world", WORLDS)
def test_global_norm_equals_torch_on_full_gradients(grid, world: int) -> None:
    for rank in range(world):
        for case in grid[rank][world]["cases"]:
            assert case["total"] == pytest.approx(case["expected"], rel=1e-5)
            assert case["clipped_ok"]


@pytest.mark.parametrize("world", WORLDS)
def test_same_norm_on_every_rank(grid, world: int) -> None:
    totals = [[case["total"] for case in grid[rank][world]["cases"]] for rank in range(world)]
    assert all(t == totals[0] for t in totals)


@pytest.mark.parametrize("world", WORLDS)
def test_one_all_reduce_per_shard_group(grid, world: int) -> None:
    groups = 2 if world > 1 else 0  # two process groups; a one-rank layout never communicates
    for rank in range(world):
        assert {case["all_reduces"] for case in grid[rank][world]["cases"]} == {groups}


@pytest.mark.parametrize("world", WORLDS)
def test_nonfinite_norm_raises_on_every_rank(grid, world: int) -> None:
    for rank in range(world):
        assert "non-finite" in grid[rank][world]["nonfinite"]
