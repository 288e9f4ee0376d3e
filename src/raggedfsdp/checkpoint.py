"""Checkpoints: DCP-compatible sharded state dicts, and full (unsharded) export.

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
from collections.abc import Mapping
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

from .collectives import all_gather
from .layout import ShardInfo, ShardLayout, shard_info
from .metrics import RuntimeStats

__all__ = [
    "full_state_dict",
    "register_state_dict_hooks",
    "to_sharded_tensor",
]

_STATE_ATTR = "_raggedfsdp_state"


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
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, global_md, process_group=group
    )


def _full_scalar(param: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """A 0-D parameter lives on one rank; every rank gets its value (DCP treats plain tensors
    as replicated)."""
    value = param.detach().reshape(-1).sum().reshape(())  # 0 where this rank holds nothing
    dist.all_reduce(value, group=info.group)
    return value


def _state_dict_post_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """Turn the sharded parameters under this unit into ShardedTensors (state-dict values are
    detached, so parameters are found by name; inner units' are converted already)."""
    for key, param in _unit_params(module, prefix):
        info = shard_info(param)
        if info is None or key not in state_dict:
            continue
        if info.layout.ndim == 0:
            state_dict[key] = _full_scalar(param, info)
        else:
            state_dict[key] = to_sharded_tensor(param.detach(), info.layout, info.rank, info.group)


def _load_state_dict_pre_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    """Accept, for every sharded parameter, a ShardedTensor (from DCP) or a full tensor (from a
    single process or ``full_state_dict``), and hand ``nn.Module`` this rank's piece."""
    for key, param in _unit_params(module, prefix):
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


def _unit_params(module: nn.Module, prefix: str) -> list[tuple[str, nn.Parameter]]:
    """State-dict keys and sharded parameters of this unit only (inner units have their own
    hooks), under every name a tied parameter has."""
    state = getattr(module, _STATE_ATTR)
    names = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
    out = []
    for reg in state.group.registrations:
        for owner, attr in reg.owners:
            path = names[id(owner)]
            out.append(
                (f"{prefix}{path}.{attr}" if path else f"{prefix}{attr}", owner._parameters[attr])
            )
    return out


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


def register_state_dict_hooks(module: nn.Module) -> None:
    """Installed by ``fully_shard`` on every unit."""
    module.register_state_dict_post_hook(_state_dict_post_hook)
    module.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)


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
    for key, value in _raw_state_dict(model).items():
        out[key] = full[id(value)] if id(value) in full else value.detach().to("cpu", copy=True)
    return out


def _raw_state_dict(model: nn.Module) -> Mapping[str, torch.Tensor]:
    """The keys and order of ``state_dict()`` (parameters, then persistent buffers, module by
    module, pre-order, shared ones under every name), with the parameter objects themselves
    rather than what our state-dict hooks make of them."""
    out: dict[str, torch.Tensor] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        prefix = f"{mname}." if mname else ""
        for name, param in module._parameters.items():
            if param is not None:
                out[prefix + name] = param
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[prefix + name] = buf
    return out
