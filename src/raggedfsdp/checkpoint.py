"""Checkpoint integration: full (unsharded) state export.

``full_state_dict`` gathers every sharded parameter with one all-gather per bucket (in bucket
order, identical on every rank) and returns exactly the unwrapped model's ``state_dict()`` keys.
"""

from __future__ import annotations

import torch
from torch import nn

from .collectives import all_gather
from .layout import shard_info
from .metrics import RuntimeStats

__all__ = ["full_state_dict"]

_STATE_ATTR = "_raggedfsdp_state"


def _sharded_to_full(model: nn.Module) -> dict[int, torch.Tensor]:
    """``id(sharded parameter) -> full tensor on CPU`` for every bucket under ``model``."""
    full: dict[int, torch.Tensor] = {}
    stats = RuntimeStats()
    for module in model.modules():
        state = getattr(module, _STATE_ATTR, None)
        if state is None:
            continue
        group = state.group
        for bucket in group.buckets:
            gathered = torch.empty(
                bucket.world_size * bucket.shard_numel, dtype=bucket.dtype, device=bucket.device
            )
            all_gather(gathered, bucket.local, group.mesh_info.shard_group, stats, async_op=False)
            for slot in bucket.slots:
                piece = gathered[slot.offset : slot.offset + slot.numel].view(slot.shape)
                full[id(slot.sharded)] = piece.detach().to("cpu", copy=True)
    return full


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped model's ``state_dict()``: same keys (both names of a tied parameter,
    persistent buffers included), full tensors on CPU, on every rank. A collective: every rank
    must call it, with the model between steps (sharded)."""
    full = _sharded_to_full(model)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if shard_info(value) is not None:
            out[key] = full[id(value)]
        else:
            out[key] = value.detach().to("cpu", copy=True)
    return out
