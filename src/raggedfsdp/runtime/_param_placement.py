"""How a unit's parameter is placed beside its ragged shard: one object per parameter, chosen once.

Chosen where the unit is built (``fully_shard``'s ``_unit_mesh``), it carries all that differs by
form: :class:`Plain` (a plain tensor), :class:`SubMesh` (a DTensor split by tensor or expert
parallelism over a sibling of the data-parallel mesh), :class:`FullMesh` (FSDP2's full-SPMD-mesh
form, ``_spmd.py``), :class:`DimShard` (FSDP2's ``Shard(dim)``, ``dim > 0``, asked for by
``shard_placement_fn``). The runtime asks its parameter's placement and never branches on the form;
a new form (a pipeline stage's, a tensor subclass's) is a new subclass.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..layout import ShardLayout
from ..planner import Bucket, PlanEntry, ShardPlan
from ..tensor import RaggedTensor, placed_like
from ._mesh import MeshInfo, combined_mesh
from ._spmd import SpmdParam

__all__ = ["DimShard", "FullMesh", "ParamPlacement", "Plain", "SubMesh", "split_placement"]


class ParamPlacement:
    """The form of one parameter of a unit: what the unit shards, where the sharded parameter
    lives, what forward computes with and how its gradient is placed."""

    #: the parameter's split over tensor- or expert-parallel dims (its spec there: mesh,
    #: placements, whole shape); ``None`` when it has none
    split: DTensorSpec | None = None
    #: whether the parameter is a bucket of its own, planned by :meth:`plan` rather than by the
    #: unit's planner with the unit's other parameters
    own_bucket: bool = False

    def local(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor the unit shards, of the parameter as the caller gave it."""
        raise NotImplementedError

    def shard_mesh(self, info: MeshInfo) -> DeviceMesh:
        """The mesh the sharded parameter lives on, the unit's data-parallel mesh being
        ``info.mesh``."""
        raise NotImplementedError

    def sharded(self, view: torch.Tensor, layout: ShardLayout, info: MeshInfo) -> DTensor:
        """The sharded parameter: ``view`` placed by ``layout`` along the data-parallel shard
        dim, on :meth:`shard_mesh`."""
        return self.place(view, layout, info, self.shard_mesh(info))

    def place(
        self, view: torch.Tensor, layout: ShardLayout, info: MeshInfo, mesh: DeviceMesh
    ) -> DTensor:
        """``view`` (this rank's piece, in ``layout``'s local shape) placed by ``layout`` along
        the data-parallel shard dim of ``mesh``, and as the parameter is over its other dims: a
        :class:`~raggedfsdp.tensor.RaggedTensor`, or a DTensor of torch's own placements."""
        raise NotImplementedError

    def piece(self, view: torch.Tensor) -> torch.Tensor:
        """The sharded parameter's local tensor from ``view``, this rank's piece in its
        layout's local shape: ``view`` itself, but where the form sees it otherwise."""
        return view

    def flat(self, local: torch.Tensor) -> torch.Tensor:
        """The sharded parameter's (or gradient's) local tensor ``local`` as this rank's 1-D
        piece of the shard buffer, in the buffer's order (a view where the strides allow)."""
        return local.reshape(-1)

    def placed_grad(self, piece: torch.Tensor, sharded: DTensor) -> DTensor:
        """``piece`` (1-D, this rank's piece of the reduced gradient, in the buffer's order)
        placed as the sharded parameter ``sharded``. No copy."""
        return placed_like(piece, sharded)

    def plan(self, bucket: Bucket, world_size: int) -> ShardPlan:
        """The plan of the parameter's own bucket (only where :attr:`own_bucket`)."""
        raise NotImplementedError

    def unsharded(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The unsharded parameter's first value, empty (the DBuffer binds its data)."""
        raise NotImplementedError

    def bind(self, unsharded: torch.Tensor, view: torch.Tensor) -> None:
        """Make ``view`` the unsharded parameter's values."""
        raise NotImplementedError

    def around(self, local: torch.Tensor) -> torch.Tensor:
        """The unsharded parameter whose tensor the unit gathers is ``local`` (a tensor
        subclass's, built by its ``fsdp_post_all_gather``): ``local`` itself, or placed over the
        parallel dims as the parameter is. Only for the forms that follow FSDP2's protocol."""
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
    ) -> DTensor:
        return RaggedTensor.from_piece(view, layout, mesh, mesh_dim=info.shard_dim)

    def unsharded(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(0, dtype=dtype, device=device)

    def around(self, local: torch.Tensor) -> torch.Tensor:
        return local

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
    ) -> DTensor:
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
        return self.around(torch.empty(0, dtype=dtype, device=device))

    def around(self, local: torch.Tensor) -> torch.Tensor:
        meta = self.split.tensor_meta
        assert meta is not None
        spec = DTensorSpec(
            self.split.mesh, self.split.placements, TensorMeta(meta.shape, meta.stride, local.dtype)
        )
        return DTensor(local, spec, requires_grad=False)

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
    ) -> DTensor:
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


