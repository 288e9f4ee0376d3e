"""Ranks whose graphs differ train as one process would (``runtime/_sequence.py``): a vision tower
(a Conv2d patch embedding and a block, each a unit) run only on ranks whose batch has an image, an
expert (its own unit) that no token reached on some rank, and a unit run twice on one rank and once
on another. AdamW with weight decay, W = 2 and 3 (and HSDP 2 x 2), against one process on the
global batch: parameters within 1e-5, and a gradient of ``None`` where no rank used a parameter, as
one process leaves it. With ``reshard_after_forward=False``, gradient accumulation under
``no_sync``, bf16 parameters and int8 communication. FSDP2 is not run: on these cases it aborts
or hangs (experiments/fsdp2_uneven_graphs.py records its outcome per case). Every rank issues the
same collectives: their counts are equal on every rank, and the skipping ranks count their
catch-ups. The model and cases: tests/support/uneven_cases.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import raggedfsdp as rf
from harness import Grid, assert_close_dicts, world_grid_fixture
from uneven_cases import BATCH, CASES, STEPS, Net, Plan, data, train, units

pytestmark = pytest.mark.slow

WORLDS = (2, 3, 4)


def _train(model: nn.Module, case: str, rank: int, world: int, micro: int = 1) -> dict:
    """``train``, with the collectives and catch-ups each rank counted."""
    out = train(model, CASES[case], rank, world, micro)
    if rank >= 0:
        stats = model.stats()
        out["counts"] = {k: int(stats[k]) for k in ("all_gather_calls", "reduce_scatter_calls")}
        out["catch_ups"] = {k: int(stats[k]) for k in ("forward_catch_ups", "backward_catch_ups")}
    return out


def _shard(model: Net, mesh: Any = None, **kwargs: Any) -> Net:
    for unit in units(model):
        rf.fully_shard(unit, mesh=mesh, **kwargs)
    rf.fully_shard(model, mesh=mesh, **kwargs)
    return model


def _again_on_one_rank(base: Net, rank: int, world: int) -> dict[str, Any]:
    """Rank 0 alone runs the first block again after the second, in the second step: what each
    rank raises there, and whether its parameters are still those of the first step."""
    model = _shard(copy.deepcopy(base))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    for step, (x, image) in enumerate(data(world)[:2]):
        before = [p.to_local().clone() for p in model.parameters()]
        plan = Plan(True, 1, [[0, 1], [0, 1]], again=step == 1 and rank == 0)
        try:
            model(x[mine], image[mine], plan).backward()
        except RuntimeError as error:
            model.reset_iter_state()  # FSDP2's way back after a step that raised
            after = [p.to_local() for p in model.parameters()]
            unchanged = all(map(torch.equal, before, after))
            return {"step": step, "error": str(error), "unchanged": unchanged}
        optimizer.step()
        optimizer.zero_grad()
    return {"step": None}


def _cases(rank: int, world: int, group: object) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = Net()
    out: dict[str, Any] = {"reference": {}, "rf": {}}
    names = ["all"] if world == 4 else list(CASES)
    for name in names:
        out["reference"][name] = _train(copy.deepcopy(base), name, -1, world)
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        out["rf"]["hsdp/all"] = _train(_shard(copy.deepcopy(base), mesh), "all", rank, world)
        return out
    for name in names:
        out["rf"][name] = _train(_shard(copy.deepcopy(base)), name, rank, world)
    kept = _shard(copy.deepcopy(base), reshard_after_forward=False)
    out["rf"]["keep_unsharded/all"] = _train(kept, "all", rank, world)
    out["rf"]["no_sync/all"] = _train(_shard(copy.deepcopy(base)), "all", rank, world, micro=2)
    bf16 = rf.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out["rf"]["bf16/all"] = _train(_shard(copy.deepcopy(base), mp_policy=bf16), "all", rank, world)
    int8 = rf.CommCompression(all_gather=torch.int8, reduce_scatter=torch.int8)
    out["rf"]["int8/all"] = _train(
        _shard(copy.deepcopy(base), compression=int8), "all", rank, world
    )
    out["again_on_one_rank"] = _again_on_one_rank(base, rank, world)  # last: it raises
    return out


grid = world_grid_fixture(_cases, WORLDS, as_launches=True)


def _check(grid: Grid, world: int, case: str, **tolerance: float) -> None:
    want = grid[world][0]["reference"][case.split("/")[-1]]
    counts = []
    for results in grid[world]:
        got = results["rf"][case]
        assert_close_dicts(got["params"], want["params"], **tolerance)
        counts.append(got["counts"])
    assert all(c == counts[0] for c in counts), counts  # the same collectives on every rank


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", [*CASES, "keep_unsharded/all", "no_sync/all"])
def test_parameters_equal_one_process(grid: Grid, world: int, case: str) -> None:
    _check(grid, world, case)


def test_hsdp(grid: Grid) -> None:
    _check(grid, 4, "hsdp/all")


@pytest.mark.parametrize("world", [2, 3])
def test_bf16(grid: Grid, world: int) -> None:
    """bf16 parameters, fp32 reductions: within what four AdamW steps of lr 1e-2 can move apart
    from the fp32 process."""
    _check(grid, world, "bf16/all", atol=2 * STEPS * 1e-2)


@pytest.mark.parametrize("world", [2, 3])
def test_compressed_communication(grid: Grid, world: int) -> None:
    """int8 all-gathers and reduce-scatters (block-quantized): within what four AdamW steps of
    lr 1e-2 can move apart from the fp32 process."""
    _check(grid, world, "int8/all", atol=2 * STEPS * 1e-2)


@pytest.mark.parametrize("world", [2, 3])
def test_what_no_rank_used_has_no_gradient(grid: Grid, world: int) -> None:
    """The tower in step 3 and expert 0 in step 3 (used by no rank) keep ``.grad`` None, as in
    one process; the rest have gradients."""
    for results in grid[world]:
        for case in ("vision", "expert"):
            none = results["rf"][case]["none"]
            patch, _, expert0 = none[3][0], none[3][1], none[3][2]
            assert patch == (case == "vision") and expert0 == (case == "expert"), none
            assert not any(any(step) for step in none[:3]), none


@pytest.mark.parametrize("world", [2, 3])
def test_skipping_ranks_catch_up(grid: Grid, world: int) -> None:
    """In the vision case rank 0 skips the tower in steps 1 and 3 (two units, forward and
    backward) and the others in steps 0 and 3; nobody's backward runs it in step 3."""
    for rank, results in enumerate(grid[world]):
        got = results["rf"]["vision"]["catch_ups"]
        assert got == {"forward_catch_ups": 4, "backward_catch_ups": 2}, (rank, got)


@pytest.mark.parametrize("world", [2, 3])
def test_a_unit_run_again_later_on_one_rank_stops_every_rank(grid: Grid, world: int) -> None:
    """Rank 0's forward runs the first block again after the second; the others' do not: every
    rank raises the same error in that step (rank 0 in its forward, the others at the start of
    their backward), none hangs, and no parameter has changed. (Run again at the same point on
    every rank, the "again" case above trains as one process.)"""
    errors = set()
    for rank, results in enumerate(grid[world]):
        got = results["again_on_one_rank"]
        assert got["step"] == 1 and got["unchanged"], (rank, got)
        assert "ran their units in different orders" in got["error"], got["error"]
        assert ("ran blocks.0 again" in got["error"]) == (rank == 0), got["error"]
        errors.add(got["error"].split(" (")[0])
    assert len(errors) == 1, errors
