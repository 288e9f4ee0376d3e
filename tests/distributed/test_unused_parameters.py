"""A parameter some ranks do not use, or no rank uses, inside units every rank runs: the
parameters after AdamW with weight decay equal one process on the global batch, and a parameter no
rank used keeps ``.grad = None`` on every rank, as one process leaves it (so AdamW skips it rather
than decaying it). rf.fully_shard and FSDP2 in the same launch, W = 2 and 3 (and HSDP 2 x 2 on 4),
against one process; with ``reshard_after_forward=False``, gradient accumulation under
``no_sync``, and bf16 mixed precision. FSDP2 runs only where no rank's gradient differs from
another's in which parameters it has: elsewhere its reduce-scatter sizes differ across ranks and
Gloo aborts the process (docs/results/runtime.md). Negative control: without the agreement on
usage (``runtime/_usage.py``) the parameter no rank used is decayed, away from one process.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

import raggedfsdp as rf
from harness import Grid, assert_close_dicts, full_state, patched, world_grid_fixture
from raggedfsdp.runtime import _usage

pytestmark = pytest.mark.slow

WORLDS = (2, 3, 4)
BATCH, DIM, STEPS = 4, 8, 3
IMPLS: dict[str, Callable[..., Any]] = {"rf": rf.fully_shard, "fsdp2": fsdp2_fully_shard}
#: rank, world, step, micro-batch -> the blocks whose branch runs on that rank's data
Usage = Callable[[int, int, int, int], set[int]]
USAGE: dict[str, Usage] = {
    "nobody": lambda rank, world, step, micro: set(),
    "one_rank": lambda rank, world, step, micro: {0} if rank == 0 else set(),
    "rotating": lambda rank, world, step, micro: {1} if rank == step % world else set(),
    "first_micro_batch": lambda rank, world, step, micro: {0} if (rank, micro) == (0, 0) else set(),
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.branch = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, branch: bool) -> torch.Tensor:
        h = x + torch.tanh(self.fc(x))
        return h + self.branch(h) if branch else h


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor, branches: set[int]) -> torch.Tensor:
        h = self.embed(x)
        for i, block in enumerate(self.blocks):
            h = block(h, i in branches)
        return self.head(h).pow(2).mean()


def _batches(world: int, micro: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [
        [torch.randn(world * BATCH, 5, generator=generator) for _ in range(micro)]
        for _ in range(STEPS)
    ]


def _train(model: nn.Module, usage: Usage, rank: int, world: int, micro: int = 1) -> dict:
    """AdamW with weight decay; ``rank`` -1: one process on the global batch, each rank's slice
    with that rank's branches. Returns the parameters after training and, per step, whether the
    branches' gradients were None after backward."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    none: list[list[bool]] = []
    for step, micro_batches in enumerate(_batches(world, micro)):
        for m, x in enumerate(micro_batches):
            if rank >= 0:
                model.set_requires_gradient_sync(m == micro - 1)
                mine = x[rank * BATCH : (rank + 1) * BATCH]
                loss = model(mine, usage(rank, world, step, m)) / micro
            else:
                losses = [
                    model(x[r * BATCH : (r + 1) * BATCH], usage(r, world, step, m))
                    for r in range(world)
                ]
                loss = torch.stack(losses).mean() / micro
            loss.backward()
        none.append([block.branch.weight.grad is None for block in model.blocks])
        optimizer.step()
        optimizer.zero_grad()
    params = (
        full_state(model)
        if rank >= 0
        else {k: v.detach().clone() for k, v in model.state_dict().items()}
    )
    return {"params": params, "grad_none": none}


