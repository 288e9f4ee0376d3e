"""Sharded parameters changed outside the runtime, taken back: FSDP2's ``reset_sharded_param``.

``nn.Module._apply`` and assignment can leave a sharded parameter outside its bucket's buffer;
:func:`adopt` puts its values back in and makes it a view again ([Note: adopting changed parameters]
at :func:`adopt`).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from ..planner import ShardPlan
from ._dbuffer import DBuffer
from ._mesh import MeshInfo
from ._offload import HostOffload
from ._param import FSDPParam
from .api import MixedPrecisionPolicy


class Unit(Protocol):
    """What adopting needs of a unit's parameter group (``Unit``, which calls
    :func:`adopt` itself, hence a protocol rather than an import)."""

    buckets: list[DBuffer]
    mesh_info: MeshInfo
    mp_policy: MixedPrecisionPolicy
    offload: HostOffload | None
    device: torch.device

    @property
    def label(self) -> str: ...

    def qualify(self, name: str) -> str: ...

    def named_plans(self, paths: list[str] | None = None) -> list[ShardPlan]: ...

    def rebind(self) -> None: ...


__all__ = ["adopt", "materialize", "meta_parameters"]


# [Note: adopting changed parameters] A unit's sharded parameters are RaggedTensors whose local
# tensors are views of their bucket's shard buffer. Three things break that without the unit
# knowing:
#
# - ``nn.Module._apply`` (``to_empty``, ``to(dtype)``, ``to(device)``, ``half()``, ...) swaps new
#   contents into every DTensor parameter (``torch.utils.swap_tensors``): the parameter object is
#   the same, but its local tensor is a new tensor, of the new dtype or device, outside the buffer;
# - ``load_state_dict(assign=True)`` and plain assignment (``module.weight = p``) make the module
#   hold another tensor in the parameter's place;
# - nothing else: an in-place update (an optimizer step, ``copy_``, ``nn.init``) writes through the
#   view, which is the point.
#
# :func:`adopt` makes the unit whole again, as FSDP2 does: each parameter's current values go into
# its bucket's buffer (a new one, of the new dtype and on the new device, if those changed -- and
# then the unit's storages and strategies are made anew), the parameter's local tensor is a view of
# it again, and the modules hold the unit's parameters. Values held in a parameter's place are
# copied in by ``copy_``, so a whole tensor, a sharded one of this layout or another (resharded, a
# collective: every rank adopts at the same points) all work. The plan (which element lies where)
# never changes, so a dtype change keeps each rank's pieces. ``FSDPModule._apply``, the load
# post-hook and every unshard adopt, so nothing computes with a parameter the unit does not hold.
def adopt(group: Unit) -> None:
    """Take back every parameter of ``group`` that changed (see the Note); a no-op, costing
    one identity check per parameter, when none did. The unit must be sharded."""
    relocated = False
    for bucket in group.buckets:
        if any(_changed(param, bucket) for param in bucket.params):
            relocated |= _adopt_bucket(group, bucket)
    if relocated:
        group.rebind()


def _changed(param: FSDPParam, bucket: DBuffer) -> bool:
    return param.held() is not param.sharded or not _in_buffer(param, bucket)


def _in_buffer(param: FSDPParam, bucket: DBuffer) -> bool:
    """Whether the sharded parameter's local tensor is still its view of the shard buffer."""
    local = param.sharded._local_tensor
    if local.numel() == 0:  # nothing held here: any empty tensor of the buffer's kind will do
        return local.dtype == bucket.local.dtype and local.device == bucket.local.device
    return (
        local.untyped_storage().data_ptr() == bucket.local.untyped_storage().data_ptr()
        and local.storage_offset() == bucket.local.storage_offset() + param.local_start
        and local.dtype == bucket.local.dtype
    )


