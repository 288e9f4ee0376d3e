"""Pipeline parallelism in the job (``--pp``): the stages (:mod:`.stages`) in torch's schedules.

Each stage is sharded by raggedfsdp inside torch's ``PipelineStage``; weights tied across stages
are kept one. The schedules, and what a step measures: docs/pipeline.md ("In the job").
The settings are torchtitan's: no reshard after forward, the loss divided by the micro-batches per
micro-batch, ``scale_grads=False``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.tensor import DTensor, Shard

from .._host import synchronize
from ..facts import is_looped, schedule_class, stages_per_rank
from ..models import hf
from ..tensor import local_piece, shard_info
from . import health
from .stages import StageSet, holds

__all__ = ["Pipeline", "build_schedule"]


@dataclass
class _Tie:
    """One weight the whole model ties (GPT's embedding and head), held by several stages: the
    first holder's parameter is the weight (the optimizer's), the others are copies. After
    backward every holder's gradient is summed into the owner's; after the update the owner's
    values go to the copies. Whole tensors over ``group`` (the ranks of this data and tensor
    coordinate that hold it; None: this rank alone): the holders' shards need not match."""

    owner: torch.Tensor | None
    copies: list[torch.Tensor]
    group: dist.ProcessGroup | None
    owner_rank: int  # the global rank that holds the owner

    @torch.no_grad()
    def sum_grads(self) -> None:
        held = [p for p in [self.owner, *self.copies] if p is not None]
        total = torch.zeros(held[0].shape, dtype=held[0].dtype, device=held[0].device)
        for p in held:
            if p.grad is not None:
                total += _whole(p.grad)
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        if self.owner is not None:
            if self.owner.grad is None:
                self.owner.grad = torch.zeros_like(self.owner)
            _set_piece(self.owner.grad, self.owner, total)
        for p in self.copies:
            p.grad = None  # counted once, in the owner's (clipping, the optimizer)

    @torch.no_grad()
    def copy_weights(self) -> None:
        held = self.owner if self.owner is not None else self.copies[0]
        value = _whole(held)
        if self.group is not None:
            dist.broadcast(value, src=self.owner_rank, group=self.group)
        for p in self.copies:
            _set_piece(p, p, value)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole, a fresh tensor (a collective over its shard group when sharded)."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().clone()


def _set_piece(target: torch.Tensor, like: torch.Tensor, whole: torch.Tensor) -> None:
    """Write this rank's piece of ``whole`` into ``target``, placed as ``like``: its tensor-
    parallel slice (``Shard``: torch's chunks), then its ragged shard of that."""
    piece = whole
    if isinstance(like, DTensor):
        mesh, coordinate = like.device_mesh, like.device_mesh.get_coordinate() or []
        for dim, placement in enumerate(like.placements):
            if isinstance(placement, Shard):
                piece = piece.chunk(mesh.size(dim), placement.dim)[coordinate[dim]]
    info = shard_info(like)
    if info is not None:
        piece = info.layout.to_local(piece, info.rank)
    local_piece(target).copy_(piece.reshape(local_piece(target).shape))


def _tied_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter the model holds under several names, in order."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _ties(
    model: nn.Module,
    stages: list[nn.Module],
    mine: list[int],
    n_stages: int,
    pp_mesh: DeviceMesh,
) -> list[_Tie]:
    """The ties of ``model`` its stages split (each stage holds one of the names), and this
    rank's part of each; every rank makes the same groups (a collective)."""
    out = []
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    ranks = tuple(dist.get_process_group_ranks(pp_mesh.get_group()))  # this pipeline's ranks
    for names in _tied_names(model):
        holders = [s for s in range(n_stages) if holds(model, names, s, n_stages)]
        if len(holders) < 2:
            continue  # one stage holds every name: still one parameter
        owner_stage = holders[0]
        pp_ranks = sorted({s % pp for s in holders})
        group = None
        if len(pp_ranks) > 1:
            for coordinate in _pp_groups(pp_mesh):  # every rank creates every group
                new = dist.new_group([coordinate[r] for r in pp_ranks])
                if coordinate == ranks:
                    group = new
        params = [
            (index, _param_by_names(stage, names))
            for index, stage in zip(mine, stages, strict=True)
            if index in holders
        ]
        if not params and pp_rank not in pp_ranks:
            continue
        owner = next((p for i, p in params if i == owner_stage), None)
        copies = [p for i, p in params if i != owner_stage]
        out.append(_Tie(owner, copies, group, ranks[owner_stage % pp]))
    return out


def _pp_groups(pp_mesh: DeviceMesh) -> list[tuple[int, ...]]:
    """The global ranks of every pipeline (one per data and tensor coordinate), each in
    stage order: the same list on every rank."""
    mine = tuple(dist.get_process_group_ranks(pp_mesh.get_group()))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return sorted(set(everyone))


