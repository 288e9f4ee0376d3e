"""raggedfsdp units inside torch's ``PipelineStage``, under every schedule the installed torch has,
against one process on the global batch and against FSDP2 + PP in the same launch.

One Gloo launch of 4 ranks, a mesh (pp=2, dp=2): a small decoder with uneven widths (37, 24, 40)
cut into stages torchtitan's way (the embedding with the first stage, norm and head with the last;
every block and every stage ``fully_shard``-ed), 2 SGD steps of 4 micro-batches. The tests judge
the collected results.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.pipelining import PipelineStage, schedules

import raggedfsdp as rf
from harness import run_distributed

VOCAB, DIM, HIDDEN, LAYERS = 37, 24, 40, 8
MICROBATCHES, BATCH, SEQ, STEPS, LR = 4, 8, 6, 2, 0.5
PP, DP = 2, 2

#: Every schedule of the installed torch: (class, stages per rank; "v": two, in a V).
SCHEDULES = {
    name: (getattr(schedules, name), per_rank)
    for name, per_rank in (
        ("ScheduleGPipe", 1),
        ("Schedule1F1B", 1),
        ("ScheduleInterleaved1F1B", 2),
        ("ScheduleLoopedBFS", 2),
        ("ScheduleInterleavedZeroBubble", 2),
        ("ScheduleZBVZeroBubble", "v"),
        ("ScheduleDualPipeV", "v"),
    )
    if hasattr(schedules, name)
}
#: The schedules that split backward into input and weight gradients.
SPLIT_BACKWARD = {"ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Decoder(nn.Module):
    """torchtitan's shape of a model that pipelining cuts: a stage lacks what is ``None``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb: nn.Module | None = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm: nn.Module | None = nn.LayerNorm(DIM)
        self.head: nn.Module | None = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) if self.emb is not None else x
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h


def cut(model: Decoder, stage: int, stages: int) -> Decoder:
    """Stage ``stage`` of ``stages``: a copy keeping its share of the layers (their names kept)."""
    part = copy.deepcopy(model)
    per = LAYERS // stages
    for name in list(part.layers):
        if not stage * per <= int(name) < (stage + 1) * per:
            del part.layers[name]
    if stage != 0:
        part.emb = None
    if stage != stages - 1:
        part.norm = part.head = None
    return part


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def initial_model() -> Decoder:
    torch.manual_seed(0)
    return Decoder()


def reference() -> dict[str, torch.Tensor]:
    """One process on the global batch."""
    model = initial_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches():
        cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def my_stages(pp_rank: int, per_rank: int | str) -> tuple[list[int], int]:
    """The stages this pp rank holds, and how many there are."""
    if per_rank == 1:
        return [pp_rank], PP
    if per_rank == 2:
        return [pp_rank, pp_rank + PP], 2 * PP
    return [pp_rank, 2 * PP - 1 - pp_rank], 2 * PP  # a V


def train_pipeline(
    impl: str, schedule: str, *, titan: bool, mesh: DeviceMesh, double_scaled: bool = False
) -> dict[str, Any]:
    """Train with ``schedule``: torchtitan's settings (no reshard after forward, the loss scaled
    per micro-batch, ``scale_grads=False``) or torch's defaults. ``double_scaled`` (a negative
    control): the loss scaled per micro-batch AND ``scale_grads`` on."""
    fully_shard = torch_fully_shard if impl == "torch" else rf.fully_shard
    cls, per_rank = SCHEDULES[schedule]
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    mine, stages = my_stages(pp_rank, per_rank)
    full = initial_model()
    reshard = False if titan else None
    parts, pipeline = [], []
    for index in mine:
        part = cut(full, index, stages)
        for layer in part.layers.values():
            fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=reshard)
        fully_shard(part, mesh=mesh["dp"], reshard_after_forward=reshard)
        parts.append(part)
        pipeline.append(
            PipelineStage(part, index, stages, torch.device("cpu"), group=mesh["pp"].get_group())
        )
    scaled = titan or double_scaled

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = cross_entropy(logits, targets)
        return loss / MICROBATCHES if scaled else loss

    kwargs = {"n_microbatches": MICROBATCHES, "loss_fn": loss_fn, "scale_grads": not titan}
    schedule_ = cls(pipeline[0], **kwargs) if per_rank == 1 else cls(pipeline, **kwargs)
    opt = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=LR)
    per_dp = BATCH // DP
    counts = []
    for x, y in batches():
        x, y = (t[dp_rank * per_dp : (dp_rank + 1) * per_dp] for t in (x, y))
        if impl == "rf":
            for part in parts:
                part.reset_stats()
        args = (x,) if 0 in mine else ()
        schedule_.step(*args, target=y if stages - 1 in mine else None)
        if impl == "rf":
            counts.append([_counts(part) for part in parts])
        opt.step()
        opt.zero_grad()
    out: dict[str, Any] = {"params": {}, "counts": counts}
    for part in parts:
        out["params"].update(
            get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        )
    return out


