"""The DCP container of a ragged shard: :class:`RaggedTensor`.

[Note: the ragged tensor container]
A rank's piece of a parameter (or of an optimizer state) is a contiguous flat range of the global
tensor, which is not one rectangle; :meth:`ShardLayout.boxes` cuts it into at most ``2*ndim-1``
rectangles. :class:`RaggedTensor` holds the piece and those rectangles as views of it, and speaks
DCP's ``_Checkpointable`` protocol (``torch/distributed/_checkpointable.py``), which DCP asks
before anything else (``planner_helpers._create_write_items`` / ``_create_chunk_list``,
``utils.find_tensor_shard``):

- ``__create_write_items__``: one write item per rectangle, at its global offsets;
- ``__create_chunk_list__``: the same rectangles, for the read plan of ``dcp.load``;
- ``__get_tensor_shard__``: the rectangle at an offset, a view of the piece, so saving copies
  nothing and ``dcp.load`` writes straight into the piece (the parameter itself).

DCP's metadata holds only the global shape, the dtype and these chunks, so a checkpoint is the
one torch's former ``ShardedTensor`` of the same rectangles wrote, and reshards into FSDP2
(DTensor) or a single process. It is a ``torch.Tensor`` (a wrapper subclass of the global shape
and dtype, with no storage of its own) because DCP and DSD take a value that is not a tensor for
a replicated object, or refuse it: DCP looks shards up by offset only in tensors
(``utils.find_state_dict_object``), some releases write non-tensors from the coordinator rank
only (``default_planner.create_default_local_save_plan``), and DSD's walk
(``_state_dict_utils._iterate_state_dict``) rejects types it does not know. Only the few
operations DSD applies to a state value work on it (``detach``, ``to``/``cpu``, ``clone``:
applied to the piece); anything else is an error that says to use :func:`local_flat` or
:func:`gather_full`.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..layout import ShardLayout
from ._collectives import all_gather
from ._metrics import RuntimeStats

__all__ = ["RaggedTensor", "gather_full", "local_flat", "to_ragged_tensor"]

_aten = torch.ops.aten


class _Handle:
    """A process group as an attribute that copies as itself: a group cannot be copied, and
    DCP's ``async_save`` stages a tensor subclass by deep-copying its attributes."""

    __slots__ = ("group",)

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict) -> _Handle:
        return self