def _adopt_bucket(group: Unit, bucket: DBuffer) -> bool:
    """Adopt one bucket's parameters; returns whether its buffer moved to another dtype or
    device (the unit's storages and strategies must then be made anew)."""
    swapped = [p for p in bucket.params if not _in_buffer(p, bucket)]
    kinds = {(p.sharded._local_tensor.dtype, p.sharded._local_tensor.device) for p in swapped}
    if len(kinds) > 1 or (kinds and len(swapped) < len(bucket.params) and _moves(kinds, bucket)):
        names = [group.qualify(p.fqn) for p in bucket.params]
        raise ValueError(
            f"parameters {names} share a buffer and must keep one dtype and device, but "
            f"{sorted(str(k) for k in kinds)} were given to some of them; convert the module "
            f"that fully_shard was applied to (model.to(...)), not a part of it"
        )
    relocated = bool(kinds) and _moves(kinds, bucket)
    if relocated:
        dtype, device = kinds.pop()
        _relocate(group, bucket, dtype, device)
    elif bucket.local.device.type == "meta":
        # Values assigned in place of shards still on meta (a meta model loaded with
        # ``load_state_dict(assign=True)``: DSD, accelerate's cpu_ram_efficient_loading): the
        # buffer is made where they are, else copying them into meta would drop them.
        devices = [p.held().device for p in bucket.params if p.held() is not p.sharded]
        real = [d for d in devices if d.type != "meta"]
        if real:
            _relocate(group, bucket, bucket.local.dtype, real[0])
            relocated = True
    for param in swapped if not relocated else []:
        _view_of_buffer(param, bucket).copy_(param.placement.flat(param.sharded._local_tensor))
        param.sharded._local_tensor = _piece(param, bucket)
    for param in bucket.params:
        held = param.held()
        if held is not param.sharded:
            with torch.no_grad():
                param.sharded.copy_(held.detach())
        param.hold(unsharded=False)
    return relocated


def _moves(kinds: set[tuple[torch.dtype, torch.device]], bucket: DBuffer) -> bool:
    return any(kind != (bucket.local.dtype, bucket.local.device) for kind in kinds)


def _relocate(group: Unit, bucket: DBuffer, dtype: torch.dtype, device: torch.device) -> None:
    """A new shard buffer of ``dtype`` on ``device`` with every parameter's current values
    (none to copy from meta), each sharded parameter's local tensor a view of it."""
    if group.offload is not None and device.type != "cpu":
        raise ValueError(
            f"unit {group.label!r} keeps its shards on the host (CPUOffloadPolicy); moving them "
            f"to {device} would drop the offload: move only the unsharded compute (mesh) device"
        )
    local = torch.zeros(bucket.shard_numel, dtype=dtype, device=device)
    for param in bucket.params:
        values = param.sharded._local_tensor
        if values.device.type != "meta" and device.type != "meta":
            local[param.local_start : param.local_end].copy_(param.placement.flat(values))
    bucket.relocate(local, group.mp_policy.param_dtype, None if group.offload else device)
    if group.offload is None:
        group.device = device  # the unit computes where its parameters now are
    for param in bucket.params:
        sharded = param.sharded
        if (sharded.dtype, sharded.device) == (local.dtype, local.device):  # swapped in already
            sharded._local_tensor = _piece(param, bucket)
            continue
        # A DTensor's dtype and device are its own, not its local tensor's: a new one is made
        # and swapped into the parameter object, which everyone (optimizers) keeps. Placed as
        # before, by its form: its mesh (with tensor- or expert-parallel dims), placements and
        # whole shape.
        layout = bucket.plan.layout(param.fqn)
        view = _view_of_buffer(param, bucket).view(layout.local_shape(bucket.rank))
        fresh = param.placement.place(view, layout, bucket.mesh_info, sharded.device_mesh)
        torch.utils.swap_tensors(sharded, nn.Parameter(fresh, sharded.requires_grad))


def _view_of_buffer(param: FSDPParam, bucket: DBuffer) -> torch.Tensor:
    return bucket.local[param.local_start : param.local_end]


def _piece(param: FSDPParam, bucket: DBuffer) -> torch.Tensor:
    """The sharded parameter's local tensor as a view of the shard buffer, as its form sees
    this rank's piece."""
    shape = bucket.plan.layout(param.fqn).local_shape(bucket.rank)
    return param.placement.piece(_view_of_buffer(param, bucket).view(shape))


def meta_parameters(group: Unit, paths: list[str]) -> list[str]:
    """The names of ``group``'s parameters still on the meta device (nothing can run on them),
    its modules being at ``paths``."""
    plans = group.named_plans(paths)
    return [
        name
        for bucket, plan in zip(group.buckets, plans, strict=True)
        if bucket.local.device.type == "meta"
        for name in plan.model_order
    ]


def materialize(group: Unit) -> None:
    """Give every bucket of ``group`` still on meta a shard buffer of zeros on the unit's device
    (the values are the caller's to fill: ``rf.init_sharded_``)."""
    moved = False
    for bucket in group.buckets:
        if bucket.local.device.type == "meta":
            device = torch.device("cpu") if group.offload is not None else group.device
            _relocate(group, bucket, bucket.dtype, device)
            moved = True
    if moved:
        group.rebind()
