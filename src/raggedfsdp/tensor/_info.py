"""What a tensor says about where it lies.

Read from a :class:`~._ragged_tensor.RaggedTensor`'s ragged placement; a plain tensor is held whole
by this process (single device, or replicated).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..layout import ShardLayout
from ._placement import ShardInfo
from ._ragged_tensor import RaggedTensor

__all__ = [
    "comm_group",
    "global_shape",
    "layout_of",
    "local_piece",
    "local_range",
    "shard_info",
]


def shard_info(param: torch.Tensor) -> ShardInfo | None:
    """The :class:`ShardInfo` of a sharded tensor (a :class:`RaggedTensor`), or ``None`` for
    any other tensor."""
    if not isinstance(param, RaggedTensor):
        return None
    return ShardInfo(param.shard_layout, param.shard_rank, param.shard_group)


def layout_of(param: torch.Tensor) -> ShardLayout | None:
    """The :class:`ShardLayout` of a sharded tensor, or ``None`` for any other tensor."""
    return param.shard_layout if isinstance(param, RaggedTensor) else None


def local_piece(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``tensor``: a DTensor's local tensor, a plain tensor itself (what a
    rank's own bytes and values are counted from)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def global_shape(param: torch.Tensor) -> torch.Size:
    """Shape of the whole tensor the layout cuts: the layout's global shape (under tensor or
    expert parallelism, the slice this rank's other placements leave), or the tensor's own
    shape. A tensor's own ``shape`` is always the whole tensor's."""
    layout = layout_of(param)
    return param.shape if layout is None else layout.global_shape


def local_range(param: torch.Tensor) -> tuple[int, int]:
    """This rank's ``[start, end)`` in the flattened index space the layout cuts."""
    info = shard_info(param)
    return (0, param.numel()) if info is None else info.layout.ranges[info.rank]


def comm_group(param: torch.Tensor) -> dist.ProcessGroup | None:
    """The process group a sharded tensor's pieces are spread over, or ``None`` when this
    process holds the whole tensor (a plain tensor, or a layout of one rank)."""
    info = shard_info(param)
    if info is None or info.layout.world_size == 1:
        return None
    group_shape = (dist.get_world_size(info.group), dist.get_rank(info.group))
    if group_shape != (info.layout.world_size, info.rank):
        raise ValueError(
            f"a tensor of shape {list(info.layout.global_shape)} is rank {info.rank} of a "
            f"layout over {info.layout.world_size} ranks, but this process is rank "
            f"{group_shape[1]} of {group_shape[0]} in its process group"
        )
    return info.group
