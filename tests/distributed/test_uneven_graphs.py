"""Ranks whose graphs differ train as one process would (``runtime/_sequence.py``): a vision tower
(a Conv2d patch embedding and a block, each a unit) run only on ranks whose batch has an image, an
expert (its own unit) that no token reached on some rank, and a unit run twice on one rank and once
on another. AdamW with weight decay, W = 2 and 3 (and HSDP 2 x 2), against one process on the
global batch: parameters within 1e-5, and a gradient of ``None`` where no rank used a parameter, as
one process leaves it. With ``reshard_after_forward=False``, gradient accumulation under
``no_sync``, bf16 parameters and int8 communication. FSDP2 is not run: on these cases it aborts
or hangs (its outcome per case is in docs/results/runtime.md). Every rank issues the same
collectives: their counts are equal on every rank, and the skipping ranks count their catch-ups.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import raggedfsdp as rf
from harness import Grid, assert_close_dicts, full_state, world_grid_fixture

pytestmark = pytest.mark.slow

WORLDS = (2, 3, 4)
BATCH, DIM, STEPS = 2, 8, 4


class Plan:
    """What one rank's batch makes its forward run: an image or not, how often the second block
    runs, which rows each expert gets; whether the first block's input needs no gradient
    (``detach``, as behind frozen embeddings without an image) and whether the first block runs
    again after the second (``again``)."""

    def __init__(
        self,
        image: bool,
        repeat: int,
        expert_rows: list[list[int]],
        detach: bool = False,
        again: bool = False,
    ) -> None:
        self.image, self.repeat, self.expert_rows = image, repeat, expert_rows
        self.detach, self.again = detach, again


#: case -> (rank, world, step) -> Plan
CASES: dict[str, Callable[[int, int, int], Plan]] = {
    # an image on rank 0 only, then on the others only, then on every rank, then on none
    "vision": lambda r, w, s: Plan([r == 0, r != 0, True, False][s], 1, [[0, 1], [0, 1]]),
    # expert 1 gets no token on rank (step % world), expert 0 none anywhere in step 3
    "expert": lambda r, w, s: Plan(True, 1, [[] if s == 3 else [0, 1], [] if r == s % w else [1]]),
    # the second block runs twice on rank 0 and once elsewhere
    "repeat": lambda r, w, s: Plan(True, 2 if r == 0 else 1, [[0, 1], [0, 1]]),
    # the first block's input needs no gradient on rank (step % world) only
    "detach": lambda r, w, s: Plan(True, 1, [[0, 1], [0, 1]], detach=r == s % w),
    # every rank runs the first block again after the second in steps 1 and 2; an image on
    # rank 0 only
    "again": lambda r, w, s: Plan(r == 0, 1, [[0, 1], [0, 1]], again=s in (1, 2)),
    "all": lambda r, w, s: Plan(
        (r + s) % 2 == 0, 2 if r == s % w else 1, [[0], [] if r else [1]], r == (s + 1) % w
    ),
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Tower(nn.Module):
    """A vision tower: 8x8 images cut into four 4x4 patches, a block over them, pooled."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(1, DIM, kernel_size=4, stride=4)
        self.block = Block()

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.block(self.patch(image).flatten(2).transpose(1, 2)).mean(1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, DIM)
        self.tower = Tower()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor, image: torch.Tensor, plan: Plan) -> torch.Tensor:
        h = self.embed(x)
        if plan.image:
            h = h + self.tower(image)
        h = self.blocks[0](h.detach() if plan.detach else h)
        for _ in range(plan.repeat):
            h = self.blocks[1](h)
        if plan.again:
            h = self.blocks[0](h)
        routed = h
        for expert, rows in zip(self.experts, plan.expert_rows, strict=True):
            if rows:  # as mixture-of-experts layers skip an expert no token reached
                index = torch.tensor(rows)
                routed = routed.index_add(0, index, expert(h[index]))
        return self.head(routed).pow(2).mean()


def _units(model: Net) -> list[nn.Module]:
    return [model.tower.patch, model.tower.block, *model.blocks, *model.experts]


def _data(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(world * BATCH, 5, generator=generator),
            torch.randn(world * BATCH, 1, 8, 8, generator=generator),
        )
        for _ in range(STEPS)
    ]


def _train(model: nn.Module, case: str, rank: int, world: int, micro: int = 1) -> dict:
    """AdamW with weight decay; ``rank`` -1: one process on the global batch (the mean of the
    ranks' losses, each on its slice with its plan). ``micro`` micro-batches (the same data
    each) under no_sync. Returns the parameters and, per step, which units' weights have no
    gradient."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    none: list[list[bool]] = []
    for step, (x, image) in enumerate(_data(world)):
        for m in range(micro):
            if rank >= 0:
                model.set_requires_gradient_sync(m == micro - 1)
                mine = slice(rank * BATCH, (rank + 1) * BATCH)
                loss = model(x[mine], image[mine], CASES[case](rank, world, step))
            else:
                loss = torch.stack(
                    [
                        model(x[sl], image[sl], CASES[case](r, world, step))
                        for r in range(world)
                        for sl in [slice(r * BATCH, (r + 1) * BATCH)]
                    ]
                ).mean()
            (loss / micro).backward()
        none.append([next(unit.parameters()).grad is None for unit in _units(model)[::2]])
        optimizer.step()
        optimizer.zero_grad()
    if rank < 0:
        return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    stats = model.stats()
    counts = {k: int(stats[k]) for k in ("all_gather_calls", "reduce_scatter_calls")}
    catch_ups = {k: int(stats[k]) for k in ("forward_catch_ups", "backward_catch_ups")}
    return {"params": full_state(model), "none": none, "counts": counts, "catch_ups": catch_ups}


def _shard(model: Net, mesh: Any = None, **kwargs: Any) -> Net:
    for unit in _units(model):
        rf.fully_shard(unit, mesh=mesh, **kwargs)
    rf.fully_shard(model, mesh=mesh, **kwargs)
    return model


def _again_on_one_rank(base: Net, rank: int, world: int) -> dict[str, Any]:
    """Rank 0 alone runs the first block again after the second, in the second step: what each
    rank raises there, and whether its parameters are still those of the first step."""
    model = _shard(copy.deepcopy(base))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    for step, (x, image) in enumerate(_data(world)[:2]):
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
