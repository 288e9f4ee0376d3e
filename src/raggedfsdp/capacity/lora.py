"""A LoRA / QLoRA run's tensor bytes on each rank (``train --lora-rank R``, docs/lora.md).

Its frozen base, trainable adapters, their gradients and AdamW's state, from the meta model
(adapters in place) and the run's planner, as the runtime shards it: an NF4 base by
:func:`~raggedfsdp.planner.block_layout` (whole blocks and rows a rank; :func:`nf4_bytes`), every
other parameter by its bucket's plan. Each rank's own bytes, padding aside: what the job measures.
Its units as the runtime holds them (:func:`lora_units`) feed the launch-time memory check.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from ..models.nf4 import NF4Weight, nf4_bytes
from ..planner import Bucket, ShardPlan, StructAwarePlanner, WrapPolicy, block_layout, model_buckets
from .optimizer_state import optimizer_state_bytes
from .units import UnitBytes, unit_bytes, unit_path

__all__ = ["LoRABytes", "lora_bytes", "lora_units"]


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
    plans = _plain_plans(module, planner, world_size, wrap, param_dtype)
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


def lora_units(
    module: nn.Module,
    planner: StructAwarePlanner,
    world_size: int,
    *,
    wrap: WrapPolicy = None,
    param_dtype: torch.dtype | None = None,
) -> list[UnitBytes]:
    """The FSDP units of the run :func:`lora_bytes` costs, as the runtime holds them (for
    :func:`~.cost.memory_breakdown`): every parameter but the NF4 base by its bucket's plan,
    and each unit's NF4 weights all-gathered as their codes and scales
    (:attr:`~.units.UnitBytes.subclass_bytes`; ``runtime/_subclass.py``), with no gradient."""
    nf4 = model_buckets(
        module, wrap=wrap, local=lambda name, p: p if isinstance(p, NF4Weight) else None
    )
    gathered: dict[str, int] = {}
    for bucket in nf4:
        path = unit_path(bucket.name)
        for weight in bucket.params.values():
            assert isinstance(weight, NF4Weight)
            gathered[path] = gathered.get(path, 0) + sum(nf4_bytes(weight.numel(), weight.block))
    plans = [plan for _, plan in _plain_plans(module, planner, world_size, wrap, param_dtype)]
    units = [replace(u, subclass_bytes=gathered.pop(u.path, 0)) for u in unit_bytes(plans)]
    if gathered:  # an NF4 weight sits beside its adapters (models/lora.py): never alone
        raise ValueError(f"units {sorted(gathered)} hold NF4 weights and no plain parameter")
    return units


def _plain_plans(
    module: nn.Module,
    planner: StructAwarePlanner,
    world_size: int,
    wrap: WrapPolicy,
    param_dtype: torch.dtype | None,
) -> list[tuple[Bucket, ShardPlan]]:
    """Every bucket of ``module`` but its NF4 weights (the runtime shards those apart, as
    tensor subclasses), with its plan over ``world_size`` ranks."""
    buckets = model_buckets(
        module,
        param_dtype=param_dtype,
        wrap=wrap,
        local=lambda name, p: None if isinstance(p, NF4Weight) else p,
    )
    return [(b, planner.plan_bucket(b, world_size)) for b in buckets]
