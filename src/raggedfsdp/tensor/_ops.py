"""The ops a :class:`~._ragged_tensor.RaggedTensor` runs, each on its local pieces.

Which and why: [Note: ragged shards as DTensors]; :func:`handler` picks one per op overload.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement

from ._placement import RaggedShardPlacement, ragged_dim

__all__ = [
    "Handler",
    "handler",
    "mesh_device",
    "outer_box",
    "outer_placements",
    "piece_of",
    "spec_dim",
    "strides",
    "wrap",
]

_aten = torch.ops.aten


def strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def spec_dim(spec: DTensorSpec) -> int:
    """The mesh dimension of ``spec``'s ragged placement."""
    for dim, placement in enumerate(spec.placements):
        if isinstance(placement, RaggedShardPlacement):
            return dim
    raise AssertionError(f"no ragged placement in {spec.placements}")


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """This rank's device of ``mesh``'s type."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())


#: A handler runs one op on sharded tensors; ``cls`` is the class to wrap results in.
Handler = Callable[[type, Any, tuple, dict], Any]


def _is_ragged(value: object) -> bool:
    return isinstance(value, DTensor) and ragged_dim(value) is not None


def wrap(cls: type, local: torch.Tensor, spec: DTensorSpec) -> Any:
    """``local`` placed by ``spec`` (its dtype taken from ``local``)."""
    meta = spec.tensor_meta
    assert meta is not None
    if meta.dtype != local.dtype:
        spec = DTensorSpec(
            spec.mesh, spec.placements, TensorMeta(meta.shape, meta.stride, local.dtype)
        )
    return cls(local, spec, requires_grad=False)


def outer_placements(spec: DTensorSpec) -> tuple[Placement, ...]:
    """``spec``'s placements with the ragged one replaced by ``Replicate()``: how the tensor is
    placed over the mesh's other dimensions (tensor or expert parallelism), whose local tensor
    -- the *outer-local* tensor -- the ragged layout then cuts."""
    return tuple(Replicate() if isinstance(p, RaggedShardPlacement) else p for p in spec.placements)


def outer_box(spec: DTensorSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The outer-local tensor's shape and its offset in the global tensor."""
    meta = spec.tensor_meta
    assert meta is not None
    if all(p.is_replicate() or isinstance(p, RaggedShardPlacement) for p in spec.placements):
        return tuple(meta.shape), (0,) * len(meta.shape)
    return compute_local_shape_and_global_offset(meta.shape, spec.mesh, outer_placements(spec))


