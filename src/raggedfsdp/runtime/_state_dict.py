"""The state dict of a sharded module: ragged shards as DCP-reshardable values, and back.

[Note: ragged shards in DCP] A rank's piece of a parameter is a contiguous flat range, which is
not one rectangle of the N-D tensor; :meth:`ShardLayout.boxes` cuts it into at most ``2*ndim-1``
rectangles, each a contiguous run of the local buffer. ``model.state_dict()`` returns every
sharded parameter as a ``ShardedTensor`` whose local shards are those rectangles (views, so
saving copies nothing and ``torch.distributed.checkpoint.load`` writes straight into the
parameters), and whose global metadata lists every rank's rectangles. DCP stores chunks by global
offsets, so a checkpoint reshards across world sizes and plans, and loads into FSDP2 (DTensor) or
a single process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)

from ..layout import ShardInfo, ShardLayout, shard_info
from ._collectives import all_gather
from ._metrics import RuntimeStats

__all__ = [
    "gather_full",
    "is_ragged",
    "load_state_dict_pre_hook",
    "local_flat",
    "state_dict_post_hook",
    "to_sharded_tensor",
]


def _global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def to_sharded_tensor(
    local: torch.Tensor, layout: ShardLayout, rank: int, group: dist.ProcessGroup | None
) -> ShardedTensor:
    """Wrap ``local`` (rank's flat piece of a ``layout``-placed tensor, any shape with the right
    numel) as a ``ShardedTensor`` whose local shards are views of it. No communication."""
    flat = local.reshape(-1)
    if flat.numel() and flat.data_ptr() != local.data_ptr():
        raise AssertionError("local piece must be contiguous")
    device = local.device
    start = layout.ranges[rank][0]
    shape = tuple(layout.global_shape)
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    local_shards = []
    metadata = []
    for r in range(layout.world_size):
        placement = f"rank:{_global_rank(group, r)}/{device}"
        for offsets, sizes in layout.boxes(r):
            md = ShardMetadata(list(offsets), list(sizes), placement)
            metadata.append(md)
            if r == rank:
                begin = sum(o * s for o, s in zip(offsets, strides, strict=True)) - start
                view = flat[begin : begin + math.prod(sizes)].view(sizes)
                local_shards.append(Shard(view, md))
    properties = TensorProperties(dtype=local.dtype, requires_grad=False)
    global_md = ShardedTensorMetadata(metadata, torch.Size(shape), properties)
    value = ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, global_md, process_group=group
    )
    # What gather_full needs, since torch's own gather assumes even chunks of dim 0.
    value._rf_layout, value._rf_rank, value._rf_group = layout, rank, group  # type: ignore[attr-defined]
    return value


def is_ragged(value: object) -> bool:
    """Whether ``value`` is a ShardedTensor made by :func:`to_sharded_tensor`."""
    return isinstance(value, ShardedTensor) and hasattr(value, "_rf_layout")


def local_flat(value: ShardedTensor) -> torch.Tensor:
    """This rank's piece of a ShardedTensor of :func:`to_sharded_tensor` (or one DCP built on
    the same metadata), 1-D: its local shards, in order, are consecutive runs of the piece."""
    shards = value.local_shards()
    if not shards:
        return torch.empty(0, dtype=_dtype(value))
    return torch.cat([s.tensor.reshape(-1) for s in shards])


def _dtype(value: ShardedTensor) -> torch.dtype:
    return value.metadata().tensor_properties.dtype  # ShardedTensor.dtype warns (deprecated)


def gather_full(value: ShardedTensor) -> torch.Tensor:
    """The full tensor of a ragged ShardedTensor, on every rank of its group (a collective):
    one all-gather of the pieces padded to the largest."""
    layout: ShardLayout = value._rf_layout  # type: ignore[attr-defined]
    group = value._rf_group  # type: ignore[attr-defined]
    piece = local_flat(value)
    dtype = _dtype(value)
    width = max(layout.local_numel(r) for r in range(layout.world_size))
    padded = torch.zeros(width, dtype=dtype, device=piece.device)
    padded[: piece.numel()] = piece
    gathered = torch.empty(width * layout.world_size, dtype=dtype, device=piece.device)
    all_gather(gathered, padded, group, RuntimeStats(), async_op=False)
    pieces = [
        gathered[r * width : r * width + layout.local_numel(r)] for r in range(layout.world_size)
    ]
    return layout.from_locals(pieces)


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
    ShardedTensors in ``state_dict`` (its values are detached, so parameters are found by name;
    inner units' are converted by their own hooks)."""
    for key, param in named_params:
        info = shard_info(param)
        if info is None or key not in state_dict:
            continue
        if info.layout.ndim == 0:
            state_dict[key] = _full_scalar(param, info)
        else:
            state_dict[key] = to_sharded_tensor(param.detach(), info.layout, info.rank, info.group)


def load_state_dict_pre_hook(
    named_params: Sequence[tuple[str, nn.Parameter]], state_dict: dict[str, Any]
) -> None:
    """Accept, for every sharded parameter of a unit, a ShardedTensor (from DCP) or a full
    tensor (from a single process or ``full_state_dict``), and hand ``nn.Module`` this rank's
    piece."""
    for key, param in named_params:
        info = shard_info(param)
        if info is None or key not in state_dict:
            continue
        value = state_dict[key]
        if isinstance(value, ShardedTensor):
            state_dict[key] = _local_from_sharded(value, param, info, key)
        elif isinstance(value, torch.Tensor):
            if value.shape != info.layout.global_shape:
                raise ValueError(
                    f"state dict entry {key!r} has shape {list(value.shape)}, expected the "
                    f"full shape {list(info.layout.global_shape)}"
                )
            state_dict[key] = info.layout.to_local(value.to(param.device), info.rank)


def _local_from_sharded(
    value: ShardedTensor, param: torch.Tensor, info: ShardInfo, key: str
) -> torch.Tensor:
    if tuple(value.size()) != tuple(info.layout.global_shape):
        raise ValueError(
            f"state dict entry {key!r} has shape {list(value.size())}, expected "
            f"{list(info.layout.global_shape)}"
        )
    shards = value.local_shards()
    if all(_is_view_of(s.tensor, param) for s in shards):
        return param.detach()  # DCP loaded in place already
    mine = to_sharded_tensor(torch.empty_like(param), info.layout, info.rank, info.group)
    by_offsets = {tuple(s.metadata.shard_offsets): s.tensor for s in shards}
    out = torch.empty_like(param).reshape(-1)
    position = 0
    for shard in mine.local_shards():
        source = by_offsets.get(tuple(shard.metadata.shard_offsets))
        if source is None or source.shape != shard.tensor.shape:
            raise ValueError(
                f"state dict entry {key!r}: its ShardedTensor's local shards do not match this "
                f"rank's layout; load it with torch.distributed.checkpoint, which reshards"
            )
        out[position : position + source.numel()] = source.reshape(-1)
        position += source.numel()
    return out.view(param.shape)


def _is_view_of(tensor: torch.Tensor, param: torch.Tensor) -> bool:
    if tensor.numel() == 0:
        return True
    base = param.data_ptr()
    end = base + param.numel() * param.element_size()
    return base <= tensor.data_ptr() < end
