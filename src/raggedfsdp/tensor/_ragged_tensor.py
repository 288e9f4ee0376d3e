"""Sharded tensors as DTensors: :class:`RaggedTensor`.

A rank's piece of a ragged shard is a run of whole units of the row-major flattening, which no torch
placement describes, so a sharded tensor is a DTensor of its own class that runs the ops sharded
parameters meet on its local piece and refuses the rest; also its DCP checkpointable form,
``full_tensor``, and the makers. Why, and what it runs: [Note: ragged shards as DTensors] at
:class:`RaggedTensor`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from ..layout import ShardLayout
from ._ops import (
    handler,
    mesh_device,
    outer_box,
    outer_placements,
    piece_of,
    spec_dim,
    strides,
    wrap,
)
from ._placement import RaggedShardPlacement

__all__ = [
    "RaggedTensor",
    "distribute",
    "gather_full",
    "local_flat",
    "placed_like",
    "to_ragged_tensor",
]

_aten = torch.ops.aten


# [Note: ragged shards as DTensors] The ecosystem recognises FSDP's sharded parameters by their
# type: torchtitan, Lightning, accelerate, DCP and DSD ask ``isinstance(p, DTensor)`` and then read
# ``p.placements``, ``p.device_mesh``, ``p.to_local()`` or ``p.full_tensor()``. A rank's piece of a
# ragged shard is a contiguous run of whole units of the row-major flattening, which no torch
# placement describes, so a sharded tensor here is a DTensor of its own class,
# :class:`RaggedTensor`, whose placement on the data-parallel mesh dimension is a
# :class:`~raggedfsdp.tensor.RaggedShardPlacement` (the tensor's
# :class:`~raggedfsdp.layout.ShardLayout`; ``Replicate()`` on HSDP's replica dimension). Its local
# tensor is this rank's piece (N-D when it is whole rows, else 1-D); a sharded parameter's is a view
# of its bucket's shard buffer, so what the optimizer updates in place is what the next all-gather
# sends.
#
# Why a subclass that runs ops itself, rather than DTensor's sharding propagation with a new
# placement: DTensor's propagation builds the output placements from its own rules (a pointwise op
# of ``Shard(0)`` inputs yields a new ``Shard(0)``), so a placement it does not know would be
# dropped or misread, and its op strategies are private tables that change with every release (torch
# 2.13 moved dispatch to C++). What sharded parameters meet is small and known: optimizers
# (pointwise, ``_foreach_*`` and ``_fused_*`` ops, ``*_like``), norms (gradient clipping),
# initialisation (random fills, pointwise math), copies (checkpoint loads) and DCP.
# :meth:`RaggedTensor.__torch_dispatch__` runs those on the local pieces and wraps the results with
# the same placement -- no collective, one Python call per op (per list for ``_foreach_*``) -- and
# turns full reductions into standard DTensors with ``Partial`` placements, so that torch's own
# ``clip_grad_norm_`` reduces them as it does FSDP2's. Anything else is refused with an error that
# names the op: nothing is ever computed on a piece as if it were the whole tensor (Newton-Schulz on
# a range of rows, say).
#
# Random fills (``uniform_``, ``normal_``, ... as ``nn.init`` and ``reset_parameters()`` call them)
# draw the whole tensor on every rank and keep this rank's piece, so a model initialised after
# sharding holds exactly what one process initialising it with the same seed would hold, at any
# world size and with any plan. That costs one whole parameter of memory and of generator work per
# fill, once, at initialisation.
#
# For DCP a RaggedTensor is its own ``_Checkpointable``: :meth:`ShardLayout.boxes` cuts the piece
# into at most ``2*ndim-1`` rectangles, one write item each, views of the piece, so saving copies
# nothing and ``dcp.load`` writes straight into the parameter. DCP's metadata holds the global shape
# and these chunks, so a checkpoint reshards across world sizes and plans and loads into FSDP2 or
# one process.
#
# ``full_tensor`` is one list-form ``all_gather`` of the pieces padded to the largest: every backend
# has it, and a whole tensor is no hot path, so no runtime collective is needed (nor imported).
class RaggedTensor(DTensor):
    """A DTensor whose placement on one mesh dimension is a
    :class:`~raggedfsdp.tensor.RaggedShardPlacement` (and ``Replicate()`` on the others).

    Its shape, dtype and ``placements`` are the whole tensor's; ``to_local()`` is this rank's
    piece. See [Note: ragged shards as DTensors] for the operations it takes."""

    @staticmethod
    def __new__(
        cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool
    ) -> RaggedTensor:
        # Made as a plain wrapper of the global shape at storage offset 0 (DTensor's own
        # constructor copies the local tensor's offset, and a wrapper with a non-zero data
        # pointer but no storage breaks DCP's async staging, which copies the storage of any
        # tensor whose data pointer is not null).
        meta = spec.tensor_meta
        assert meta is not None
        value = torch.Tensor._make_wrapper_subclass(
            cls,
            meta.shape,
            strides=meta.stride,
            storage_offset=0,
            dtype=local_tensor.dtype,
            device=local_tensor.device,
            layout=local_tensor.layout,
            requires_grad=requires_grad,
        )
        value._spec = spec
        value._local_tensor = local_tensor
        return value

    @classmethod
    def from_piece(
        cls,
        piece: torch.Tensor,
        layout: ShardLayout,
        mesh: DeviceMesh,
        *,
        mesh_dim: int = -1,
        placements: Sequence[Placement] | None = None,
        shape: Sequence[int] | None = None,
        requires_grad: bool = False,
    ) -> RaggedTensor:
        """This rank's ``piece`` of a tensor placed by ``layout`` along ``mesh_dim``. Along the
        mesh's other dimensions it is placed by ``placements`` (default: ``Replicate()``; the
        entry at ``mesh_dim`` is ignored): with tensor or expert parallelism, ``layout`` cuts
        the local tensor those placements leave, and ``shape`` is the whole tensor's (default:
        ``layout``'s). No copy: the local tensor is ``piece`` itself."""
        dim = mesh_dim % mesh.ndim
        rank = mesh.get_local_rank(dim)
        if piece.numel() != layout.local_numel(rank):
            raise ValueError(
                f"rank {rank}'s piece of a tensor of shape {list(layout.global_shape)} has "
                f"{layout.local_numel(rank)} elements, got {piece.numel()}"
            )
        spec = _spec(layout, mesh, dim, placements, shape, piece.dtype)
        return cls(piece, spec, requires_grad=requires_grad)

    # -- what it is ------------------------------------------------------------------------------

    @property
    def shard_layout(self) -> ShardLayout:
        """The :class:`~raggedfsdp.layout.ShardLayout` of the ragged placement."""
        placement = self._spec.placements[spec_dim(self._spec)]
        assert isinstance(placement, RaggedShardPlacement)
        return placement.layout

    @property
    def shard_mesh_dim(self) -> int:
        """The mesh dimension the ragged placement is along."""
        return spec_dim(self._spec)

    @property
    def shard_rank(self) -> int:
        """This process's rank along the ragged mesh dimension."""
        return self._spec.mesh.get_local_rank(self.shard_mesh_dim)

    @property
    def shard_group(self) -> dist.ProcessGroup:
        """The process group of the ragged mesh dimension."""
        return self._spec.mesh.get_group(self.shard_mesh_dim)

    def placed_as(self, layout: ShardLayout) -> bool:
        """Whether this is placed by ``layout`` (the same ranges, hence the same pieces)."""
        return self.shard_layout == layout

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"RaggedTensor(local_tensor={self._local_tensor}, device_mesh={self.device_mesh}, "
            f"placements={self.placements})"
        )

    # -- conversions -----------------------------------------------------------------------------

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole tensor on every rank: a collective over the ragged mesh dimension (one
        all-gather of the pieces, padded to the largest), then, under tensor or expert
        parallelism, DTensor's own over the other dimensions."""
        local = _gather(self._local_tensor, self.shard_layout, self.shard_group)
        outer = outer_placements(self._spec)
        if all(p.is_replicate() for p in outer):
            return local
        return DTensor.from_local(
            local, self.device_mesh, outer, run_check=False, shape=self.shape, stride=self.stride()
        ).full_tensor()

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        **kwargs: Any,
    ) -> DTensor:
        """To ``Replicate()`` on every mesh dimension (what DSD and frameworks ask: the whole
        tensor, a collective), or to its own placements (itself). A ragged piece is not one
        chunk of any other placement, so other targets are refused."""
        mesh = device_mesh or self.device_mesh
        targets = tuple(placements) if placements is not None else self.placements
        if mesh == self.device_mesh and targets == self.placements:
            return self
        if mesh == self.device_mesh and all(isinstance(p, Replicate) for p in targets):
            return DTensor.from_local(self.full_tensor(), mesh, targets, run_check=False)
        raise NotImplementedError(
            f"raggedfsdp: redistributing a sharded tensor placed {self.placements} to "
            f"{targets}: only Replicate() (the whole tensor, also .full_tensor()) is supported; "
            f".to_local() is this rank's piece"
        )

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's piece (a view of the parameter's shard when it is one)."""
        if not torch.is_grad_enabled() or not self.requires_grad:
            return self._local_tensor
        return _ToLocal.apply(self)

    # -- dispatch --------------------------------------------------------------------------------

    @classmethod
    def __torch_dispatch__(
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        run = handler(func)
        if run is None:
            raise NotImplementedError(
                f"raggedfsdp: {func} is not supported on a sharded tensor (a RaggedTensor: this "
                f"rank holds a ragged range of its elements, so a view of it or a write through "
                f"one cannot be the whole tensor's); use .to_local() for this rank's piece or "
                f".full_tensor() for the whole tensor"
            )
        return run(cls, func, args, kwargs or {})

    # -- DCP (_Checkpointable) -------------------------------------------------------------------

    def _rectangles(self) -> list[tuple[torch.Size, torch.Tensor]]:
        """``(global offsets, view of the piece)`` of every rectangle of this rank's piece."""
        layout, rank = self.shard_layout, self.shard_rank
        piece = self._local_tensor.reshape(-1)
        steps = strides(tuple(layout.global_shape))
        start = layout.ranges[rank][0]
        _, outer = outer_box(self._spec)  # where the outer-local tensor lies in the whole
        out = []
        for offsets, sizes in layout.boxes(rank):
            begin = sum(o * s for o, s in zip(offsets, steps, strict=True)) - start
            place = torch.Size(o + p for o, p in zip(offsets, outer, strict=True))
            out.append((place, piece[begin : begin + math.prod(sizes)].view(sizes)))
        return out

    def __create_write_items__(self, fqn: str, object: object) -> list[WriteItem]:
        """One DCP write item per rectangle of this rank (none when the piece is empty)."""
        # The properties of the full tensor, as a one-process save writes them: torch >= 2.15
        # records strides, the contiguous ones here (as FSDP2's dim-0 shards have).
        properties = TensorProperties.create_from_tensor(
            torch.empty(self.shape, dtype=self.dtype, device="meta")
        )
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=view.shape),
                    properties=properties,
                    size=self.shape,
                ),
            )
            for offsets, view in self._rectangles()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """The rectangles of this rank, for DCP's read plan."""
        return [ChunkStorageMetadata(offsets=o, sizes=v.shape) for o, v in self._rectangles()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The rectangle at ``index.offset``: a view of the piece (DCP reads from it on save and
        writes into it on load)."""
        for offsets, view in self._rectangles():
            if offsets == index.offset:
                return view
        raise ValueError(f"{index.fqn!r} has no rectangle at offsets {index.offset} on this rank")


class _ToLocal(torch.autograd.Function):
    """``to_local()`` under autograd: the gradient of the piece is placed like the tensor."""

    @staticmethod
    def forward(ctx: Any, value: RaggedTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.spec = value._spec
        local = value._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> RaggedTensor:  # type: ignore[override]
        return wrap(RaggedTensor, grad, ctx.spec)


def _gather(piece: torch.Tensor, layout: ShardLayout, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole tensor from every rank's piece: one all-gather, padded to the largest."""
    flat = piece.reshape(-1)
    world = layout.world_size
    width = max(layout.local_numel(r) for r in range(world))
    padded = flat.new_zeros(width)
    padded[: flat.numel()] = flat
    slots = [flat.new_empty(width) for _ in range(world)]
    dist.all_gather(slots, padded, group=group)
    return layout.from_locals([slots[r][: layout.local_numel(r)] for r in range(world)])


def to_ragged_tensor(piece: torch.Tensor, layout: ShardLayout, like: RaggedTensor) -> RaggedTensor:
    """``piece`` (this rank's piece of a ``layout``-placed tensor, any shape with its number of
    elements) as a RaggedTensor placed over the ranks ``like`` is sharded over: optimizer state
    of a sharded parameter ``like``, whose layout may differ from the parameter's. No copy."""
    dim = like.shard_mesh_dim
    others = [p for d, p in enumerate(like.placements) if d != dim and not p.is_replicate()]
    if not others:
        return RaggedTensor.from_piece(piece, layout, like.device_mesh, mesh_dim=dim)
    # Split by tensor or expert parallelism as well: an entry of the parameter's shape is
    # placed as the parameter is, so that DCP writes each tp rank's slice at its offsets.
    if layout.global_shape != like.shard_layout.global_shape:
        raise ValueError(
            f"optimizer state of shape {list(layout.global_shape)} for a parameter of shape "
            f"{list(like.shape)} split by {tuple(like.placements)}: state shaped unlike "
            f"the parameter cannot be placed beside tensor or expert parallelism"
        )
    return RaggedTensor.from_piece(
        piece,
        layout,
        like.device_mesh,
        mesh_dim=dim,
        placements=like.placements,
        shape=like.shape,
    )


def distribute(
    tensor: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    src_data_rank: int | None = 0,
) -> RaggedTensor:
    """``torch.distributed.tensor.distribute_tensor`` for a ragged placement: the whole
    ``tensor`` of the rank ``src_data_rank`` of each mesh dimension (``None``: each rank's own,
    no communication), and this rank's piece of it kept. What DSD's full-state loads and
    accelerate's ``cpu_ram_efficient_loading`` call (torch's is routed here, ``_adapt.py``)."""
    dims = [d for d, p in enumerate(placements) if isinstance(p, RaggedShardPlacement)]
    if len(dims) != 1:
        raise NotImplementedError(
            f"raggedfsdp: distributing a tensor to {tuple(placements)}: one ragged placement"
        )
    placement = placements[dims[0]]
    assert isinstance(placement, RaggedShardPlacement)
    whole = tensor.detach().to(mesh_device(mesh)).contiguous()
    if src_data_rank is not None:
        for dim in range(mesh.ndim):
            group = mesh.get_group(dim)
            dist.broadcast(whole, dist.get_global_rank(group, src_data_rank), group=group)
    spec = _spec(placement.layout, mesh, dims[0], placements, whole.shape, whole.dtype)
    return RaggedTensor(piece_of(whole, spec).clone(), spec, requires_grad=tensor.requires_grad)


def _spec(
    layout: ShardLayout,
    mesh: DeviceMesh,
    dim: int,
    placements: Sequence[Placement] | None,
    shape: Sequence[int] | None,
    dtype: torch.dtype,
) -> DTensorSpec:
    """The spec of a tensor placed by ``layout`` along mesh dimension ``dim`` and by
    ``placements`` (default ``Replicate()``) along the others, of global ``shape`` (default:
    ``layout``'s)."""
    given = tuple(placements) if placements is not None else (Replicate(),) * mesh.ndim
    full = tuple(RaggedShardPlacement(layout) if d == dim else given[d] for d in range(mesh.ndim))
    size = torch.Size(shape if shape is not None else layout.global_shape)
    return DTensorSpec(mesh, full, TensorMeta(size, strides(size), dtype))


def placed_like(piece: torch.Tensor, like: DTensor) -> RaggedTensor:
    """``piece`` (this rank's piece, any shape with its number of elements) placed as ``like``,
    a sharded tensor of the same global shape (a gradient of a sharded parameter). No copy."""
    local = like._local_tensor
    if piece.numel() != local.numel():
        raise ValueError(
            f"a piece of {piece.numel()} elements cannot be placed like one of {local.numel()}"
        )
    return wrap(RaggedTensor, piece.view(local.shape), like._spec)


def local_flat(value: DTensor) -> torch.Tensor:
    """This rank's piece of a sharded tensor, 1-D (no copy)."""
    return value._local_tensor.reshape(-1)


def gather_full(value: RaggedTensor) -> torch.Tensor:
    """The whole tensor of ``value`` on every rank of its group (a collective)."""
    return value.full_tensor()
