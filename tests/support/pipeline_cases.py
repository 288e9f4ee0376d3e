"""A small decoder cut into pipeline stages torchtitan's way, and the pipelining runs the tests
of pipeline parallelism (tests/distributed/test_pipeline.py) and experiments/pipeline_schedules.py
make with it: raggedfsdp or FSDP2 units inside torch's ``PipelineStage`` under a schedule, against
one process on the global batch."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.tensor.parallel import ColwiseParallel as Colwise
from torch.distributed.tensor.parallel import RowwiseParallel as Rowwise
from torch.distributed.tensor.parallel import parallelize_module

import raggedfsdp as rf

VOCAB, DIM, HIDDEN, LAYERS = 37, 24, 40, 4
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


def reference(clip: float | None = None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process on the global batch: its parameters, and its norms if clipped to ``clip``."""
    model = initial_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    for x, y in batches():
        cross_entropy(model(x), y).backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def my_stages(pp_rank: int, per_rank: int | str) -> tuple[list[int], int]:
    """The stages this pp rank holds, and how many there are."""
    if per_rank == 1:
        return [pp_rank], PP
    if per_rank == 2:
        return [pp_rank, pp_rank + PP], 2 * PP
    return [pp_rank, 2 * PP - 1 - pp_rank], 2 * PP  # a V


def build(
    impl: str,
    schedule: str,
    mesh: DeviceMesh,
    *,
    titan: bool,
    double_scaled: bool = False,
    planner: rf.StructAwarePlanner | None = None,
    microbatches: int = MICROBATCHES,
) -> tuple[list[nn.Module], Any, list[int], int]:
    """This rank's stages, each block and stage sharded over the data-parallel dims of ``mesh``
    (``dp``, or HSDP's ``dp_replicate, dp_shard``; its blocks first split over ``tp`` where the
    mesh has it), and ``schedule`` over them: torchtitan's settings (no reshard after forward,
    the loss scaled per micro-batch, ``scale_grads=False``) or torch's defaults.
    ``double_scaled`` (a negative control): the loss scaled per micro-batch AND ``scale_grads``
    on. Returns (stages' modules, schedule, their indices, the number of stages)."""
    cls, per_rank = SCHEDULES[schedule]
    mine, stages = my_stages(mesh["pp"].get_local_rank(), per_rank)
    names = mesh.mesh_dim_names or ()
    kwargs: dict[str, Any] = {"reshard_after_forward": False if titan else None}
    if impl == "rf":
        fully_shard = rf.fully_shard
        kwargs["planner"] = planner
    else:
        fully_shard = torch_fully_shard
    full = initial_model()
    parts, pipeline = [], []
    for index in mine:
        part = cut(full, index, stages)
        for layer in part.layers.values():
            if "tp" in names:
                parallelize_module(layer, mesh["tp"], {"fc1": Colwise(), "fc2": Rowwise()})
            fully_shard(layer, mesh=data_mesh(mesh), **kwargs)
        fully_shard(part, mesh=data_mesh(mesh), **kwargs)
        parts.append(part)
        pipeline.append(
            PipelineStage(part, index, stages, torch.device("cpu"), group=mesh["pp"].get_group())
        )
    scaled = titan or double_scaled

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = cross_entropy(logits, targets)
        return loss / microbatches if scaled else loss

    options = {"n_microbatches": microbatches, "loss_fn": loss_fn, "scale_grads": not titan}
    run = cls(pipeline[0], **options) if per_rank == 1 else cls(pipeline, **options)
    return parts, run, mine, stages


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel dims of ``mesh``: ``dp``, or HSDP's ``dp_replicate, dp_shard``."""
    names = mesh.mesh_dim_names or ()
    return mesh["dp"] if "dp" in names else mesh["dp_replicate", "dp_shard"]


def step(
    run: Any, mine: list[int], stages: int, mesh: DeviceMesh, x: torch.Tensor, y: torch.Tensor
) -> None:
    """One step of the schedule on this data rank's share of the global batch ``x, y``."""
    data = data_mesh(mesh)
    per_rank = BATCH // data.size()
    data_rank = 0
    for dim, index in enumerate(data.get_coordinate() or []):
        data_rank = data_rank * data.size(dim) + index
    x, y = (t[data_rank * per_rank : (data_rank + 1) * per_rank] for t in (x, y))
    args = (x,) if 0 in mine else ()
    run.step(*args, target=y if stages - 1 in mine else None)


def full_params(parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        out.update(get_model_state_dict(part, options=StateDictOptions(full_state_dict=True)))
    return out


def train_pipeline(
    impl: str, schedule: str, mesh: DeviceMesh, *, titan: bool, clip: float | None = None, **kw: Any
) -> dict[str, Any]:
    """2 SGD steps (clipped to ``clip`` over all stages, if given): the full parameters of this
    rank's stages, raggedfsdp's counters per stage and step, and the clipped norms."""
    parts, run, mine, stages = build(impl, schedule, mesh, titan=titan, **kw)
    params = [p for part in parts for p in part.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    counts, norms = [], []
    for x, y in batches():
        if impl == "rf":
            for part in parts:
                part.reset_stats()
        step(run, mine, stages, mesh, x, y)
        if impl == "rf":
            counts.append([_counts(part) for part in parts])
        if clip is not None:
            norms.append(rf.clip_grad_norm_(params, clip, pp_mesh=mesh["pp"]).item())
        opt.step()
        opt.zero_grad()
    return {"params": full_params(parts), "counts": counts, "norms": norms}


def _counts(part: nn.Module) -> dict[str, int]:
    stats = part.stats()
    return {
        "reduce_scatters": int(stats["reduce_scatter_calls"]),
        "all_gathers": int(stats["all_gather_calls"]),
        "all_reduces": int(stats["all_reduce_calls"]),
        "buckets": len(part.shard_plans()),
        "peak_unsharded_bytes": int(stats["peak_unsharded_bytes"]),
    }


def max_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max((got[k] - want[k]).abs().max().item() for k in want)
