"""Sharded tensors as DTensors: :class:`RaggedTensor`.

[Note: ragged shards as DTensors]
The ecosystem recognises FSDP's sharded parameters by their type: torchtitan, Lightning,
accelerate, DCP and DSD ask ``isinstance(p, DTensor)`` and then read ``p.placements``,
``p.device_mesh``, ``p.to_local()`` or ``p.full_tensor()``. A rank's piece of a ragged shard is a
contiguous run of whole units of the row-major flattening, which no torch placement describes, so
a sharded tensor here is a DTensor of its own class, :class:`RaggedTensor`, whose placement on
the data-parallel mesh dimension is a :class:`~raggedfsdp.layout.RaggedShardPlacement` (the
tensor's :class:`~raggedfsdp.layout.ShardLayout`; ``Replicate()`` on HSDP's replica dimension).
Its local tensor is this rank's piece (N-D when it is whole rows, else 1-D); a sharded
parameter's is a view of its bucket's shard buffer, so what the optimizer updates in place is
what the next all-gather sends.

Why a subclass that runs ops itself, rather than DTensor's sharding propagation with a new
placement: DTensor's propagation builds the output placements from its own rules (a pointwise
op of ``Shard(0)`` inputs yields a new ``Shard(0)``), so a placement it does not know would be
dropped or misread, and its op strategies are private tables that change with every release
(torch 2.13 moved dispatch to C++). What sharded parameters meet is small and known: optimizers
(pointwise, ``_foreach_*`` and ``_fused_*`` ops, ``*_like``), norms (gradient clipping),
initialisation (random fills, pointwise math), copies (checkpoint loads) and DCP.
:meth:`RaggedTensor.__torch_dispatch__` runs those on the local pieces and wraps the results with
the same placement -- no collective, one Python call per op (per list for ``_foreach_*``) -- and
turns full reductions into standard DTensors with ``Partial`` placements, so that torch's own
``clip_grad_norm_`` reduces them as it does FSDP2's. Anything else is refused with an error that
names the op: nothing is ever computed on a piece as if it were the whole tensor (Newton-Schulz
on a range of rows, say).

Random fills (``uniform_``, ``normal_``, ... as ``nn.init`` and ``reset_parameters()`` call them)
draw the whole tensor on every rank and keep this rank's piece, so a model initialised after
sharding holds exactly what one process initialising it with the same seed would hold, at any
world size and with any plan. That costs one whole parameter of memory and of generator work per
fill, once, at initialisation.

For DCP a RaggedTensor is its own ``_Checkpointable``: :meth:`ShardLayout.boxes` cuts the piece
into at most ``2*ndim-1`` rectangles, one write item each, views of the piece, so saving copies
nothing and ``dcp.load`` writes straight into the parameter. DCP's metadata holds the global
shape and these chunks, so a checkpoint reshards across world sizes and plans and loads into
FSDP2 or one process.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
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
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from ..layout import RaggedShardPlacement, ShardLayout, ragged_dim, shard_info
from ._collectives import all_gather
from ._metrics import RuntimeStats

__all__ = [
    "RaggedTensor",
    "distribute",
    "gather_full",
    "local_flat",
    "placed_like",
    "to_ragged_tensor",
]

_aten = torch.ops.aten


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def _spec_dim(spec: DTensorSpec) -> int:
    for dim, placement in enumerate(spec.placements):
        if isinstance(placement, RaggedShardPlacement):
            return dim
    raise AssertionError(f"no ragged placement in {spec.placements}")


class RaggedTensor(DTensor):
    """A DTensor whose placement on one mesh dimension is a
    :class:`~raggedfsdp.layout.RaggedShardPlacement` (and ``Replicate()`` on the others).

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
        requires_grad: bool = False,
    ) -> RaggedTensor:
        """This rank's ``piece`` of a tensor placed by ``layout`` along ``mesh_dim``, replicated
        along the mesh's other dimensions. No copy: the local tensor is ``piece`` itself."""
        dim = mesh_dim % mesh.ndim
        rank = mesh.get_local_rank(dim)
        if piece.numel() != layout.local_numel(rank):
            raise ValueError(
                f"rank {rank}'s piece of a tensor of shape {list(layout.global_shape)} has "
                f"{layout.local_numel(rank)} elements, got {piece.numel()}"
            )
        placements = tuple(
            RaggedShardPlacement(layout) if d == dim else Replicate() for d in range(mesh.ndim)
        )
        shape = torch.Size(layout.global_shape)
        meta = TensorMeta(shape, _strides(shape), piece.dtype)
        return cls(piece, DTensorSpec(mesh, placements, meta), requires_grad=requires_grad)

    # -- what it is ------------------------------------------------------------------------------

    @property
    def shard_layout(self) -> ShardLayout:
        """The :class:`~raggedfsdp.layout.ShardLayout` of the ragged placement."""
        placement = self._spec.placements[_spec_dim(self._spec)]
        assert isinstance(placement, RaggedShardPlacement)
        return placement.layout

    @property
    def shard_rank(self) -> int:
        """This process's rank along the ragged mesh dimension."""
        return self._spec.mesh.get_local_rank(_spec_dim(self._spec))

    @property
    def shard_group(self) -> dist.ProcessGroup:
        """The process group of the ragged mesh dimension."""
        return self._spec.mesh.get_group(_spec_dim(self._spec))

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
        all-gather of the pieces, padded to the largest)."""
        return _gather(self._local_tensor, self.shard_layout, self.shard_group)

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
        handler = _handler(func)
        if handler is None:
            raise NotImplementedError(
                f"raggedfsdp: {func} is not supported on a sharded tensor (a RaggedTensor: this "
                f"rank holds a ragged range of its elements); use .to_local() for this rank's "
                f"piece or .full_tensor() for the whole tensor, and raggedfsdp's optimizers "
                f"(rf.optim) for updates that need whole matrices"
            )
        return handler(func, args, kwargs or {})

    # -- DCP (_Checkpointable) -------------------------------------------------------------------

    def _rectangles(self) -> list[tuple[torch.Size, torch.Tensor]]:
        """``(global offsets, view of the piece)`` of every rectangle of this rank's piece."""
        layout, rank = self.shard_layout, self.shard_rank
        piece = self._local_tensor.reshape(-1)
        strides = _strides(tuple(layout.global_shape))
        start = layout.ranges[rank][0]
        out = []
        for offsets, sizes in layout.boxes(rank):
            begin = sum(o * s for o, s in zip(offsets, strides, strict=True)) - start
            out.append((torch.Size(offsets), piece[begin : begin + math.prod(sizes)].view(sizes)))
        return out

    def __create_write_items__(self, fqn: str, object: object) -> list[WriteItem]:
        """One DCP write item per rectangle of this rank (none when the piece is empty)."""
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=view.shape),
                    properties=TensorProperties(dtype=self.dtype),
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
        return _wrap(grad, ctx.spec)


