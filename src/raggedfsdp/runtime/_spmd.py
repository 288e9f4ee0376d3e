"""FSDP2's full-SPMD-mesh form: ``fully_shard(module, mesh=mesh, dp_mesh_dims=...)``.

``mesh`` is the job's whole mesh, every parameter already a DTensor on it (``Replicate()`` over the
data-parallel dims ``dp_mesh_dims`` names), and the unit is what the sub-mesh form makes of it,
except that forward's parameters and their gradients are DTensors on the whole mesh (the comment at
:class:`SpmdParam` says how the gradient is relabelled, and why). Only the layout torchtitan and
FSDP2's examples use is taken: the data-parallel dims lead the mesh, replicate before shard;
anything else is one clear error before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from ._mesh import combined_mesh

try:  # FSDP2's own where torch has it, so one object serves both fully_shards
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:  # pragma: no cover - depends on the torch installed

    @dataclass
    class DataParallelMeshDims:  # type: ignore[no-redef]
        """The data-parallel dims of a full SPMD mesh (FSDP2's class, for older torches):
        ``shard`` the dim name(s) fully_shard shards over (several are flattened into one),
        ``replicate`` those HSDP replicates over."""

        shard: str | tuple[str, ...] | None = None
        replicate: str | tuple[str, ...] | None = None

        def __post_init__(self) -> None:
            if self.shard is None and self.replicate is None:
                raise ValueError(
                    "At least one of shard or replicate must be set in DataParallelMeshDims"
                )


__all__ = ["DataParallelMeshDims", "SpmdMesh", "SpmdParam", "spmd_mesh", "spmd_param"]


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class SpmdMesh:
    """A unit's full SPMD mesh: ``mesh`` as the caller passed it, whose leading dims are the
    data-parallel ones ``dp_mesh_dims`` names: ``replicate`` (HSDP's, possibly none), then
    ``shard``."""

    mesh: DeviceMesh
    replicate: tuple[str, ...]
    shard: tuple[str, ...]

    @property
    def dp_dims(self) -> int:
        """How many leading dims of the mesh are data-parallel."""
        return len(self.replicate) + len(self.shard)

    @property
    def other_names(self) -> tuple[str, ...]:
        """The dims tensor or expert parallelism splits the parameters over."""
        assert self.mesh.mesh_dim_names is not None
        return self.mesh.mesh_dim_names[self.dp_dims :]

    def data_parallel_mesh(self) -> DeviceMesh:
        """The data-parallel dims as the unit shards over them (1-D, or HSDP's (replicate,
        shard)), each flattened from several where ``dp_mesh_dims`` names several, as FSDP2
        flattens them: a process group per flattened dim, made once per mesh, so called only
        once the unit's parameters are checked."""
        shard_mesh = _flattened(self.mesh, self.shard)
        if not self.replicate:
            return shard_mesh
        return combined_mesh(_flattened(self.mesh, self.replicate), shard_mesh)


def spmd_mesh(mesh: DeviceMesh | None, dp_mesh_dims: object) -> SpmdMesh:
    """Check ``dp_mesh_dims`` against ``mesh`` (no process group is made)."""
    if mesh is None:
        raise ValueError("fully_shard: dp_mesh_dims needs mesh=, the full SPMD mesh it names")
    if not (hasattr(dp_mesh_dims, "shard") and hasattr(dp_mesh_dims, "replicate")):
        raise TypeError(
            f"fully_shard: dp_mesh_dims must be a DataParallelMeshDims(shard=..., replicate=...) "
            f"naming mesh dims, got {type(dp_mesh_dims).__name__} {dp_mesh_dims!r}"
        )
    shard = _names(dp_mesh_dims.shard)  # type: ignore[attr-defined]
    replicate = _names(dp_mesh_dims.replicate)  # type: ignore[attr-defined]
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            "fully_shard: dp_mesh_dims names mesh dims, but the mesh has no dim names; build "
            "it with init_device_mesh(..., mesh_dim_names=...)"
        )
    unknown = [n for n in (*replicate, *shard) if n not in names]
    if not shard and not replicate:
        raise ValueError(f"fully_shard: dp_mesh_dims={dp_mesh_dims!r} names no dims")
    if unknown:
        raise ValueError(f"fully_shard: dp_mesh_dims names {unknown}, not dims of the mesh {names}")
    if len({*replicate, *shard}) < len(replicate) + len(shard):
        raise ValueError(f"fully_shard: dp_mesh_dims={dp_mesh_dims!r} names a dim twice")
    if not shard:
        raise NotImplementedError(
            f"fully_shard: dp_mesh_dims with replicate={replicate} and no shard dims (FSDP2's "
            f"replication without sharding) is not supported; name at least one shard dim"
        )
    if names[: len(replicate) + len(shard)] != (*replicate, *shard):
        raise NotImplementedError(
            f"fully_shard: the data-parallel dims must lead the mesh, replicate dims before shard "
            f"dims (as torchtitan lays them out), e.g. {(*replicate, *shard)} first; the mesh's "
            f"dims are {names}"
        )
    return SpmdMesh(mesh, replicate, shard)


