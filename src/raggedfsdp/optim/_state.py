"""The state of sharded parameters: kept as RaggedTensors, and taken back from a state dict.

Why the state is RaggedTensors and where each entry lies: [Note: optimizer state across world sizes]
at :func:`local`; what ``load_state_dict`` takes for an entry: the comment at :func:`loaded_value`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..layout import ShardLayout
from ..tensor import RaggedShardPlacement, RaggedTensor, shard_info, to_ragged_tensor

__all__ = ["LayoutOf", "loaded_value", "local", "placed"]

#: How an optimizer places its state: ``fn(param, key)`` -> the entry's layout, or ``None``
#: when the entry is not sharded (``step``).
LayoutOf = Callable[[torch.Tensor, str], ShardLayout | None]


# [Note: optimizer state across world sizes] raggedfsdp's optimizers keep the state of a sharded
# parameter (a RaggedTensor, [Note: ragged shards as DTensors]) as RaggedTensors over the
# parameter's ranks, as torch's optimizers do over FSDP2's DTensors (``zeros_like(param)``). So
# ``optimizer.state_dict()`` is what ``torch.distributed.checkpoint`` saves and reshards, as it is,
# and DSD's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (full or sharded) take it
# unchanged: no hook and no conversion. Keeping it (rather than converting at ``state_dict()``) also
# makes a DCP load land in the state itself, and keeps the state's keys and global shapes those of
# the single-device optimizer, which holds the global tensors: a checkpoint of either loads into the
# other.
#
# Where each entry lies is decided by its key (``ShardedOptimizer.sharded_state_layout``):
#
# 1. ``step`` (0-D) is a plain tensor, the same on every rank; Python numbers stay numbers;
# 2. param-shaped entries (moments, momentum, 8-bit codes) are placed like the parameter;
# 3. block-structured entries have a layout of their own over the same ranks, where each rank holds
#    the entries of the blocks it holds: 8-bit AdamW's scales (one per block, globally ``[tile_rows,
#    tile_cols]``) and Shampoo's factors (globally the concatenation of every block's flattened
#    factor in row-major block order).
#
# The step computes on the local pieces (``to_local()``). The state of plain parameters is plain
# (whole), as torch's.
def local(value: Any) -> Any:
    """This rank's piece of a sharded tensor (no copy); anything else as it is."""
    return value.to_local() if isinstance(value, DTensor) else value


def placed(param: torch.Tensor, layout: ShardLayout | None, piece: torch.Tensor) -> torch.Tensor:
    """A new state entry of ``param`` from this rank's ``piece``: a RaggedTensor placed by
    ``layout`` over the parameter's ranks when the parameter is one, else ``piece`` itself."""
    if layout is None or not isinstance(param, RaggedTensor):
        return piece
    return to_ragged_tensor(piece, layout, param)


# ``load_state_dict`` takes, per entry of a sharded parameter (:func:`loaded_value`):
#
# - a RaggedTensor placed as this entry is: kept as it is (DCP loaded it in place: no copy);
# - a RaggedTensor of another layout: a ``ValueError`` naming the parameter and the key. Cutting
#   this rank's piece out of it would need the whole tensor (a collective that every rank would have
#   to join, entry by entry, inside ``load_state_dict``); ``dcp.load`` into this optimizer's own
#   ``state_dict()`` reshards it, chunk by chunk, with no whole tensor;
# - the whole tensor (DSD's ``full_state_dict``, a single-process checkpoint): this rank's piece;
# - this rank's own piece as a plain tensor (a per-rank ``torch.save`` of an older run at the same
#   world size): placed as this entry is.
#
# To load at another world size, the new run first needs state of its own for DCP to fill: DSD makes
# it by one step with zero gradients and learning rate 0 (``_init_optim_state``), and so does
# :func:`raggedfsdp.checkpoint.init_optimizer_state`.
def loaded_value(param: torch.Tensor, key: str, value: Any, layout_of: LayoutOf, label: str) -> Any:
    """What the state entry ``key`` of ``param`` becomes when ``value`` is loaded into it (the
    Note's list); ``label`` names the parameter in errors."""
    layout = layout_of(param, key) if isinstance(param, RaggedTensor) else None
    if layout is None or not isinstance(value, torch.Tensor):
        return value  # not sharded: torch's rules apply
    info = shard_info(param)
    assert info is not None
    device = local(param).device
    if isinstance(value, DTensor) and all(p.is_replicate() for p in value.placements):
        value = value.to_local()  # the whole entry, on every rank
    if not isinstance(value, DTensor):
        piece = _piece(value.to(device), layout, info.rank, key, label)
        return to_ragged_tensor(piece, layout, param)
    if not isinstance(value, RaggedTensor) or value.shard_layout != layout:
        raise ValueError(
            f"optimizer state {key!r} of {label} is placed {value.placements}, not as this "
            f"optimizer's ({RaggedShardPlacement(layout)!r}): its rectangles do not match this "
            f"rank's layout (another world size or plan); load it with "
            f"torch.distributed.checkpoint (dcp.load into this optimizer's state_dict()), which "
            f"reshards"
        )
    if value.device_mesh == param.device_mesh and value.device == device:
        return value
    # The same ranks and pieces on another mesh object (unpickled) or device: rewrapped.
    return to_ragged_tensor(value.to_local().to(device), layout, param)


def _piece(
    value: torch.Tensor, layout: ShardLayout, rank: int, key: str, label: str
) -> torch.Tensor:
    """This rank's piece of a plain ``value``: the whole entry, or this rank's piece already."""
    if value.shape == layout.global_shape:
        return layout.to_local(value, rank).clone()  # its own memory, not a view of the whole
    if value.numel() == layout.local_numel(rank):
        return value.reshape(layout.local_shape(rank))
    raise ValueError(
        f"optimizer state {key!r} of {label}: a plain tensor of shape {list(value.shape)} is "
        f"neither the whole entry (shape {list(layout.global_shape)}) nor rank {rank}'s piece "
        f"({layout.local_numel(rank)} elements)"
    )