class RaggedTensor(torch.Tensor):
    """A rank's ragged piece of a ``layout``-placed tensor, as DCP reads and writes it.

    Its shape and dtype are the global tensor's; its data is :attr:`piece` (this rank's piece,
    1-D), seen through :attr:`rectangles` (those of ``layout.boxes(rank)``, views of it)."""

    #: This rank's piece, 1-D (``shard_layout.local_numel(shard_rank)`` elements).
    piece: torch.Tensor
    #: ``(global offsets, view of piece)`` of every rectangle, in the piece's order.
    rectangles: tuple[tuple[torch.Size, torch.Tensor], ...]
    # What gather_full needs. Not ``layout``: torch.Tensor.layout is the memory layout.
    shard_layout: ShardLayout
    shard_rank: int
    _group: _Handle

    @property
    def shard_group(self) -> dist.ProcessGroup | None:
        """The process group of the layout's ranks (``None``: the default group)."""
        return self._group.group

    # Everything goes to __torch_dispatch__, where only the state-dict operations are allowed.
    __torch_function__: ClassVar[Any] = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(
        cls,
        piece: torch.Tensor,
        layout: ShardLayout,
        rank: int,
        group: dist.ProcessGroup | None,
    ) -> RaggedTensor:
        shape = tuple(layout.global_shape)
        value = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=piece.dtype, device=piece.device, requires_grad=False
        )
        strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
        start = layout.ranges[rank][0]
        rectangles = []
        for offsets, sizes in layout.boxes(rank):
            begin = sum(o * s for o, s in zip(offsets, strides, strict=True)) - start
            view = piece[begin : begin + math.prod(sizes)].view(sizes)
            rectangles.append((torch.Size(offsets), view))
        value.piece, value.rectangles = piece, tuple(rectangles)
        value.shard_layout, value.shard_rank, value._group = layout, rank, _Handle(group)
        return value

    def placed_as(self, layout: ShardLayout, rank: int) -> bool:
        """Whether this is ``rank``'s piece of a tensor placed by ``layout``: the same global
        shape and rectangles. (A piece of another plan may have the same size, even none.)"""
        mine = [(tuple(offsets), tuple(view.shape)) for offsets, view in self.rectangles]
        return tuple(self.shape) == tuple(layout.global_shape) and mine == layout.boxes(rank)

    def _with_piece(self, piece: torch.Tensor) -> RaggedTensor:
        return RaggedTensor(piece, self.shard_layout, self.shard_rank, self.shard_group)

    # Operations on the piece that give the same container: what DSD does to a state value
    # (detach; to/cpu for cpu_offload; clone). Keyed by overload, so nothing else slips through.
    _ON_PIECE: ClassVar[frozenset[Any]] = frozenset(
        {_aten.detach.default, _aten._to_copy.default, _aten.clone.default}
    )

    @classmethod
    def __torch_dispatch__(
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        if func in cls._ON_PIECE and isinstance(args[0], RaggedTensor):
            value: RaggedTensor = args[0]
            return value._with_piece(func(value.piece, *args[1:], **(kwargs or {})))
        if func is _aten.new_empty.default and tuple(args[1]) == tuple(args[0].shape):
            # DCP's async_save stages a tensor subclass as new_empty of its shape, then its
            # attributes (the piece and the rectangles, views of one storage, copied once)
            value = args[0]
            return value._with_piece(value.piece.new_empty(value.piece.shape, **(kwargs or {})))
        raise NotImplementedError(
            f"{func} is not supported on a RaggedTensor (a rank's ragged piece of a sharded "
            f"tensor, for checkpoints); use raggedfsdp.runtime.local_flat for this rank's "
            f"piece or gather_full for the full tensor"
        )

    def _properties(self) -> TensorProperties:
        # As torch's ShardedTensor recorded them, so the metadata is bit for bit the same.
        return TensorProperties(dtype=self.dtype)

    def __create_write_items__(self, fqn: str, object: object) -> list[WriteItem]:
        """One DCP write item per rectangle of this rank (none when the piece is empty)."""
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=view.shape),
                    properties=self._properties(),
                    size=self.shape,
                ),
            )
            for offsets, view in self.rectangles
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """The rectangles of this rank, for DCP's read plan."""
        return [ChunkStorageMetadata(offsets=o, sizes=view.shape) for o, view in self.rectangles]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The rectangle at ``index.offset``: a view of the piece (DCP reads from it on save and
        writes into it on load)."""
        for offsets, view in self.rectangles:
            if offsets == index.offset:
                return view
        raise ValueError(f"{index.fqn!r} has no rectangle at offsets {index.offset} on this rank")

    def __deepcopy__(self, memo: dict) -> RaggedTensor:
        """A copy of the piece, at the same place over the same process group (a handle: shared,
        as it cannot be copied)."""
        return self._with_piece(self.piece.clone())

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (``torch.save``) as the piece and its place; loading cuts the rectangles again.
        A process group cannot travel, so only a RaggedTensor over the default group pickles."""
        if self.shard_group is not None:
            raise TypeError(
                "a RaggedTensor over a process group other than the default cannot be pickled; "
                "save it with torch.distributed.checkpoint, or pickle local_flat(value) or "
                "gather_full(value)"
            )
        return (RaggedTensor, (self.piece, self.shard_layout, self.shard_rank, None))

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"RaggedTensor(shape={list(self.shape)}, dtype={self.dtype}, rank={self.shard_rank}, "
            f"local_numel={self.piece.numel()}, rectangles={len(self.rectangles)})"
        )


def to_ragged_tensor(
    local: torch.Tensor, layout: ShardLayout, rank: int, group: dist.ProcessGroup | None
) -> RaggedTensor:
    """Wrap ``local`` (rank's flat piece of a ``layout``-placed tensor, any shape with the right
    numel, contiguous) as a :class:`RaggedTensor` whose rectangles are views of it. No
    communication, no copy."""
    flat = local.reshape(-1)
    if flat.numel() and flat.data_ptr() != local.data_ptr():
        raise AssertionError("local piece must be contiguous")
    if flat.numel() != layout.local_numel(rank):
        raise ValueError(
            f"rank {rank}'s piece of a tensor of shape {list(layout.global_shape)} has "
            f"{layout.local_numel(rank)} elements, got {flat.numel()}"
        )
    return RaggedTensor(flat, layout, rank, group)


def local_flat(value: RaggedTensor) -> torch.Tensor:
    """This rank's piece of ``value``, 1-D (the tensor it wraps: no copy)."""
    return value.piece


def gather_full(value: RaggedTensor) -> torch.Tensor:
    """The full tensor of ``value``, on every rank of its group (a collective): one all-gather
    of the pieces padded to the largest."""
    layout, piece = value.shard_layout, value.piece
    width = max(layout.local_numel(r) for r in range(layout.world_size))
    padded = torch.zeros(width, dtype=piece.dtype, device=piece.device)
    padded[: piece.numel()] = piece
    gathered = torch.empty(width * layout.world_size, dtype=piece.dtype, device=piece.device)
    all_gather(gathered, padded, value.shard_group, RuntimeStats(), async_op=False)
    pieces = [
        gathered[r * width : r * width + layout.local_numel(r)] for r in range(layout.world_size)
    ]
    return layout.from_locals(pieces)