class DimShard(ParamPlacement):
    """A parameter for which ``shard_placement_fn`` asked FSDP2's ``Shard(dim)``, ``dim > 0``:
    split as FSDP2 splits it, evenly as ``torch.chunk`` along ``dim``, so each rank holds FSDP2's
    piece and the parameter reports ``Shard(dim)``.

    The unit shards the tensor with ``dim`` moved first (``inner``'s local tensor,
    ``movedim(dim, 0)``: whole rows along ``dim``), in a bucket of its own whose plan gives rank
    ``r`` the ``r``-th chunk (:meth:`plan`). Its sharded parameter is a DTensor of torch's
    ``Shard(dim)`` whose local tensor is that piece seen with ``dim`` back in place, and its
    unsharded parameter the gathered rows seen the same way: strided views of the buffers, so
    neither collective copies (FSDP2 copies out after the all-gather and in before the
    reduce-scatter instead, and its local tensors are contiguous)."""

    own_bucket = True

    def __init__(self, dim: int, inner: Plain | SubMesh) -> None:
        self.dim = dim
        self.inner = inner
        self.split = inner.split

    def local(self, param: torch.Tensor) -> torch.Tensor:
        return self.inner.local(param).movedim(self.dim, 0)

    def shard_mesh(self, info: MeshInfo) -> DeviceMesh:
        return self.inner.shard_mesh(info)

    def place(
        self, view: torch.Tensor, layout: ShardLayout, info: MeshInfo, mesh: DeviceMesh
    ) -> DTensor:
        placements = [Replicate()] * mesh.ndim
        if self.split is not None:  # the sub-mesh's dims follow the data-parallel ones
            placements[info.mesh.ndim :] = self.split.placements
        placements[info.shard_dim] = Shard(self.dim)
        shape = self.split.shape if self.split is not None else self._whole(layout.global_shape)
        spec = DTensorSpec(
            mesh,
            tuple(placements),
            TensorMeta(torch.Size(shape), _contiguous_strides(shape), view.dtype),
        )
        return DTensor(self.piece(view), spec, requires_grad=False)

    def _whole(self, moved: torch.Size) -> torch.Size:
        """The shape with ``dim`` back in place, from the shape the unit shards."""
        sizes = list(moved[1:])
        sizes.insert(self.dim, moved[0])
        return torch.Size(sizes)

    def piece(self, view: torch.Tensor) -> torch.Tensor:
        return view.movedim(0, self.dim)

    def flat(self, local: torch.Tensor) -> torch.Tensor:
        return local.movedim(self.dim, 0).reshape(-1)

    def placed_grad(self, piece: torch.Tensor, sharded: DTensor) -> DTensor:
        rows = sharded._local_tensor.movedim(self.dim, 0).shape
        return DTensor(self.piece(piece.view(rows)), sharded._spec, requires_grad=False)

    def plan(self, bucket: Bucket, world_size: int) -> ShardPlan:
        """``torch.chunk``'s split of the rows: ``ceil(rows / W)`` each, the last ranks fewer or
        none (FSDP2's and DTensor's ``Shard``), the buffer padded at its end only."""
        ((name, tensor),) = bucket.params.items()
        rows, row = tensor.shape[0], max(math.prod(tensor.shape[1:]), 1)
        shard = -(-rows // world_size) * row
        entry = PlanEntry(name, tuple(tensor.shape), tensor.numel(), 0, row)
        # The split is the caller's: nothing to search, and no smaller shard holds it.
        return ShardPlan(
            world_size,
            shard,
            {name: entry},
            dtype=bucket.plan_dtype,
            lower_bound=shard,
            name=bucket.name,
        )

    def unsharded(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.unsharded(dtype, device)

    def bind(self, unsharded: torch.Tensor, view: torch.Tensor) -> None:
        self.inner.bind(unsharded, view.movedim(0, self.dim))

    def values(self, unsharded: torch.Tensor) -> torch.Tensor:
        return self.inner.values(unsharded).movedim(self.dim, 0)

    def grad(self, view: torch.Tensor, unsharded: torch.Tensor) -> torch.Tensor:
        return self.inner.grad(view.movedim(0, self.dim), unsharded)

    def whole(self, piece: torch.Tensor) -> torch.Tensor:
        return self.inner.whole(piece.movedim(0, self.dim))


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def split_placement(split: DTensorSpec | None) -> Plain | SubMesh:
    """The placement of a parameter split over ``split`` beside the data-parallel dims (a
    sub-mesh DTensor), or of a plain one (``None``)."""
    return Plain() if split is None else SubMesh(split)