def _counts(part: nn.Module) -> dict[str, int]:
    stats = part.stats()
    return {
        "reduce_scatters": int(stats["reduce_scatter_calls"]),
        "all_gathers": int(stats["all_gather_calls"]),
        "buckets": len(part.shard_plans()),
    }


def _cases(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    out: dict[str, Any] = {}
    for schedule in SCHEDULES:
        for impl in ("rf", "torch"):
            out[impl, schedule, "titan"] = train_pipeline(impl, schedule, titan=True, mesh=mesh)
        if schedule not in SPLIT_BACKWARD:
            out["rf", schedule, "defaults"] = train_pipeline("rf", schedule, titan=False, mesh=mesh)
    part = rf.fully_shard(cut(initial_model(), 1, PP), mesh=mesh["dp"])
    out["state"] = [
        type(fully_shard.state(m)).__name__
        for fully_shard in (torch_fully_shard, rf.fully_shard)
        for m in (part, part.layers["4"])
    ]
    out["rf", "ScheduleGPipe", "double_scaled"] = train_pipeline(
        "rf", "ScheduleGPipe", titan=False, mesh=mesh, double_scaled=True
    )
    return out


@pytest.fixture(scope="module")
def grid() -> list[dict[str, Any]]:
    return run_distributed(_cases, PP * DP)


def gathered(grid: list[dict[str, Any]], key: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    """The parameters of every stage of a case, by the full model's names."""
    params: dict[str, torch.Tensor] = {}
    for rank in grid:
        params.update(rank[key]["params"])
    return params


def max_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max((got[k] - want[k]).abs().max().item() for k in want)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_schedule_trains_as_one_process_and_as_fsdp2(grid, schedule):
    want = reference()
    ours = gathered(grid, ("rf", schedule, "titan"))
    theirs = gathered(grid, ("torch", schedule, "titan"))
    assert max_difference(ours, want) < 1e-5
    assert max_difference(theirs, want) < 1e-5  # FSDP2 + PP, the same launch
    assert max_difference(ours, theirs) < 1e-5


@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s not in SPLIT_BACKWARD])
def test_torch_defaults_train_as_one_process(grid, schedule):
    assert max_difference(gathered(grid, ("rf", schedule, "defaults")), reference()) < 1e-5


def test_a_wrong_gradient_scale_is_seen(grid):
    """Negative control: the loss divided by the micro-batches twice is 4x off, and seen."""
    assert (
        max_difference(gathered(grid, ("rf", "ScheduleGPipe", "double_scaled")), reference()) > 1e-3
    )


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_gradients_reduced_once_per_unit_per_step(grid, schedule):
    """Step 2 (step 1 also runs torch's metadata inference, a forward and backward of its own):
    one reduce-scatter per bucket of each stage, not one per micro-batch; with no reshard after
    forward one all-gather per bucket, the one the schedule's UNSHARD (or the first forward)
    issued."""
    for rank in grid:
        for stage in rank["rf", schedule, "titan"]["counts"][-1]:
            assert stage["reduce_scatters"] == stage["buckets"]
            assert stage["all_gathers"] == stage["buckets"]


def test_fully_shard_state_finds_raggedfsdp_units(grid):
    """torch's ``fully_shard.state(module)`` (what its pipelining reads) and raggedfsdp's: the
    unit's torch-facing state on a sharded module, ``None`` on one not sharded."""
    assert grid[0]["state"] == ["TorchFacingState", "NoneType"] * 2