def piece_of(whole: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """This rank's piece of ``whole``, a tensor of the global shape: its outer-local block,
    then the ragged layout's range of that."""
    dim = spec_dim(spec)
    placement = spec.placements[dim]
    assert isinstance(placement, RaggedShardPlacement)
    shape, offset = outer_box(spec)
    block = whole[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
    return placement.layout.to_local(block.contiguous(), spec.mesh.get_local_rank(dim))


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
            return piece_of(value.to(mesh_device(ref.mesh)), ref)
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
            return piece_of(whole, ref)
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


def _elementwise(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
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
    return wrap(cls, out, spec) if isinstance(out, torch.Tensor) else out


def _foreach(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    """``_foreach_*`` and ``_fused_*`` (optimizer) ops: element ``i`` of every tensor list is
    placed like element ``i`` of the first list of sharded tensors."""
    first = next((a for a in args if isinstance(a, (list, tuple)) and a and _is_ragged(a[0])), None)
    if first is None:
        raise ValueError(f"raggedfsdp: {func} without a list of sharded tensors first")
    specs = [t._spec for t in first]
    unwrap = _Unwrap()
    local_args = [
        _locals(cls, arg, specs, unwrap)
        if isinstance(arg, (list, tuple)) and len(arg) == len(specs)
        else unwrap(arg, specs[0])
        for arg in args
    ]
    local_kwargs = {k: unwrap(v, specs[0]) for k, v in kwargs.items()}
    out = func(*local_args, **local_kwargs)
    if func._schema.is_mutable or not isinstance(out, (list, tuple)):
        return out
    return [wrap(cls, o, s) for o, s in zip(out, specs, strict=True)]


def _locals(
    cls: type, values: Sequence[Any], specs: list[DTensorSpec], unwrap: _Unwrap
) -> list[Any]:
    """The local tensors of a list argument. The common case -- gradients and optimizer state
    made from the parameters, so sharing their specs -- costs one identity check each."""
    out = []
    for value, spec in zip(values, specs, strict=True):
        if type(value) is cls and value._spec is spec:
            out.append(value._local_tensor)
        else:
            out.append(unwrap(value, spec))
    return out


def _random_fill(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    """``uniform_`` and friends: the whole tensor drawn on every rank, this rank's piece kept
    (the values one process would draw, at any world size)."""
    target = args[0]
    local = target._local_tensor
    whole = torch.empty(target.shape, dtype=target.dtype, device=local.device)
    func(whole, *args[1:], **kwargs)
    local.copy_(piece_of(whole, target._spec).view_as(local))
    return target


def _random_like(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    """``rand_like`` / ``randn_like``: drawn whole, as :func:`_random_fill`."""
    source = args[0]
    local = source._local_tensor
    whole = func(torch.empty(source.shape, dtype=source.dtype, device=local.device), **kwargs)
    return wrap(cls, piece_of(whole, source._spec).reshape(local.shape).clone(), source._spec)


def _new_factory(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    """``new_empty`` / ``new_zeros`` / ...: of the tensor's own shape, a sharded tensor placed
    the same (DCP's asynchronous staging asks for this); of another shape, a plain tensor."""
    source, size = args[0], tuple(args[1])
    local = source._local_tensor
    if size == tuple(source.shape):
        return wrap(cls, func(local, list(local.shape), *args[2:], **kwargs), source._spec)
    return func(local, list(size), *args[2:], **kwargs)


def _partial(local: torch.Tensor, spec: DTensorSpec, reduce: Placement) -> DTensor:
    """A reduction of a whole sharded tensor: this rank's contribution, partial over its
    sharded mesh dimension, replicated over the others. Reduced when read, as DTensor does."""
    placements = tuple(p if p.is_replicate() else reduce for p in spec.placements)
    meta = TensorMeta(local.shape, strides(local.shape), local.dtype)
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


def _vector_norm(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    """``linalg.vector_norm`` of the whole tensor (no ``dim``)."""
    x, p = args[0], float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    if dim not in (None, [], ()) or keepdim:  # along some dims: on the whole tensor
        return _whole(cls, func, args, kwargs)
    local = _local_norm(x._local_tensor, p, kwargs.get("dtype"))
    return _partial(local, x._spec, _norm_placement(p))


def _foreach_norm(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    """``_foreach_norm``: one partial norm per tensor (``clip_grad_norm_``'s fused path)."""
    xs, p = args[0], float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    placement = _norm_placement(p)
    return [_partial(_local_norm(x._local_tensor, p, dtype), x._spec, placement) for x in xs]


_IDENTITY = {"max": -math.inf, "min": math.inf}


def _full_reduction(op: str) -> Handler:
    """``sum`` / ``max`` / ``min`` of the whole tensor: partial over the ragged dimension."""

    def reduce(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
        x = args[0]
        local = x._local_tensor
        if local.numel() == 0 and op in _IDENTITY:
            value = torch.full((), _IDENTITY[op], dtype=local.dtype, device=local.device)
        else:
            value = func(local, *args[1:], **kwargs)
        return _partial(value, x._spec, Partial(op))

    return reduce


def _mean(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    """``mean`` of the whole tensor: the local sum over the global count, summed."""
    x = args[0]
    return _partial(x._local_tensor.sum(**kwargs) / x.numel(), x._spec, Partial("sum"))


def _any_all(op: str) -> Handler:
    """``any`` / ``all`` of the whole tensor, reduced at once: a flag that control flow reads
    (``nn.init.trunc_normal_`` loops on ``mask.any()``), replicated."""

    def reduce(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
        x = args[0]
        local = x._local_tensor
        value = bool(func(local)) if local.numel() else op == "all"
        flag = torch.tensor([int(value)], dtype=torch.int32, device=local.device)
        for dim, placement in enumerate(x._spec.placements):  # every dim the tensor is cut on
            if not placement.is_replicate():
                reduce_op = dist.ReduceOp.MIN if op == "all" else dist.ReduceOp.MAX
                dist.all_reduce(flag, reduce_op, group=x._spec.mesh.get_group(dim))
        result = flag[0].to(torch.bool)
        meta = TensorMeta(result.shape, (), result.dtype)
        placements = (Replicate(),) * x._spec.mesh.ndim
        return DTensor(result, DTensorSpec(x._spec.mesh, placements, meta), requires_grad=False)

    return reduce


def _item(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    """``item()`` of a one-element sharded tensor: its value, from the rank that holds it."""
    return func(args[0].full_tensor(), *args[1:], **kwargs)


def _same_view(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    """``view`` / ``reshape`` to the tensor's own shape (a no-op some utilities make)."""
    x, shape = args[0], list(args[1])
    if shape == list(x.shape):
        local = x._local_tensor
        return wrap(cls, local.view_as(local), x._spec)
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


def _whole(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    """Any other op that neither writes its inputs nor returns a view of them (``mm``, a norm
    along some dims, ``softmax``): on the whole tensors -- each sharded argument gathered, a
    collective -- its tensor results replicated DTensors. Exact, as DTensor's redistributing
    strategies are, and as slow; said once per op. (A view could not be: a write through it
    would not reach the shard.)"""
    spec = _first_spec((*args, *kwargs.values()))
    assert spec is not None
    _say_gathered(func)

    def whole(value: Any) -> Any:
        if isinstance(value, DTensor):
            return value.full_tensor()
        if isinstance(value, (list, tuple)):
            return type(value)(whole(v) for v in value)
        return value

    out = func(*whole(args), **{k: whole(v) for k, v in kwargs.items()})
    mesh = spec.mesh

    def replicated(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            meta = TensorMeta(value.shape, value.stride(), value.dtype)
            placements = (Replicate(),) * mesh.ndim
            return DTensor(value, DTensorSpec(mesh, placements, meta), requires_grad=False)
        if isinstance(value, (list, tuple)):
            return type(value)(replicated(v) for v in value)
        return value

    return replicated(out)


@functools.cache
def _say_gathered(func: Any) -> None:
    warnings.warn(
        f"raggedfsdp: {func} on a sharded tensor gathers it whole first (a collective per "
        f"call): fine for initialisation or a check, slow inside a training step",
        stacklevel=4,
    )


def _views_or_writes(func: Any) -> bool:
    schema = func._schema
    return schema.is_mutable or any(r.alias_info is not None for r in schema.returns)


@functools.cache
def handler(func: Any) -> Handler | None:
    """How ``func`` runs on sharded tensors (``None``: refused: it would write through, or
    return, a view that a ragged piece cannot be). Cached per op overload."""
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
    return None if _views_or_writes(func) else _whole
