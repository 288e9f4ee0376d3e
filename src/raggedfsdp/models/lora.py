"""LoRA fine-tuning of a model's blocks, over a frozen base (QLoRA: the base in NF4).

:func:`apply_lora` freezes every parameter and gives each ``nn.Linear`` inside the blocks two
trainable adapters, ``y = x W^T + b + (x A^T) B^T``, as Hu et al. and PEFT do: ``A`` (rank x in)
Kaiming-uniform, ``B`` (out x rank) zero, so training starts from the base model. With an NF4 block
the frozen ``W`` becomes an :class:`~raggedfsdp.models.nf4.NF4Weight` (Dettmers et al.'s QLoRA).
Parameter names stay the base model's (``...q_proj.weight``) beside ``lora_a`` / ``lora_b``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .nf4 import NF4Weight

__all__ = ["LoRALinear", "apply_lora", "lora_linears"]


class LoRALinear(nn.Module):
    """A frozen linear (``weight``, ``bias``: plain or NF4) with trainable adapters ``lora_a``
    and ``lora_b`` beside it (scale 1: ``alpha`` equal to the rank)."""

    def __init__(self, linear: nn.Linear, rank: int, nf4_block: int | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        if nf4_block is not None:
            weight = NF4Weight.quantize(weight, nf4_block)
        self.weight = nn.Parameter(weight, requires_grad=False)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        factory = {"device": weight.device, "dtype": linear.weight.dtype}
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, **factory))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, **factory))
        if not self.lora_a.is_meta:
            nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # nn.Linear's, as PEFT's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_a), self.lora_b)

    def extra_repr(self) -> str:
        rank = self.lora_a.shape[0]
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={rank}"


def lora_linears(model: nn.Module, blocks: list[nn.Module]) -> list[tuple[str, nn.Linear]]:
    """Every ``nn.Linear`` inside ``blocks`` (modules of ``model``), by its name in ``model``."""
    inside = {id(m) for block in blocks for m in block.modules()}
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and id(module) in inside
    ]


def apply_lora(
    model: nn.Module, blocks: list[nn.Module], rank: int, nf4_block: int | None = None
) -> None:
    """Freeze ``model`` and put a :class:`LoRALinear` of ``rank`` in place of every linear in
    ``blocks`` (its base in NF4 of ``nf4_block`` elements a scale, when given). ``ValueError``,
    naming the linear, when the blocks have none or ``nf4_block`` does not divide a linear's
    in-features (each row whole blocks, so any cut between rows keeps blocks whole)."""
    linears = lora_linears(model, blocks)
    if not linears:
        raise ValueError("lora_rank: the model's blocks hold no nn.Linear to put adapters beside")
    if nf4_block is not None:
        for name, linear in linears:
            if linear.in_features % nf4_block:
                raise ValueError(
                    f"nf4_block_size: {nf4_block} does not divide the {linear.in_features} "
                    f"in-features of linear {name!r}; choose a block that divides every "
                    f"linear's in-features"
                )
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for path, linear in linears:
        parent_path, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent_path), attr, LoRALinear(linear, rank, nf4_block))
