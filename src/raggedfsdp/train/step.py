"""One optimizer step of the job.

Forward and backward over the micro-batches, the global loss, clipping, the update (or a skip), and
what the loop records of it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from .._host import synchronize
from ..clip import clip_grad_norm_
from . import health
from .build import lr_factor
from .config import TrainConfig
from .monitor import StepTimes

if TYPE_CHECKING:  # its module loads torch's pipelining: only under --pp
    from .pipeline import Pipeline

__all__ = ["StepResult", "train_step"]


@dataclass(frozen=True)
class StepResult:
    """What one :func:`train_step` did: what the loop logs and the timestamps it splits the
    step time with (the communication wait comes from the model's stats, read afterwards)."""

    loss: float
    """The mean loss over all ranks and micro-batches (``nan`` when some rank's is not finite)."""
    lr: float
    """The learning rate of the first parameter group during the step."""
    grad_norm: float | None
    """The global gradient norm before clipping, or None without ``--grad-clip``."""
    skipped: bool
    """True when a non-finite loss or gradient made the step skip the optimizer update."""
    started: float
    """``time.perf_counter()`` at the start of the step (before the batch is drawn)."""
    backward_done: float
    """... once forward and backward of every micro-batch finished (device synchronised)."""
    optimizer_started: float
    """... once the loss was all-reduced, when clipping and the update began."""
    ended: float
    """... at the end of the step (gradients zeroed, device synchronised)."""

    def times(self, comm: float) -> StepTimes:
        """The step's time split, given the seconds it waited on communication (from the
        model's stats): the wait is taken out of the forward/backward span, where the model's
        collectives run, to leave the compute."""
        return StepTimes(
            total=self.ended - self.started,
            compute=max(0.0, self.backward_done - self.started - comm),
            comm=comm,
            optimizer=self.ended - self.optimizer_started,
        )


def _forward_backward(
    model: nn.Module, batch: Sequence[torch.Tensor], *, grad_accum: int, device: torch.device
) -> torch.Tensor:
    """Forward and backward over ``grad_accum`` micro-batches of ``batch`` (``(x, y)``, a VLM's
    ``(x, y, pixels)``: tensors of the same rows); this rank's summed loss, still on the device
    (no host sync, so backward is not stalled). Gradients are reduced only in the last
    micro-batch's backward: the others accumulate locally under ``no_sync``."""
    loss_sum = torch.zeros((), device=device)
    micro = list(zip(*(t.chunk(grad_accum) for t in batch), strict=True))
    for i, tensors in enumerate(micro):
        # Reduce gradients only after the last micro-batch; the others accumulate.
        with nullcontext() if i == len(micro) - 1 else model.no_sync():
            loss = model(*(t.to(device) for t in tensors)) / len(micro)
            loss.backward()
        loss_sum += loss.detach()
    return loss_sum


def _set_lr(optimizer: torch.optim.Optimizer, step: int, cfg: TrainConfig) -> None:
    """Scale every group's peak rate (``initial_lr``) by the schedule at ``step`` (0-based), so
    a resumed run picks the schedule up where it left off without scheduler state."""
    factor = lr_factor(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * factor


def _backward(
    model: nn.Module,
    batch: Sequence[torch.Tensor],
    *,
    cfg: TrainConfig,
    device: torch.device,
    pipeline: Pipeline | None,
) -> torch.Tensor:
    """Forward and backward of the step's ``batch``: over ``--grad-accum`` micro-batches, or
    under the pipeline's schedule; this rank's summed loss (a pipeline's: its last stage's, 0
    elsewhere)."""
    if pipeline is None:
        return _forward_backward(model, batch, grad_accum=cfg.grad_accum, device=device)
    return pipeline.forward_backward([t.to(device) for t in batch])


def _clip(
    params: Sequence[torch.Tensor], cfg: TrainConfig, pipeline: Pipeline | None
) -> float | None:
    """Clip to ``--grad-clip`` by the norm of the whole model (over a pipeline's stages too);
    the norm before clipping, or None without clipping."""
    if not cfg.grad_clip:
        return None
    pp_mesh = pipeline.pp_mesh if pipeline else None
    return clip_grad_norm_(params, cfg.grad_clip, pp_mesh=pp_mesh).item()


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    batches: Iterator[tuple[torch.Tensor, ...]],
    *,
    step: int,
    cfg: TrainConfig,
    device: torch.device,
    log: Callable[[str], None],
    pipeline: Pipeline | None = None,
) -> StepResult:
    """One optimizer step, ``step`` (0-based), of a model sharded by raggedfsdp.

    Sets the scheduled learning rate, draws the step's batch from ``batches`` (inside the timed
    span, so the step time includes the data, as the metrics always have), runs forward and
    backward over ``cfg.grad_accum`` micro-batches, all-reduces the loss, clips ``params`` to
    ``cfg.grad_clip``, and updates - unless the loss or the gradient norm is not finite: then
    ``cfg.on_nan == "stop"`` raises :class:`~.health.NonFiniteLossError` and ``"skip"`` leaves
    the parameters as they are and says so through ``log``. The loss is all-reduced and the
    norm global, so every rank takes the same branch. Resets the model's stats first, so that
    ``model.stats()`` afterwards covers exactly this step.

    Under ``pipeline`` (``model``: its stages), its schedule runs forward and backward; the
    norm is the whole model's, and tied weights' copies follow the update.
    """
    started = time.perf_counter()
    model.reset_stats()
    _set_lr(optimizer, step, cfg)
    loss_sum = _backward(model, next(batches), cfg=cfg, device=device, pipeline=pipeline)
    synchronize(device)
    backward_done = time.perf_counter()
    loss_value = (pipeline.global_loss if pipeline else health.global_loss)(loss_sum)
    optimizer_started = time.perf_counter()
    grad_norm = _clip(params, cfg, pipeline)
    finite = math.isfinite(loss_value) and (grad_norm is None or math.isfinite(grad_norm))
    if finite:
        optimizer.step()
        if pipeline is not None:
            pipeline.after_update()
    elif cfg.on_nan == "stop":
        raise health.NonFiniteLossError(
            f"step {step + 1}: the loss is {loss_value} (gradient norm {grad_norm}) on some "
            f"rank; stopping (--on-nan skip would skip such steps)"
        )
    else:
        log(f"step {step + 1}: non-finite loss or gradient; step skipped")
    optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    ended = time.perf_counter()
    return StepResult(
        loss=loss_value,
        lr=optimizer.param_groups[0]["lr"],
        grad_norm=grad_norm,
        skipped=not finite,
        started=started,
        backward_done=backward_done,
        optimizer_started=optimizer_started,
        ended=ended,
    )