def _param_by_names(stage: nn.Module, names: list[str]) -> torch.Tensor:
    held = dict(stage.named_parameters(remove_duplicate=False))
    return next(held[n] for n in names if n in held)


# ---------------------------------------------------------------------------------------------
# The schedule and one step.


class _TimedStage(PipelineStage):
    """torch's ``PipelineStage``, timing the compute it runs for the schedule: each chunk's
    forward, backward and (zero-bubble) weight backward, the device synchronised after each,
    so that the rest of a step is the stage's idle time (its bubble)."""

    busy_s: float = 0.0

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.busy_s += time.perf_counter() - started

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self._timed():
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self._timed():
            return super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self._timed():
            return super().backward_weight_one_chunk(*args, **kwargs)


@dataclass
class Pipeline:
    """This rank's stages under their schedule: one step's forward and backward, the loss,
    the ties, the evaluation, and what the step measured."""

    model: StageSet
    indices: list[int]
    n_stages: int
    schedule: Any
    stages: list[_TimedStage]
    pp_mesh: DeviceMesh
    ties: list[_Tie] = field(default_factory=list)
    span_s: float = 0.0
    """Seconds of the last :meth:`forward_backward` (the schedule's step)."""

    @property
    def first(self) -> bool:
        return 0 in self.indices

    @property
    def last(self) -> bool:
        return self.n_stages - 1 in self.indices

    @property
    def busy_s(self) -> float:
        """Seconds this rank's stages computed in the last step (forward and backward)."""
        return sum(stage.busy_s for stage in self.stages)

    def _run(self, batch: Sequence[torch.Tensor], *, train: bool) -> torch.Tensor:
        x, y = batch
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        target = y if self.last else None
        run = self.schedule.step if train else self.schedule.eval
        run(*args, target=target, losses=losses if self.last else None)
        if not self.last:
            return torch.zeros((), device=x.device)
        return torch.stack([loss.detach().float() for loss in losses]).sum()

    def forward_backward(self, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        """Forward and backward of every micro-batch of ``batch`` (``(x, y)`` on the device)
        under the schedule; this rank's summed loss (the last stage's; 0 elsewhere). Gradients
        are reduced once per unit (the schedule's end), the tied ones summed."""
        for stage in self.stages:
            stage.busy_s = 0.0
        started = time.perf_counter()
        loss = self._run(batch, train=True)
        synchronize(batch[0].device)
        self.span_s = time.perf_counter() - started
        for tie in self.ties:
            tie.sum_grads()
        return loss

    def global_loss(self, loss: torch.Tensor) -> float:
        """The mean loss over the last stage's ranks, on every rank (a collective): the
        world's mean of ``pp x`` each rank's (0 off the last stage), non-finite anywhere
        making it ``nan`` everywhere."""
        return health.global_loss(loss * self.pp_mesh.size())

    def after_update(self) -> None:
        """The copies of tied weights take the updated values."""
        for tie in self.ties:
            tie.copy_weights()

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Sequence[torch.Tensor]], device: torch.device) -> float:
        """Mean loss over ``batches`` (forward only, under the schedule) and the data ranks."""
        total = torch.zeros((), device=device)
        for batch in batches:
            total += self._run([t.to(device) for t in batch], train=False)
        return self.global_loss(total) / len(batches)


def build_schedule(
    model: nn.Module,
    stages: list[nn.Module],
    mine: list[int],
    *,
    pp_mesh: DeviceMesh,
    schedule: str,
    microbatches: int,
    device: torch.device,
) -> Pipeline:
    """The :class:`Pipeline` of this rank's sharded ``stages`` (indices ``mine``) of
    ``model`` (the unsharded whole, for its ties) under ``schedule``, torchtitan's settings."""
    n_stages = pp_mesh.size() * stages_per_rank(schedule)
    group = pp_mesh.get_group()
    timed = [
        _TimedStage(stage, index, n_stages, device, group=group)
        for stage, index in zip(stages, mine, strict=True)
    ]

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return hf.mean_token_loss(logits, targets) / microbatches

    cls = getattr(schedules, schedule_class(schedule))
    options = {"n_microbatches": microbatches, "loss_fn": loss_fn, "scale_grads": False}
    run = cls(timed, **options) if is_looped(schedule) else cls(timed[0], **options)
    ties = _ties(model, stages, mine, n_stages, pp_mesh)
    copies = {id(p) for tie in ties for p in tie.copies}
    return Pipeline(StageSet(stages, copies), mine, n_stages, run, timed, pp_mesh, ties)
