"""How a unit's parameter is placed beside its ragged shard: one object per parameter, chosen once.

Chosen where the unit is built (``fully_shard``'s ``_unit_mesh``), it carries all that differs by
form: :class:`Plain` (a plain tensor), :class:`SubMesh` (a DTensor split by tensor or expert
parallelism over a sibling of the data-parallel mesh), :class:`FullMesh` (FSDP2's full-SPMD-mesh
form, ``_spmd.py``). The runtime asks its parameter's placement and never branches on the form; a
new form (a pipeline stage's, a tensor subclass's) is a new subclass.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..layout import ShardLayout
from ..tensor import RaggedTensor
from ._mesh import MeshInfo, combined_mesh
from ._spmd import SpmdParam

__all__ = ["FullMesh", "ParamPlacement", "Plain", "SubMesh", "split_placement"]


class ParamPlacement:
    """The form of one parameter of a unit: what the unit shards, where the sharded parameter
    lives, what forward computes with and how its gradient is placed."""

    #: the parameter's split over tensor- or expert-parallel dims (its spec there: mesh,
    #: placements, whole shape); ``None`` when it has none
    split: DTensorSpec | None = None

    def local(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor the unit shards, of the parameter as the caller gave it."""
        raise NotImplementedError

    def shard_mesh(self, info: MeshInfo) -> DeviceMesh:
        """The mesh the sharded parameter lives on, the unit's data-parallel mesh being
        ``info.mesh``."""
        raise NotImplementedError

    def sharded(self, view: torch.Tensor, layout: ShardLayout, info: MeshInfo) -> RaggedTensor:
        """The sharded parameter: ``view`` placed by ``layout`` along the data-parallel shard
        dim, on :meth:`shard_mesh`."""
        return self.place(view, layout, info, self.shard_mesh(info))

    def place(
        self, view: torch.Tensor, layout: ShardLayout, info: MeshInfo, mesh: DeviceMesh
    ) -> RaggedTensor:
        """``view`` placed by ``layout`` along the data-parallel shard dim of ``mesh``, and as
        the parameter is over its other dims."""
        raise NotImplementedError

    def unsharded(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The unsharded parameter's first value, empty (the DBuffer binds its data)."""
        raise NotImplementedError

    def bind(self, unsharded: torch.Tensor, view: torch.Tensor) -> None:
        """Make ``view`` the unsharded parameter's values."""
        raise NotImplementedError

    def values(self, unsharded: torch.Tensor) -> torch.Tensor:
        """The unsharded parameter's values, as ``.data``: a copy into them bumps no version
        counter."""
        raise NotImplementedError

    def grad(self, view: torch.Tensor, unsharded: torch.Tensor) -> torch.Tensor:
        """The unsharded gradient, whose values are ``view``, as autograd accumulates into it."""
        raise NotImplementedError

    def arm(self, unsharded: nn.Parameter) -> None:
        """Register what the unsharded parameter's gradient needs before autograd accumulates it
        (nothing, but in the full-mesh form)."""

    def whole(self, piece: torch.Tensor) -> torch.Tensor:
        """The whole parameter, from the whole tensor the unit shards (``piece``): itself, or
        gathered over the parallel dims (a collective over them)."""
        raise NotImplementedError


class Plain(ParamPlacement):
    """A plain tensor parameter."""

    def local(self, param: torch.Tensor) -> torch.Tensor:
        return param

    def shard_mesh(self, info: MeshInfo) -> DeviceMesh:
        return info.mesh

    def place(
        self, view: torch.Tensor, layout: ShardLayout, info: MeshInfo, mesh: DeviceMesh
    ) -> RaggedTensor:
        return RaggedTensor.from_piece(view, layout, mesh, mesh_dim=info.shard_dim)

    def unsharded(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(0, dtype=dtype, device=device)

    def bind(self, unsharded: torch.Tensor, view: torch.Tensor) -> None:
        unsharded.data = view

    def values(self, unsharded: torch.Tensor) -> torch.Tensor:
        return unsharded.data

    def grad(self, view: torch.Tensor, unsharded: torch.Tensor) -> torch.Tensor:
        return view

    def whole(self, piece: torch.Tensor) -> torch.Tensor:
        return piece


class _Distributed(ParamPlacement):
    """A DTensor parameter: the unit shards its local tensor, forward computes with a DTensor."""

    def local(self, param: torch.Tensor) -> torch.Tensor:
        assert isinstance(param, DTensor)
        return param.to_local()

    def bind(self, unsharded: torch.Tensor, view: torch.Tensor) -> None:
        # Through ``.data``, as a plain parameter: the local tensor keeps its own version counter,
        # so the all-gather that refills the buffer in backward does not make stale the views
        # forward took of it (``to_local()``, as expert-parallel experts read their weights);
        # FSDP2 preserves the counter for the same reason.
        unsharded._local_tensor.data = view  # type: ignore[attr-defined]

    def values(self, unsharded: torch.Tensor) -> torch.Tensor:
        return unsharded._local_tensor.data  # type: ignore[attr-defined]


class SubMesh(_Distributed):
    """A DTensor parameter split over ``split.mesh``, a sibling of the unit's data-parallel
    mesh (``mesh["tp"]`` beside ``mesh["dp"]``)."""

    def __init__(self, split: DTensorSpec) -> None:
        self.split = split

    def shard_mesh(self, info: MeshInfo) -> DeviceMesh:
        return combined_mesh(info.mesh, self.split.mesh)

    def place(
        self, view: torch.Tensor, layout: ShardLayout, info: MeshInfo, mesh: DeviceMesh
    ) -> RaggedTensor:
        split = self.split
        return RaggedTensor.from_piece(
            view,
            layout,
            mesh,
            mesh_dim=info.shard_dim,
            placements=(Replicate(),) * info.mesh.ndim + tuple(split.placements),
            shape=split.shape,
        )

    def unsharded(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        meta = self.split.tensor_meta
        assert meta is not None
        spec = DTensorSpec(
            self.split.mesh, self.split.placements, TensorMeta(meta.shape, meta.stride, dtype)
        )
        return DTensor(torch.empty(0, dtype=dtype, device=device), spec, requires_grad=False)

    def grad(self, view: torch.Tensor, unsharded: torch.Tensor) -> torch.Tensor:
        return DTensor(view, unsharded._spec, requires_grad=False)  # type: ignore[attr-defined]

    def whole(self, piece: torch.Tensor) -> torch.Tensor:
        meta = self.split.tensor_meta
        assert meta is not None
        return DTensor.from_local(
            piece,
            self.split.mesh,
            self.split.placements,
            run_check=False,
            shape=meta.shape,
            stride=meta.stride,
        ).full_tensor()


class FullMesh(_Distributed):
    """A DTensor parameter on the caller's whole mesh under ``dp_mesh_dims``: sharded as
    ``inner`` (its split over the other dims, or none) shards it, on the caller's mesh object
    where no data-parallel dims were flattened; forward computes with it on the whole mesh."""

    def __init__(self, spmd: SpmdParam, inner: Plain | SubMesh) -> None:
        self.spmd = spmd
        self.inner = inner
        self.split = inner.split

    def shard_mesh(self, info: MeshInfo) -> DeviceMesh:
        return self.spmd.callers_mesh(self.inner.shard_mesh(info))

    def place(
        self, view: torch.Tensor, layout: ShardLayout, info: MeshInfo, mesh: DeviceMesh
    ) -> RaggedTensor:
        return self.inner.place(view, layout, info, mesh)

    def unsharded(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        empty = torch.empty(0, dtype=dtype, device=device)
        return DTensor(empty, self.spmd.unsharded_spec(dtype), requires_grad=False)

    def grad(self, view: torch.Tensor, unsharded: torch.Tensor) -> torch.Tensor:
        return DTensor(view, self.spmd.grad_spec(view.dtype), requires_grad=False)

    def arm(self, unsharded: nn.Parameter) -> None:
        unsharded.register_hook(self.spmd.relabel_grad)

    def whole(self, piece: torch.Tensor) -> torch.Tensor:
        return self.inner.whole(piece)


def split_placement(split: DTensorSpec | None) -> Plain | SubMesh:
    """The placement of a parameter split over ``split`` beside the data-parallel dims (a
    sub-mesh DTensor), or of a plain one (``None``)."""
    return Plain() if split is None else SubMesh(split)