def _flattened(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))


# Here ``mesh`` is the whole mesh of the job (``("dp", "tp")``, ``("dp_replicate", "dp_shard",
# "tp")``), every parameter is already a DTensor on it -- ``Replicate()`` over the data-parallel
# dims, split by tensor or expert parallelism over the others -- and ``dp_mesh_dims`` names the
# data-parallel dims (FSDP2's :class:`DataParallelMeshDims`, which torch 2.13 has; on an older
# torch, this module's equivalent). The unit is then what the sub-mesh form makes of it
# (``mesh=mesh["dp"]`` over parameters on ``mesh["tp"]``): the ragged shard is cut from each
# parameter's local tensor over the data-parallel dims (several shard dims flattened into one, as
# FSDP2 flattens them), and the placements over the other dims are kept. Two things differ, both
# because the caller's program is written against the whole mesh:
#
# - the unsharded parameter forward computes with is a DTensor on the whole mesh (``Replicate()``
#   over the data-parallel dims), and the sharded one lives on that very mesh object when no dims
#   were flattened;
# - its gradient arrives as a DTensor on the whole mesh, ``Partial`` over the data-parallel dims
#   when the batch is sharded over them (``Replicate()`` when the caller's program says each rank
#   holds the same value). Either way each rank's local tensor is its contribution, summed and
#   divided by the reduce-scatter (the mean over data-parallel ranks, as FSDP2 makes it), so the
#   gradient is relabelled ``Partial`` over those dims before autograd accumulates it: letting
#   DTensor add a ``Partial`` gradient into a ``Replicate`` one would all-reduce it over the
#   data-parallel dims first, and the reduce-scatter would then count it ``dp`` times. Over the
#   other dims it is redistributed to the parameter's placements (a sequence-parallel norm's
#   ``Partial`` gradient is all-reduced over tp), as FSDP2 does.
@dataclass(frozen=True)
class SpmdParam:
    """One parameter of a unit sharded by the full-mesh form: its DTensor spec on the whole mesh
    (its unsharded form's, ``Replicate()`` over the first ``dp_dims`` dims)."""

    fqn: str
    spec: DTensorSpec
    dp_dims: int

    def unsharded_spec(self, dtype: torch.dtype) -> DTensorSpec:
        """The unsharded parameter's spec, in the dtype it is gathered in."""
        return self._spec(self.spec.placements, dtype)

    def grad_spec(self, dtype: torch.dtype) -> DTensorSpec:
        """The unsharded gradient's: ``Partial`` over the data-parallel dims (each rank's local
        tensor its contribution, which the reduce-scatter sums)."""
        dp = (Partial(),) * self.dp_dims
        return self._spec((*dp, *self.spec.placements[self.dp_dims :]), dtype)

    def _spec(self, placements: tuple[Placement, ...], dtype: torch.dtype) -> DTensorSpec:
        meta = self.spec.tensor_meta
        assert meta is not None
        return DTensorSpec(self.spec.mesh, placements, TensorMeta(meta.shape, meta.stride, dtype))

    def callers_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """``mesh`` (the data-parallel dims, then the others: where the sub-mesh form places
        the sharded parameter) as the caller's own mesh object when its dims are the same;
        with flattened dims as it is, as FSDP2 places it."""
        return self.spec.mesh if mesh.mesh_dim_names == self.spec.mesh.mesh_dim_names else mesh

    def relabel_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` as autograd should accumulate it (see the module's docstring): placed as the
        parameter over the other dims, its local tensor ``Partial`` over the data-parallel ones.
        A gradient split over a data-parallel dim is refused: gathering it here, in one
        parameter's hook, would be a collective data-parallel peers running other graphs might
        never join (FSDP2 takes its local tensor as it is)."""
        if not isinstance(grad, DTensor):
            raise TypeError(
                f"fully_shard(dp_mesh_dims=...): the gradient of {self.fqn!r} arrived as a "
                f"{type(grad).__name__}, not a DTensor on the mesh it computed on"
            )
        split = [
            p for p in grad.placements[: self.dp_dims] if not isinstance(p, (Partial, Replicate))
        ]
        if split:
            raise RuntimeError(
                f"fully_shard(dp_mesh_dims=...): the gradient of {self.fqn!r} arrived placed "
                f"{grad.placements}, split over a data-parallel dim; its parameter is "
                f"Replicate() there, so its gradient must be Partial() or Replicate()"
            )
        placements = self.spec.placements
        target = (*grad.placements[: self.dp_dims], *placements[self.dp_dims :])
        if target != grad.placements:
            grad = grad.redistribute(placements=target)
        return DTensor(grad._local_tensor, self.grad_spec(grad.dtype), requires_grad=False)


def spmd_param(
    fqn: str, param: torch.Tensor, spmd: SpmdMesh
) -> tuple[SpmdParam, DTensorSpec | None]:
    """A parameter of the full-mesh form, checked (FSDP2's words where it has them), and its
    split over the other dims as the sub-mesh form takes it (``None`` when the mesh has only
    data-parallel dims)."""
    if not isinstance(param, DTensor):
        raise ValueError(
            "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD "
            f"mesh (e.g. via distribute_module). Got plain tensor for parameter '{fqn}'."
        )
    # Equal suffices (FSDP2 asks for the same object): the unsharded form is placed on the
    # parameter's mesh, the split over the other dims sliced from the caller's; both describe
    # the same ranks and groups.
    if param.device_mesh != spmd.mesh:
        raise ValueError(
            f"parameter {fqn!r} is a DTensor on mesh {param.device_mesh}, not the mesh passed to "
            f"fully_shard with dp_mesh_dims ({spmd.mesh})"
        )
    names = spmd.mesh.mesh_dim_names
    assert names is not None
    for dim, placement in enumerate(param.placements):
        if dim < spmd.dp_dims and not isinstance(placement, Replicate):
            raise ValueError(
                f"Expected Replicate() on DP dim '{names[dim]}' (index {dim}) but got "
                f"{placement} for parameter {fqn!r}"
            )
        if type(placement) not in (Shard, Replicate):
            raise ValueError(
                f"parameter {fqn!r} is a DTensor placed {param.placements}, {placement} over "
                f"mesh dim {names[dim]!r}: raggedfsdp shards DTensor parameters placed by "
                f"Shard(d) or Replicate() over their mesh"
            )
    whole = SpmdParam(fqn, param._spec, spmd.dp_dims)
    if not spmd.other_names:
        return whole, None
    other = spmd.mesh[spmd.other_names]
    placements = param.placements[spmd.dp_dims :]
    return whole, DTensorSpec(other, tuple(placements), tensor_meta=param._spec.tensor_meta)
