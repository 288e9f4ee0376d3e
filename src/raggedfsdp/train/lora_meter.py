"""A LoRA run's tensor memory per rank, measured and predicted (``--lora-rank``).

After every optimizer step (its gradients and state still held) each rank measures the bytes of
its parameters' local pieces, their gradients and the optimizer's state, keeping the most of each;
at the end rank 0 writes them, beside what :func:`raggedfsdp.capacity.lora.lora_bytes` predicts,
as one ``lora_bytes`` record of ``metrics.jsonl``, which the summary shows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..capacity.lora import LoRABytes, lora_bytes, lora_units
from ..capacity.units import UnitBytes
from ..models.nf4 import NF4Weight
from ..tensor import local_piece
from .build import build_planner, meta_model, mp_policy, optimizer_bytes, wrap_policy
from .config import TrainConfig
from .monitor import Monitor

__all__ = ["LoRAMeter", "lora_tensor_bytes", "predicted_lora", "predicted_lora_bytes"]


def _nbytes(tensor: torch.Tensor) -> int:
    """Bytes of this rank's piece of ``tensor``; of a tensor subclass, of the tensors inside it
    (an NF4 weight's codes and scales, not the dtype it computes in)."""
    piece = local_piece(tensor)
    if isinstance(piece, NF4Weight):
        return _nbytes(piece.codes) + _nbytes(piece.scales)
    return piece.numel() * piece.element_size()


def lora_tensor_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> LoRABytes:
    """What this rank holds now, counted on its tensors as
    :func:`~raggedfsdp.capacity.lora.lora_bytes` predicts them."""
    base = frozen = adapters = grads = 0
    for param in model.parameters():
        if isinstance(local_piece(param), NF4Weight):
            base += _nbytes(param)
        elif param.requires_grad:
            adapters += _nbytes(param)
            grads += 0 if param.grad is None else _nbytes(param.grad)
        else:
            frozen += _nbytes(param)
    return LoRABytes(base, frozen, adapters, grads, optimizer_bytes(optimizer))


class LoRAMeter:
    """The most of each kind of bytes this rank held after any optimizer step of the launch."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.peak: dict[str, int] = {}
        optimizer.register_step_post_hook(self._measure)

    def _measure(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        now = lora_tensor_bytes(self.model, optimizer).as_dict()
        self.peak = {key: max(value, self.peak.get(key, 0)) for key, value in now.items()}

    def report(self, cfg: TrainConfig, monitor: Monitor, step: int) -> None:
        """Every rank's peaks to rank 0 (a collective), which records them with the
        prediction."""
        world = dist.get_world_size()
        measured: list[Any] = [None] * world
        dist.all_gather_object(measured, self.peak)
        if dist.get_rank() != 0:
            return
        predicted, base_numel = predicted_lora_bytes(cfg, world)
        monitor.lora_bytes(step, measured, [p.as_dict() for p in predicted], base_numel)


def predicted_lora_bytes(cfg: TrainConfig, world_size: int) -> tuple[list[LoRABytes], int]:
    """What :func:`~raggedfsdp.capacity.lora.lora_bytes` predicts each rank of the run holds,
    and the elements of its NF4 base."""
    model = meta_model(cfg)
    predicted = lora_bytes(model, build_planner(cfg), world_size, **_as_run(cfg, model))
    return predicted, sum(p.numel() for p in model.parameters() if isinstance(p, NF4Weight))


def predicted_lora(cfg: TrainConfig, world_size: int) -> tuple[list[LoRABytes], list[UnitBytes]]:
    """:func:`predicted_lora_bytes`' bytes per rank, and the run's FSDP units as the runtime
    holds them (:func:`~raggedfsdp.capacity.lora.lora_units`: an NF4 base as codes and
    scales), from one meta model."""
    model, planner = meta_model(cfg), build_planner(cfg)
    run = _as_run(cfg, model)
    ranks = lora_bytes(model, planner, world_size, **run)
    return ranks, lora_units(model, planner, world_size, **run)


def _as_run(cfg: TrainConfig, model: nn.Module) -> dict[str, Any]:
    """The run's units and mixed precision, as the capacity model's LoRA functions take them."""
    policy = mp_policy(cfg)
    return {
        "wrap": wrap_policy(model),
        "param_dtype": policy.param_dtype if policy is not None else None,
    }
