"""The state dict of a sharded module: ragged shards as DCP-reshardable values, and back.

[Note: ragged shards in DCP] A rank's piece of a parameter is a contiguous flat range, which is
not one rectangle of the N-D tensor; :meth:`ShardLayout.boxes` cuts it into at most ``2*ndim-1``
rectangles, each a contiguous run of the local buffer. ``model.state_dict()`` returns every
sharded parameter as a :class:`~._ragged_tensor.RaggedTensor` whose rectangles are views of the
parameter (so saving copies nothing and ``torch.distributed.checkpoint.load`` writes straight
into the parameters; see [Note: the ragged tensor container]). DCP stores chunks by global
offsets, so a checkpoint reshards across world sizes and plans, and loads into FSDP2 (DTensor) or
a single process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..layout import ShardInfo, shard_info
from ._ragged_tensor import RaggedTensor, local_flat, to_ragged_tensor

__all__ = ["load_state_dict_pre_hook", "state_dict_post_hook"]


def _full_scalar(param: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """A 0-D parameter lives on one rank; every rank gets its value (DCP treats plain tensors
    as replicated)."""
    value = param.detach().reshape(-1).sum().reshape(())  # 0 where this rank holds nothing
    dist.all_reduce(value, group=info.group)
    return value


def state_dict_post_hook(
    named_params: Sequence[tuple[str, nn.Parameter]], state_dict: dict[str, Any]
) -> None:
    """Turn a unit's sharded parameters (``(key, parameter)`` under every name) into
    RaggedTensors in ``state_dict`` (its values are detached, so parameters are found by name;
    inner units' are converted by their own hooks)."""
    for key, param in named_params:
        info = shard_info(param)
        if info is None or key not in state_dict:
            continue
        if info.layout.ndim == 0:
            state_dict[key] = _full_scalar(param, info)
        else:
            state_dict[key] = to_ragged_tensor(param.detach(), info.layout, info.rank, info.group)


def load_state_dict_pre_hook(
    named_params: Sequence[tuple[str, nn.Parameter]], state_dict: dict[str, Any]
) -> None:
    """Accept, for every sharded parameter of a unit, a RaggedTensor (from DCP) or a full
    tensor (from a single process or ``full_state_dict``), and hand ``nn.Module`` this rank's
    piece."""
    for key, param in named_params:
        info = shard_info(param)
        if info is None or key not in state_dict:
            continue
        value = state_dict[key]
        if isinstance(value, RaggedTensor):
            state_dict[key] = _local_from_ragged(value, param, info, key)
        elif isinstance(value, torch.Tensor):
            if value.shape != info.layout.global_shape:
                raise ValueError(
                    f"state dict entry {key!r} has shape {list(value.shape)}, expected the "
                    f"full shape {list(info.layout.global_shape)}"
                )
            state_dict[key] = info.layout.to_local(value.to(param.device), info.rank)


def _local_from_ragged(
    value: RaggedTensor, param: torch.Tensor, info: ShardInfo, key: str
) -> torch.Tensor:
    """This rank's piece of ``value``, whose rectangles must be this rank's own. (DCP loaded
    into the parameter in place when ``value`` came from this model's ``state_dict()``.)"""
    if tuple(value.shape) != tuple(info.layout.global_shape):
        raise ValueError(
            f"state dict entry {key!r} has shape {list(value.shape)}, expected "
            f"{list(info.layout.global_shape)}"
        )
    if not value.placed_as(info.layout, info.rank):
        # Compared even when this rank holds nothing: an empty piece of another plan is not ours.
        raise ValueError(
            f"state dict entry {key!r}: its RaggedTensor's rectangles do not match this "
            f"rank's layout; load it with torch.distributed.checkpoint, which reshards"
        )
    return local_flat(value).view(param.shape)
