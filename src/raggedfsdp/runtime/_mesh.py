"""The data-parallel mesh a unit is sharded over: its process groups and the device it runs on."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from .._host import default_device
from ..facts import ParallelDims

__all__ = [
    "MeshInfo",
    "combined_mesh",
    "device_for",
    "dim_ranks",
    "mesh_info",
    "mesh_ranks",
    "parallel_spec",
]


@dataclass(frozen=True)
class MeshInfo:
    """The mesh a unit is sharded over and its process groups: ``shard_group`` (all-gather and
    reduce-scatter, the mesh's last dimension) and, for HSDP, ``replicate_group`` (all-reduce of
    the reduced shard, the first). Sharded parameters are DTensors on ``mesh``, ragged along
    ``shard_dim``."""

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    shard_rank: int
    shard_size: int
    replicate_group: dist.ProcessGroup | None = None
    replicate_size: int = 1

    @property
    def shard_dim(self) -> int:
        """The mesh dimension the parameters are ragged along."""
        return self.mesh.ndim - 1

    @property
    def degrees(self) -> ParallelDims:
        """The unit's data-parallel degrees (HSDP's replicas, the shard group's ranks); tensor
        and expert parallelism, where any, are dims of the parameters' own meshes."""
        return ParallelDims(dp_replicate=self.replicate_size, dp_shard=self.shard_size)