def _shard(impl: str, model: Net, mesh: Any = None, **kwargs: Any) -> Net:
    shard = IMPLS[impl]
    for block in model.blocks:
        shard(block, mesh=mesh, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    return model


def _cases(rank: int, world: int, group: object) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = Net()
    out: dict[str, Any] = {"reference": {}, "rf": {}, "fsdp2": {}}
    if world == 4:  # HSDP: rf alone (FSDP2's HSDP is in test_runtime_parity)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for name in ("nobody", "one_rank"):
            out["reference"][name] = _train(copy.deepcopy(base), USAGE[name], -1, world)
            model = _shard("rf", copy.deepcopy(base), mesh)
            out["rf"][f"hsdp/{name}"] = _train(model, USAGE[name], rank, world)
        return out
    for name, usage in USAGE.items():
        micro = 2 if name == "first_micro_batch" else 1
        out["reference"][name] = _train(copy.deepcopy(base), usage, -1, world, micro)
        # FSDP2 where it runs: a gradient on some ranks only aborts its reduce-scatter (sizes
        # differ across ranks), which would end the launch.
        for impl in IMPLS if name == "nobody" else ["rf"]:
            model = _shard(impl, copy.deepcopy(base))
            out[impl][name] = _train(model, usage, rank, world, micro)
    for impl in IMPLS:
        model = _shard(impl, copy.deepcopy(base), reshard_after_forward=False)
        out[impl]["keep_unsharded/nobody"] = _train(model, USAGE["nobody"], rank, world)
    bf16 = {
        "rf": rf.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        "fsdp2": TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    }
    for impl in IMPLS:
        model = _shard(impl, copy.deepcopy(base), mp_policy=bf16[impl])
        out[impl]["bf16/nobody"] = _train(model, USAGE["nobody"], rank, world)
    model = _shard("rf", copy.deepcopy(base), mp_policy=bf16["rf"])
    out["rf"]["bf16/one_rank"] = _train(model, USAGE["one_rank"], rank, world)
    # Negative control: what the agreement on usage tells left unapplied.
    with patched(_usage.Usage, settle=_usage.Usage.restart):
        model = _shard("rf", copy.deepcopy(base))
        out["rf"]["no_agreement/nobody"] = _train(model, USAGE["nobody"], rank, world)
    return out


grid = world_grid_fixture(_cases, WORLDS, as_launches=True)


def _reference(results: dict, case: str) -> dict:
    return results["reference"][case.split("/")[-1]]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    ("impl", "case"),
    [
        *(("rf", case) for case in [*USAGE, "keep_unsharded/nobody"]),
        ("fsdp2", "nobody"),
        ("fsdp2", "keep_unsharded/nobody"),
    ],
    ids=lambda c: c.replace("/", "-"),
)
def test_parameters_equal_one_process(grid: Grid, world: int, impl: str, case: str) -> None:
    for rank, results in enumerate(grid[world]):
        got, want = results[impl][case], _reference(results, case)
        assert_close_dicts(got["params"], want["params"])
        assert got["grad_none"] == want["grad_none"], f"rank {rank}"


@pytest.mark.parametrize("case", ["hsdp/nobody", "hsdp/one_rank"])
def test_hsdp(grid: Grid, case: str) -> None:
    for results in grid[4]:
        got, want = results["rf"][case], _reference(results, case)
        assert_close_dicts(got["params"], want["params"])
        assert got["grad_none"] == want["grad_none"]


@pytest.mark.parametrize("world", [2, 3])
def test_bf16(grid: Grid, world: int) -> None:
    """bf16 parameters, fp32 reductions: FSDP2's numbers where it runs. Used on one rank: the
    branch no rank used is untouched, as in one process (fp32), and the rest within what three
    AdamW steps of lr 1e-2 can move apart (bf16 flips the signs of tiny gradients)."""
    for results in grid[world]:
        got, fsdp2 = results["rf"]["bf16/nobody"], results["fsdp2"]["bf16/nobody"]
        assert_close_dicts(got["params"], fsdp2["params"], atol=1e-3)
        assert got["grad_none"] == fsdp2["grad_none"] == [[True, True]] * STEPS
        got, want = results["rf"]["bf16/one_rank"], results["reference"]["one_rank"]
        for key, value in want["params"].items():
            atol = 0 if key.startswith("blocks.1.branch.") else 2 * STEPS * 1e-2
            torch.testing.assert_close(got["params"][key], value, rtol=0, atol=atol, msg=key)
        assert got["grad_none"] == [[False, True]] * STEPS


def test_what_no_rank_used_keeps_no_gradient(grid: Grid) -> None:
    """The reference itself: one process leaves the unused branches' gradients None (so the
    cases above compare None with None), and the rotating branch has one where it ran."""
    want = grid[2][0]["reference"]
    assert want["nobody"]["grad_none"] == [[True, True]] * STEPS
    assert want["one_rank"]["grad_none"] == [[False, True]] * STEPS
    assert want["rotating"]["grad_none"] == [[True, False]] * STEPS


@pytest.mark.parametrize("world", [2, 3])
def test_without_the_agreement_unused_parameters_decay(grid: Grid, world: int) -> None:
    """Negative control: zeros for a parameter no rank used, so AdamW decays it."""
    for results in grid[world]:
        got, want = results["rf"]["no_agreement/nobody"], results["reference"]["nobody"]
        assert got["grad_none"] == [[False, False]] * STEPS
        key = "blocks.0.branch.weight"
        assert (got["params"][key] - want["params"][key]).abs().max() > 1e-4
