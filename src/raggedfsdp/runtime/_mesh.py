"""The process groups and the device a unit runs on, read from the user's mesh."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._host import default_device

__all__ = ["MeshInfo", "device_for", "mesh_info"]


@dataclass(frozen=True)
class MeshInfo:
    """The process groups a unit communicates over: ``shard_group`` (all-gather and
    reduce-scatter) and, for HSDP, ``replicate_group`` (all-reduce of the reduced shard)."""

    shard_group: dist.ProcessGroup
    shard_rank: int
    shard_size: int
    replicate_group: dist.ProcessGroup | None = None
    replicate_size: int = 1


def mesh_info(mesh: DeviceMesh | None) -> MeshInfo:
    """The groups of a 1-D (shard) or 2-D (replicate, shard) mesh; ``None``: the world."""
    if not dist.is_initialized():
        raise RuntimeError(
            "raggedfsdp: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group() (also for a single process) before "
            "fully_shard"
        )
    world = dist.get_world_size()
    if mesh is None:
        group = dist.group.WORLD
        assert group is not None
        return MeshInfo(group, dist.get_rank(), world)
    if mesh.size() != world:
        raise ValueError(
            f"mesh of shape {tuple(mesh.shape)} has {mesh.size()} ranks but the process group "
            f"has {world}; the mesh must cover every rank"
        )
    if mesh.ndim == 1:
        return MeshInfo(mesh.get_group(0), mesh.get_local_rank(0), mesh.size(0))
    if mesh.ndim == 2:  # HSDP: (replicate, shard)
        return MeshInfo(
            mesh.get_group(1),
            mesh.get_local_rank(1),
            mesh.size(1),
            replicate_group=mesh.get_group(0),
            replicate_size=mesh.size(0),
        )
    raise ValueError(f"mesh must be 1-D (shard) or 2-D (replicate, shard), got {mesh.ndim}-D")


def device_for(params: list[nn.Parameter], mesh: DeviceMesh | None) -> torch.device:
    """Where a unit's buffers live: its parameters' device, else (all on meta) the mesh's,
    else this rank's default device."""
    real = [p.device for p in params if p.device.type != "meta"]
    if real:
        return real[0]
    if mesh is not None and mesh.device_type != "cpu":
        return torch.device(mesh.device_type, torch.cuda.current_device())
    return default_device()