def _gather(piece: torch.Tensor, layout: ShardLayout, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole tensor from every rank's piece: one all-gather, padded to the largest."""
    flat = piece.reshape(-1)
    world = layout.world_size
    width = max(layout.local_numel(r) for r in range(world))
    padded = flat.new_zeros(width)
    padded[: flat.numel()] = flat
    gathered = flat.new_empty(width * world)
    all_gather(gathered, padded, group, RuntimeStats(), async_op=False)
    pieces = [gathered[r * width : r * width + layout.local_numel(r)] for r in range(world)]
    return layout.from_locals(pieces)


def to_ragged_tensor(piece: torch.Tensor, layout: ShardLayout, like: torch.Tensor) -> RaggedTensor:
    """``piece`` (this rank's piece of a ``layout``-placed tensor, any shape with its number of
    elements) as a RaggedTensor placed over the ranks ``like`` is sharded over: optimizer state
    of a sharded parameter ``like`` (a RaggedTensor, or a plain piece marked by
    :func:`~raggedfsdp.layout.mark_sharded`), whose layout may differ from the parameter's. No
    copy."""
    if isinstance(like, DTensor):
        dim = ragged_dim(like)
        assert dim is not None
        return RaggedTensor.from_piece(piece, layout, like.device_mesh, mesh_dim=dim)
    info = shard_info(like)
    assert info is not None
    mesh = _group_mesh(info.group or dist.group.WORLD, piece.device.type)
    return RaggedTensor.from_piece(piece.reshape(-1), layout, mesh)


#: 1-D meshes of process groups that came without one (plain pieces marked by mark_sharded),
#: by the group's identity, with the group (a mesh is made once per group and device type).
_GROUP_MESHES: dict[tuple[int, str], tuple[dist.ProcessGroup, DeviceMesh]] = {}


def _group_mesh(group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    key = (id(group), device_type)
    cached = _GROUP_MESHES.get(key)
    if cached is None or cached[0] is not group:
        cached = (group, DeviceMesh.from_group(group, device_type))
        _GROUP_MESHES[key] = cached
    return cached[1]


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
    accelerate's ``cpu_ram_efficient_loading`` call (:func:`raggedfsdp.integration.install`
    routes them here)."""
    dims = [d for d, p in enumerate(placements) if isinstance(p, RaggedShardPlacement)]
    others = [p for d, p in enumerate(placements) if d not in dims]
    if len(dims) != 1 or not all(isinstance(p, Replicate) for p in others):
        raise NotImplementedError(
            f"raggedfsdp: distributing a tensor to {tuple(placements)}: one ragged placement, "
            f"Replicate() on the other mesh dimensions"
        )
    placement = placements[dims[0]]
    assert isinstance(placement, RaggedShardPlacement)
    whole = tensor.detach().to(_mesh_device(mesh)).contiguous()
    if src_data_rank is not None:
        for dim in range(mesh.ndim):
            group = mesh.get_group(dim)
            dist.broadcast(whole, dist.get_global_rank(group, src_data_rank), group=group)
    piece = placement.layout.to_local(whole, mesh.get_local_rank(dims[0])).clone()
    return RaggedTensor.from_piece(
        piece, placement.layout, mesh, mesh_dim=dims[0], requires_grad=tensor.requires_grad
    )


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())


def placed_like(piece: torch.Tensor, like: DTensor) -> RaggedTensor:
    """``piece`` (this rank's piece, any shape with its number of elements) placed as ``like``,
    a sharded tensor of the same global shape (a gradient of a sharded parameter). No copy."""
    local = like._local_tensor
    if piece.numel() != local.numel():
        raise ValueError(
            f"a piece of {piece.numel()} elements cannot be placed like one of {local.numel()}"
        )
    return _wrap(piece.view(local.shape), like._spec)


def local_flat(value: DTensor) -> torch.Tensor:
    """This rank's piece of a sharded tensor, 1-D (no copy)."""
    return value._local_tensor.reshape(-1)


def gather_full(value: RaggedTensor) -> torch.Tensor:
    """The whole tensor of ``value`` on every rank of its group (a collective)."""
    return value.full_tensor()


# -- op handlers -----------------------------------------------------------------------------------

Handler = Callable[[Any, tuple, dict], Any]


def _is_ragged(value: object) -> bool:
    return isinstance(value, DTensor) and ragged_dim(value) is not None


def _wrap(local: torch.Tensor, spec: DTensorSpec) -> RaggedTensor:
    """``local`` placed by ``spec`` (its dtype taken from ``local``)."""
    meta = spec.tensor_meta
    assert meta is not None
    if meta.dtype != local.dtype:
        spec = DTensorSpec(
            spec.mesh, spec.placements, TensorMeta(meta.shape, meta.stride, local.dtype)
        )
    return RaggedTensor(local, spec, requires_grad=False)


def _piece_of(whole: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """This rank's piece of ``whole``, a tensor of the global shape."""
    dim = _spec_dim(spec)
    placement = spec.placements[dim]
    assert isinstance(placement, RaggedShardPlacement)
    return placement.layout.to_local(whole, spec.mesh.get_local_rank(dim))


class _Unwrap:
    """The local tensors of one op's arguments. Sharded arguments must be placed like the
    reference (``spec``: given, or the first met); other tensors must be scalars, or the whole
    tensor (a replicated DTensor, or a plain one where ``whole_ok``), of which the piece is
    taken."""

    __slots__ = ("spec", "whole_ok")

    def __init__(self, *, whole_ok: bool = False) -> None:
        self.spec: DTensorSpec | None = None
        self.whole_ok = whole_ok

    def __call__(self, value: Any, like: DTensorSpec | None = None) -> Any:
        if isinstance(value, torch.Tensor):
            return self.tensor(value, like or self.spec)
        if isinstance(value, (list, tuple)):
            return type(value)(self(v, like) for v in value)
        return value

    def tensor(self, value: torch.Tensor, ref: DTensorSpec | None) -> torch.Tensor:
        if isinstance(value, DTensor):
            if _is_ragged(value):
                if ref is None:
                    self.spec = value._spec
                    return value._local_tensor
                if value._spec is ref or value._spec.placements == ref.placements:
                    return value._local_tensor
                if not self.whole_ok:
                    raise ValueError(
                        f"raggedfsdp: an op mixes sharded tensors of different layouts "
                        f"({value.placements} and {ref.placements}); copy_ reshards, other "
                        f"ops do not"
                    )
            return _foreign(value, ref, whole_ok=self.whole_ok)
        if value.dim() == 0 or value.numel() == 1:
            return value
        if self.whole_ok and ref is not None and value.shape == ref.shape:
            return _piece_of(value.to(_mesh_device(ref.mesh)), ref)
        shape = "" if ref is None else f" of shape {list(ref.shape)}"
        raise ValueError(
            f"raggedfsdp: an op mixes a sharded tensor{shape} with a plain tensor of shape "
            f"{list(value.shape)}; make both sharded, or compute on .to_local() (this rank's "
            f"piece) or .full_tensor()"
        )


def _foreign(value: DTensor, ref: DTensorSpec | None, *, whole_ok: bool) -> torch.Tensor:
    """A DTensor that is not placed like the op's sharded tensors: a scalar (a clip coefficient:
    reduced first when partial), or -- where ``whole_ok`` (copies) -- any placement, taken whole
    (a collective) and cut to this rank's piece."""
    if value.numel() == 1 or ref is None:
        if any(p.is_partial() for p in value.placements):
            value = value.redistribute(value.device_mesh, [Replicate()] * value.device_mesh.ndim)
        return value.to_local() if value.numel() == 1 else value._local_tensor
    if all(p.is_replicate() for p in value.placements) or whole_ok:
        whole = (
            value._local_tensor
            if all(p.is_replicate() for p in value.placements)
            else (value.full_tensor())
        )
        if whole.shape == ref.shape:
            return _piece_of(whole, ref)
    raise ValueError(
        f"raggedfsdp: an op mixes a sharded tensor with a DTensor placed {value.placements}; "
        f"redistribute it to Replicate() first"
    )


def _first_spec(values: Any) -> DTensorSpec | None:
    """The spec of the first sharded tensor among ``values`` (nested in lists and tuples)."""
    for value in values:
        if isinstance(value, (list, tuple)):
            spec = _first_spec(value)
            if spec is not None:
                return spec
        elif _is_ragged(value):
            return value._spec
    return None


def _elementwise(func: Any, args: tuple, kwargs: dict) -> Any:
    """Pointwise ops and the ``*_like``/copy family: on the pieces, the same placement."""
    unwrap = _Unwrap(whole_ok=func is _aten.copy_.default)
    unwrap.spec = _first_spec((*args, *kwargs.values()))
    local_args = unwrap(args)
    local_kwargs = {k: unwrap(v) for k, v in kwargs.items()}
    spec = unwrap.spec
    assert spec is not None
    out = func(*local_args, **local_kwargs)
    if func._schema.is_mutable:
        return kwargs["out"] if "out" in kwargs else args[0]
    return _wrap(out, spec) if isinstance(out, torch.Tensor) else out


def _foreach(func: Any, args: tuple, kwargs: dict) -> Any:
    """``_foreach_*`` and ``_fused_*`` (optimizer) ops: element ``i`` of every tensor list is
    placed like element ``i`` of the first list of sharded tensors."""
    first = next((a for a in args if isinstance(a, (list, tuple)) and a and _is_ragged(a[0])), None)
    if first is None:
        raise ValueError(f"raggedfsdp: {func} without a list of sharded tensors first")
    specs = [t._spec for t in first]
    unwrap = _Unwrap()
    local_args = [
        _locals(arg, specs, unwrap)
        if isinstance(arg, (list, tuple)) and len(arg) == len(specs)
        else unwrap(arg, specs[0])
        for arg in args
    ]
    local_kwargs = {k: unwrap(v, specs[0]) for k, v in kwargs.items()}
    out = func(*local_args, **local_kwargs)
    if func._schema.is_mutable or not isinstance(out, (list, tuple)):
        return out
    return [_wrap(o, s) for o, s in zip(out, specs, strict=True)]


def _locals(values: Sequence[Any], specs: list[DTensorSpec], unwrap: _Unwrap) -> list[Any]:
    """The local tensors of a list argument. The common case -- gradients and optimizer state
    made from the parameters, so sharing their specs -- costs one identity check each."""
    out = []
    for value, spec in zip(values, specs, strict=True):
        if type(value) is RaggedTensor and value._spec is spec:
            out.append(value._local_tensor)
        else:
            out.append(unwrap(value, spec))
    return out


def _random_fill(func: Any, args: tuple, kwargs: dict) -> Any:
    """``uniform_`` and friends: the whole tensor drawn on every rank, this rank's piece kept
    (the values one process would draw, at any world size)."""
    target = args[0]
    local = target._local_tensor
    whole = torch.empty(target.shape, dtype=target.dtype, device=local.device)
    func(whole, *args[1:], **kwargs)
    local.copy_(_piece_of(whole, target._spec).view_as(local))
    return target


def _random_like(func: Any, args: tuple, kwargs: dict) -> Any:
    """``rand_like`` / ``randn_like``: drawn whole, as :func:`_random_fill`."""
    source = args[0]
    local = source._local_tensor
    whole = func(torch.empty(source.shape, dtype=source.dtype, device=local.device), **kwargs)
    return _wrap(_piece_of(whole, source._spec).reshape(local.shape).clone(), source._spec)


def _new_factory(func: Any, args: tuple, kwargs: dict) -> Any:
    """``new_empty`` / ``new_zeros`` / ...: of the tensor's own shape, a sharded tensor placed
    the same (DCP's asynchronous staging asks for this); of another shape, a plain tensor."""
    source, size = args[0], tuple(args[1])
    local = source._local_tensor
    if size == tuple(source.shape):
        return _wrap(func(local, list(local.shape), *args[2:], **kwargs), source._spec)
    return func(local, list(size), *args[2:], **kwargs)


def _partial(local: torch.Tensor, spec: DTensorSpec, reduce: Placement) -> DTensor:
    """A reduction of a whole sharded tensor: this rank's contribution, partial over its
    sharded mesh dimension, replicated over the others. Reduced when read, as DTensor does."""
    placements = tuple(p if p.is_replicate() else reduce for p in spec.placements)
    meta = TensorMeta(local.shape, _strides(local.shape), local.dtype)
    return DTensor(local, DTensorSpec(spec.mesh, placements, meta), requires_grad=False)


def _norm_placement(p: float) -> Placement:
    """How per-rank p-norms combine: DTensor's own partial norm (``x^p``, summed, root)."""
    from torch.distributed.tensor._ops._math_ops import _NormPartial

    if p == math.inf:
        return Partial("max")
    if p == -math.inf:
        return Partial("min")
    if p == 0:
        return Partial("sum")
    return _NormPartial(p)


def _local_norm(local: torch.Tensor, p: float, dtype: torch.dtype | None) -> torch.Tensor:
    if local.numel() == 0 and math.isinf(p):
        # torch refuses max / min of nothing; their identities are 0 (of |x|) and +inf
        value = 0.0 if p > 0 else math.inf
        return torch.tensor(value, dtype=dtype or local.dtype, device=local.device)
    return torch.linalg.vector_norm(local, p, dtype=dtype)


def _vector_norm(func: Any, args: tuple, kwargs: dict) -> Any:
    """``linalg.vector_norm`` of the whole tensor (no ``dim``)."""
    x, p = args[0], float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    if dim not in (None, [], ()) or keepdim:
        raise NotImplementedError(
            f"raggedfsdp: a norm along dimensions {dim} of a sharded tensor; use .full_tensor()"
        )
    local = _local_norm(x._local_tensor, p, kwargs.get("dtype"))
    return _partial(local, x._spec, _norm_placement(p))


def _foreach_norm(func: Any, args: tuple, kwargs: dict) -> Any:
    """``_foreach_norm``: one partial norm per tensor (``clip_grad_norm_``'s fused path)."""
    xs, p = args[0], float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    placement = _norm_placement(p)
    return [_partial(_local_norm(x._local_tensor, p, dtype), x._spec, placement) for x in xs]


_IDENTITY = {"max": -math.inf, "min": math.inf}


def _full_reduction(op: str) -> Handler:
    """``sum`` / ``max`` / ``min`` of the whole tensor: partial over the ragged dimension."""

    def reduce(func: Any, args: tuple, kwargs: dict) -> Any:
        x = args[0]
        local = x._local_tensor
        if local.numel() == 0 and op in _IDENTITY:
            value = torch.full((), _IDENTITY[op], dtype=local.dtype, device=local.device)
        else:
            value = func(local, *args[1:], **kwargs)
        return _partial(value, x._spec, Partial(op))

    return reduce


def _mean(func: Any, args: tuple, kwargs: dict) -> Any:
    """``mean`` of the whole tensor: the local sum over the global count, summed."""
    x = args[0]
    return _partial(x._local_tensor.sum(**kwargs) / x.numel(), x._spec, Partial("sum"))


def _any_all(op: str) -> Handler:
    """``any`` / ``all`` of the whole tensor, reduced at once: a flag that control flow reads
    (``nn.init.trunc_normal_`` loops on ``mask.any()``), replicated."""

    def reduce(func: Any, args: tuple, kwargs: dict) -> Any:
        x = args[0]
        local = x._local_tensor
        value = bool(func(local)) if local.numel() else op == "all"
        flag = torch.tensor([int(value)], dtype=torch.int32, device=local.device)
        dist.all_reduce(
            flag,
            dist.ReduceOp.MIN if op == "all" else dist.ReduceOp.MAX,
            group=x._spec.mesh.get_group(_spec_dim(x._spec)),
        )
        result = flag[0].to(torch.bool)
        meta = TensorMeta(result.shape, (), result.dtype)
        placements = (Replicate(),) * x._spec.mesh.ndim
        return DTensor(result, DTensorSpec(x._spec.mesh, placements, meta), requires_grad=False)

    return reduce


def _item(func: Any, args: tuple, kwargs: dict) -> Any:
    """``item()`` of a one-element sharded tensor: its value, from the rank that holds it."""
    return func(args[0].full_tensor(), *args[1:], **kwargs)


def _same_view(func: Any, args: tuple, kwargs: dict) -> Any:
    """``view`` / ``reshape`` to the tensor's own shape (a no-op some utilities make)."""
    x, shape = args[0], list(args[1])
    if shape == list(x.shape):
        local = x._local_tensor
        return _wrap(local.view_as(local), x._spec)
    raise NotImplementedError(
        f"raggedfsdp: {func} to {shape} of a sharded tensor of shape {list(x.shape)}: this "
        f"rank's piece is a ragged range, not a block of the whole; use .to_local() or "
        f".full_tensor()"
    )


_LIKE_OPS = {
    _aten.clone.default,
    _aten.detach.default,
    _aten.alias.default,
    _aten._to_copy.default,
    _aten.copy_.default,
    _aten.fill_.Scalar,
    _aten.fill_.Tensor,
    _aten.zero_.default,
    _aten.empty_like.default,
    _aten.zeros_like.default,
    _aten.ones_like.default,
    _aten.full_like.default,
    _aten.contiguous.default,
}
_RANDOM_FILLS = {
    _aten.uniform_.default,
    _aten.normal_.default,
    _aten.bernoulli_.float,
    _aten.exponential_.default,
    _aten.cauchy_.default,
    _aten.log_normal_.default,
    _aten.geometric_.default,
    _aten.random_.default,
    _aten.random_.to,
    getattr(_aten.random_, "from"),
}
_RANDOM_LIKE = {_aten.rand_like.default, _aten.randn_like.default}
_NEW_FACTORIES = {
    _aten.new_empty.default,
    _aten.new_zeros.default,
    _aten.new_ones.default,
    _aten.new_full.default,
}
_SPECIAL: dict[Any, Handler] = {
    _aten.linalg_vector_norm.default: _vector_norm,
    _aten._foreach_norm.Scalar: _foreach_norm,
    _aten.sum.default: _full_reduction("sum"),
    _aten.max.default: _full_reduction("max"),
    _aten.min.default: _full_reduction("min"),
    _aten.mean.default: _mean,
    _aten.any.default: _any_all("any"),
    _aten.all.default: _any_all("all"),
    _aten._local_scalar_dense.default: _item,
    _aten.view.default: _same_view,
    _aten.reshape.default: _same_view,
}


@functools.cache
def _handler(func: Any) -> Handler | None:
    """How ``func`` runs on sharded tensors (``None``: refused). Cached per op overload."""
    if func in _SPECIAL:
        return _SPECIAL[func]
    if func in _RANDOM_FILLS:
        return _random_fill
    if func in _RANDOM_LIKE:
        return _random_like
    if func in _NEW_FACTORIES:
        return _new_factory
    if func.__name__.startswith(("_foreach_", "_fused_")):
        return _foreach
    if func in _LIKE_OPS or torch.Tag.pointwise in func.tags:
        return _elementwise
    return None