def mesh_info(mesh: DeviceMesh | None, device: torch.device) -> MeshInfo:
    """The groups of a 1-D (shard) or 2-D (replicate, shard) mesh -- the whole world, or the
    data-parallel dimensions of a larger mesh (``mesh["dp"]`` beside tensor parallelism), over
    which parameters are then replicated; ``None``: a 1-D mesh of the whole default group on
    ``device``'s type (as FSDP2 makes one)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "raggedfsdp: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group() (also for a single process) before "
            "fully_shard"
        )
    if mesh is None:
        mesh = _world_mesh(device.type)
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"rank {dist.get_rank()} is not in the mesh of shape {tuple(mesh.shape)} it shards "
            f"over; every rank that calls fully_shard must belong to its mesh (a sub-mesh such "
            f"as mesh['dp'] of a larger one is fine)"
        )
    if mesh.ndim == 1:
        return MeshInfo(mesh, mesh.get_group(0), mesh.get_local_rank(0), mesh.size(0))
    if mesh.ndim == 2:  # HSDP: (replicate, shard)
        if mesh.mesh_dim_names is None:
            # FSDP2's type and words: which dim replicates is said by the names
            raise AssertionError(
                "Please init the 2D mesh for HSDP with mesh_dim_names specified (raggedfsdp "
                "reads a 2-D mesh as (replicate, shard): name them, e.g. "
                "mesh_dim_names=('replicate', 'shard'))"
            )
        return MeshInfo(
            mesh,
            mesh.get_group(1),
            mesh.get_local_rank(1),
            mesh.size(1),
            replicate_group=mesh.get_group(0),
            replicate_size=mesh.size(0),
        )
    raise ValueError(
        f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: 1-D (shard) or 2-D "
        f"(replicate, shard); slice a larger mesh to its data-parallel dims (mesh['dp'])"
    )


#: The 1-D mesh of the default group per device type, with the group it was made for (a new
#: default group after destroy_process_group gets a new mesh).
_WORLD_MESHES: dict[str, tuple[dist.ProcessGroup, DeviceMesh]] = {}


def _world_mesh(device_type: str) -> DeviceMesh:
    """One 1-D mesh of the default group per device type, shared by every unit (their
    parameters' meshes are then one object). No process group is made."""
    group = dist.group.WORLD
    assert group is not None
    cached = _WORLD_MESHES.get(device_type)
    if cached is None or cached[0] is not group:
        cached = (group, DeviceMesh.from_group(group, device_type))
        _WORLD_MESHES[device_type] = cached
    return cached[1]


def device_for(params: list[nn.Parameter], mesh: DeviceMesh | None) -> torch.device:
    """Where a unit's buffers live: the mesh's device when a mesh is given (parameters on
    another device are moved there, as FSDP2 moves them), else its parameters' device, else
    (all on meta) this rank's default device."""
    if mesh is not None:
        if mesh.device_type == "cpu":
            return torch.device("cpu")
        handle = getattr(torch, mesh.device_type)
        return torch.device(mesh.device_type, handle.current_device())
    real = [p.device for p in params if p.device.type != "meta"]
    if real:
        return real[0]
    return default_device()


def parallel_spec(fqn: str, param: torch.Tensor, dp_mesh: DeviceMesh) -> DTensorSpec | None:
    """For a parameter that is already a DTensor (tensor or expert parallelism: placed over
    other dims of the mesh whose data-parallel dims ``dp_mesh`` is), its spec; ``None`` for a
    plain parameter. Refused, naming the parameter: a DTensor whose mesh is not a sibling slice
    of ``dp_mesh``'s (named dims, one rank layout, no dim or rank shared: experts placed over
    ``ep`` cannot be sharded over a mesh flattened from ``dp`` and ``ep``), or placed other than
    by ``Shard`` / ``Replicate``."""
    if not isinstance(param, DTensor):
        return None
    mesh = param.device_mesh
    names, dp_names = mesh.mesh_dim_names, dp_mesh.mesh_dim_names
    if names is None or dp_names is None or set(names) & set(dp_names):
        raise ValueError(
            f"parameter {fqn!r} is a DTensor on mesh dims {names}; fully_shard shards it over "
            f"{dp_names}: both must be named slices of one mesh with no dim in common "
            f"(mesh['tp'] for the parameter, mesh['dp'] for fully_shard)"
        )
    _check_no_shared_ranks(fqn, param, dp_mesh)
    try:
        combined_mesh(dp_mesh, mesh)
    except (KeyError, RuntimeError, ValueError) as e:
        raise ValueError(
            f"parameter {fqn!r} is a DTensor on mesh {mesh}, which is not a slice of the mesh "
            f"fully_shard shards over ({dp_names}) nor joins it ({e}); slice both from one "
            f"init_device_mesh, the data-parallel dims first (as in torchtitan's ('dp', 'tp'))"
        ) from e
    for placement in param.placements:
        if type(placement) not in (Shard, Replicate):
            raise ValueError(
                f"parameter {fqn!r} is a DTensor placed {param.placements}: raggedfsdp shards "
                f"DTensor parameters placed by Shard(d) or Replicate() over their mesh"
            )
    return param._spec


def mesh_ranks(mesh: DeviceMesh) -> frozenset[int]:
    """The global ranks of this rank's slice of ``mesh`` (all of it for a root mesh)."""
    return frozenset(int(r) for r in mesh.mesh.flatten().tolist())


def dim_ranks(mesh: DeviceMesh, dim: int) -> frozenset[int]:
    """The global ranks of this rank's group along dimension ``dim`` of ``mesh``."""
    return frozenset(dist.get_process_group_ranks(mesh.get_group(dim)))


def _check_no_shared_ranks(fqn: str, param: DTensor, dp_mesh: DeviceMesh) -> None:
    """A dimension the parameter is placed over must hold none of the data-parallel ranks but
    this one: a mesh flattened from ``dp`` and ``ep`` (the dense parameters' data-parallel mesh
    beside expert parallelism) cannot also shard the experts placed over ``ep``."""
    data = mesh_ranks(dp_mesh)
    mesh = param.device_mesh
    for dim, name in enumerate(mesh.mesh_dim_names or ()):
        shared = dim_ranks(mesh, dim) & data
        if len(shared) > 1:
            raise ValueError(
                f"parameter {fqn!r} is placed {param.placements} over mesh dim {name!r}, whose "
                f"ranks {sorted(shared)} are also data-parallel ranks of the mesh fully_shard "
                f"shards it over ({dp_mesh.mesh_dim_names}): shard it over the data-parallel "
                f"dims that remain (experts placed over mesh['ep']: fully_shard(experts, "
                f"mesh=mesh['dp']), not over a mesh flattened from dp and ep)"
            )


def combined_mesh(dp_mesh: DeviceMesh, other: DeviceMesh) -> DeviceMesh:
    """The mesh of ``dp_mesh``'s dims followed by ``other``'s: where a tensor- or expert-parallel
    parameter's shards live once sharded over the data-parallel dims too. Joined as FSDP2 joins
    them (``DeviceMesh._concatenate``: any slices of one rank layout, flattened dims too, even
    when torch hands a DTensor an equal mesh sliced from another root); on a torch without it,
    sliced from the root mesh by name."""
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is not None:
        return concatenate([dp_mesh, other])
    names = (*(dp_mesh.mesh_dim_names or ()), *(other.mesh_dim_names or ()))
    return dp_mesh._get_root_mesh()[names]
