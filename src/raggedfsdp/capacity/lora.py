"""A LoRA / QLoRA run's tensor bytes on each rank (``train --lora-rank R``, docs/lora.md).

Its frozen base, trainable adapters, their gradients and AdamW's state, from the meta model
(adapters in place) and the run's planner, as the runtime shards it: an NF4 base by
:func:`~raggedfsdp.planner.block_layout` (whole blocks and rows a rank; :func:`nf4_bytes`), every
other parameter by its bucket's plan. Each rank's own bytes, padding aside: what the job measures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..models.nf4 import NF4Weight, nf4_bytes
from ..planner import StructAwarePlanner, WrapPolicy, block_layout, model_buckets
from .optimizer_state import optimizer_state_bytes

__all__ = ["LoRABytes", "lora_bytes"]


@dataclass(frozen=True)
class LoRABytes:
    """One rank's tensor bytes of a LoRA run, by what they hold."""

    base: int
    """The NF4 base: codes and scales of the rank's whole blocks."""
    frozen: int
    """Every other frozen parameter (embeddings, norms, a plain base without NF4)."""
    adapters: int
    """The trainable parameters (the adapters)."""
    grads: int
    """Their gradients (the sharded ones, between backward and the optimizer's zero_grad)."""
    optimizer: int
    """AdamW's state (two moments and a step per trainable parameter)."""

    @property
    def total(self) -> int:
        return self.base + self.frozen + self.adapters + self.grads + self.optimizer

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def lora_bytes(
    module: nn.Module,
    planner: StructAwarePlanner,
    world_size: int,
    *,
    wrap: WrapPolicy = None,
    param_dtype: torch.dtype | None = None,
) -> list[LoRABytes]:
    """Rank by rank, the :class:`LoRABytes` of ``module`` sharded over ``world_size`` ranks by
    ``planner`` (``wrap``, ``param_dtype``: the run's units and mixed precision, as
    ``StructAwarePlanner.plan_model`` takes them), trained by AdamW."""
    base = [0] * world_size
    for name, param in module.named_parameters():
        if not isinstance(param, NF4Weight):
            continue
        layout = block_layout(name, param.shape, world_size, param.block, planner.shard_policy)
        for rank in range(world_size):
            base[rank] += sum(nf4_bytes(layout.local_numel(rank), param.block))
    buckets = model_buckets(
        module,
        param_dtype=param_dtype,
        wrap=wrap,
        local=lambda name, p: None if isinstance(p, NF4Weight) else p,
    )
    plans = [(b, planner.plan_bucket(b, world_size)) for b in buckets]
    trainable = [plan for bucket, plan in plans if bucket.requires_grad]
    out = []
    for rank in range(world_size):
        held = {True: 0, False: 0}
        for bucket, plan in plans:
            for name in plan.entries:
                start, end = plan.local_range(name, rank)
                held[bucket.requires_grad] += (end - start) * bucket.dtype.itemsize
        out.append(
            LoRABytes(
                base=base[rank],
                frozen=held[False],
                adapters=held[True],
                grads=held[True],
                optimizer=optimizer_state_bytes(trainable, "adamw", rank=rank),
            )
        )
    return out
