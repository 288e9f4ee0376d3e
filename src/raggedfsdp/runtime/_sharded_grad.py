"""Sharded gradients that make ``torch.nn.utils.clip_grad_norm_`` compute the GLOBAL norm.

[Note: torch's clip_grad_norm_ over ragged shards]
A sharded parameter's ``.grad`` is a :class:`ShardedGrad`: the same storage (a view of the
bucket's reduced gradient shard), a tensor subclass that knows its shard process group. Every
operation on it runs as on a plain tensor (``__torch_function__`` disables itself and returns
plain tensors), except a full reduction to a norm (``torch.linalg.vector_norm``, ``Tensor.norm``
/ ``torch.norm`` with no ``dim``, ``torch._foreach_norm``), which returns a :class:`PartialNorm`:
this rank's contribution (``sum |g|^p``; ``max |g|`` for ``inf``), not yet reduced. DTensor does
the same with its ``Partial`` placement. torch's ``get_total_norm`` stacks the per-gradient norms
and takes their norm: the stack stays partial, and taking its norm reduces it first, so a clip
costs ONE all-reduce (of one number per gradient); every rank gets the global per-gradient
norms, hence torch's own total, and scales by the same factor.
Any other use of a :class:`PartialNorm` (arithmetic, ``item()``, printing) first reduces it
(one all-reduce), so a value is never silently local; it is a collective, as with DTensor.

Why a subclass of the gradient rather than of the parameter or a wrapped function: parameters
are what the forward, the optimizer and ``state_dict`` see every step, and torch's clip function
is called by name from user code and libraries, so patching it would miss ``from torch.nn.utils
import clip_grad_norm_`` bound earlier. Gradients are touched only by the optimizer and the clip;
the optimizer's ``_foreach_*`` calls pass through ``__torch_function__`` once per call (the cost
is measured in docs/results/runtime.md). torch's norm and clip utilities take their fused
(foreach) path only for the tensor types it lists, so :func:`raggedfsdp.integration.install`
lists this one there, as DTensor lists itself (torch/distributed/tensor/__init__.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

__all__ = ["PartialNorm", "ShardedGrad", "as_sharded_grad"]


class ShardedGrad(torch.Tensor):
    """A rank's piece of a sharded parameter's gradient; norms of it are :class:`PartialNorm`."""

    #: the shard process group the gradient's pieces are spread over (None: the default group)
    _rf_group: dist.ProcessGroup | None

    @classmethod
    def __torch_function__(
        cls, func: Callable, types: Any, args: Sequence = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        handler = _NORMS.get(func)
        if handler is not None:
            result = handler(args, kwargs)
            if result is not NotImplemented:
                return result
        if any(issubclass(t, PartialNorm) for t in types):
            return PartialNorm.__torch_function__(func, types, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if func in _ALIASES:  # ``g.data`` / ``g.detach()``: the same gradient, still sharded
            return as_sharded_grad(result, args[0]._rf_group)
        return result

    def __deepcopy__(self, memo: dict) -> ShardedGrad:
        """A copy of the values over the same process group (a handle, shared, not copied)."""
        with torch._C.DisableTorchFunctionSubclass():
            return as_sharded_grad(self.clone(), self._rf_group)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Saved (``torch.save``, pickle) as what it holds: this rank's piece, a plain tensor;
        a process group cannot travel."""
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


def as_sharded_grad(grad: torch.Tensor, group: dist.ProcessGroup | None) -> ShardedGrad:
    """``grad`` (same storage) as a :class:`ShardedGrad` of ``group``."""
    out = grad.as_subclass(ShardedGrad)
    out._rf_group = group
    return out


class PartialNorm(torch.Tensor):
    """Per-rank contributions to norms of sharded gradients, not yet reduced over ``_rf_group``.

    Its values are in the *power domain*: ``sum |g|^p`` over the local piece (``p = 0``: the count
    of non-zeros; ``inf`` / ``-inf``: ``max`` / ``min`` of ``|g|``), in float64 so that large and
    small gradients survive the power. Reducing is an all-reduce (``SUM``, ``MAX`` or ``MIN``)
    then the ``1/p``-th root, cast to ``_rf_dtype`` (the gradients' dtype, as torch returns).
    """

    _rf_group: dist.ProcessGroup | None
    _rf_ord: float
    _rf_dtype: torch.dtype

    @classmethod
    def __torch_function__(
        cls, func: Callable, types: Any, args: Sequence = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:  # what a tensor is, not its values: no reduction
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.stack:
            stacked = _stack(*args, **kwargs)
            if stacked is not None:
                return stacked
        elif func is torch.Tensor.to and _same_device_move(args, kwargs):
            return args[0]
        # Anything else (the final norm of the stack included) sees the reduced norms.
        args, kwargs = tree_map(_reduced, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def reduce(self) -> torch.Tensor:
        """The norms themselves, elementwise (one all-reduce over the group): a plain tensor,
        the same on every rank."""
        with torch._C.DisableTorchFunctionSubclass():
            value = self.clone()
            dist.all_reduce(value, op=_reduce_op(self._rf_ord), group=self._rf_group)
            return _root(value, self._rf_ord).to(self._rf_dtype)


def _partial(
    value: torch.Tensor, group: dist.ProcessGroup | None, ord: float, dtype: torch.dtype
) -> PartialNorm:
    out = value.as_subclass(PartialNorm)
    out._rf_group, out._rf_ord, out._rf_dtype = group, ord, dtype
    return out


def _reduce_op(ord: float) -> dist.ReduceOp.RedOpType:
    if ord == math.inf:
        return dist.ReduceOp.MAX
    if ord == -math.inf:
        return dist.ReduceOp.MIN
    return dist.ReduceOp.SUM


def _power(x: torch.Tensor, ord: float) -> torch.Tensor:
    """A local piece's contribution (float64, power domain) to its norm of order ``ord``: torch's
    fused norm in the gradient's dtype (no copy of the piece), then its power in float64."""
    x = x.detach()
    if x.numel() == 0:
        # The identity of the reduction: 0 for sums and for max |g|, inf for min |g|.
        return x.new_full((), math.inf if ord == -math.inf else 0.0, dtype=torch.float64)
    norm = torch.linalg.vector_norm(x, ord).to(torch.float64)
    return norm if ord in (0, math.inf, -math.inf) else norm.pow(ord)


def _root(value: torch.Tensor, ord: float) -> torch.Tensor:
    return value if ord in (0, math.inf, -math.inf) else value.pow(1.0 / ord)


def _norm_order(args: Sequence, kwargs: dict, name: str, default: Any = 2) -> Any:
    """The norm order of a ``vector_norm`` / ``norm`` call, or None when it is not a full
    reduction of the whole tensor to a p-norm (``dim`` given, ``"nuc"`` ...)."""
    if kwargs.get("dim") is not None or len(args) > 2 or kwargs.get("keepdim"):
        return None
    ord = args[1] if len(args) > 1 else kwargs.get(name, default)
    if ord is None or ord == "fro":
        ord = 2
    return float(ord) if isinstance(ord, (int, float)) else None


def _grad_norm(args: Sequence, kwargs: dict) -> Any:
    """``vector_norm(g)`` / ``g.norm()`` / ``torch.norm(g)`` of one :class:`ShardedGrad`; with a
    ``dim`` it is a local reduction, as any other op on a piece (``NotImplemented``)."""
    grad = args[0]
    name = "p" if "p" in kwargs else "ord"
    ord = _norm_order(args, kwargs, name)
    if ord is None or not isinstance(grad, ShardedGrad):
        return NotImplemented
    with torch._C.DisableTorchFunctionSubclass():
        return _partial(_power(grad, ord), grad._rf_group, ord, kwargs.get("dtype") or grad.dtype)


def _foreach_grad_norm(args: Sequence, kwargs: dict) -> Any:
    """``torch._foreach_norm(grads, ord)``: one partial per gradient, each over its own group;
    gradients every rank holds whole are counted once, over the group of the first sharded one
    (torch's ``get_total_norm`` stacks them together)."""
    tensors = list(args[0])
    ord = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dtype = kwargs.get("dtype")
    first = next((t._rf_group for t in tensors if isinstance(t, ShardedGrad)), None)
    with torch._C.DisableTorchFunctionSubclass():
        out = []
        for t in tensors:
            sharded = isinstance(t, ShardedGrad)
            group = t._rf_group if sharded else first
            value = _power(t, ord) if sharded else _replicated(t, ord, group)
            out.append(_partial(value, group, ord, dtype or t.dtype))
        return out


def _replicated(x: torch.Tensor, ord: float, group: dist.ProcessGroup | None) -> torch.Tensor:
    """A tensor every rank holds whole, in the power domain, counted once by a group reduction:
    on the group's first rank only for ``SUM``, on every rank for ``MAX`` / ``MIN``."""
    value = _power(x, ord)
    if _reduce_op(ord) == dist.ReduceOp.SUM and dist.get_rank(group) != 0:
        return torch.zeros_like(value)
    return value


def _stack(tensors: Sequence[torch.Tensor], dim: int = 0, *, out: Any = None) -> Any:
    """``torch.stack`` of per-gradient norms stays partial when they share a group and an order;
    plain norms among them (of gradients every rank holds whole) are counted once."""
    partials = [t for t in tensors if isinstance(t, PartialNorm)]
    first = partials[0]
    same = all(p._rf_group is first._rf_group and p._rf_ord == first._rf_ord for p in partials)
    with torch._C.DisableTorchFunctionSubclass():
        if out is not None or dim != 0 or not same or any(t.ndim for t in tensors):
            return None
        ord, group = first._rf_ord, first._rf_group
        values = [t if isinstance(t, PartialNorm) else _replicated(t, ord, group) for t in tensors]
        dtype = first._rf_dtype
        for t in tensors:
            dtype = torch.promote_types(
                dtype, t._rf_dtype if isinstance(t, PartialNorm) else t.dtype
            )
        return _partial(torch.stack(values), group, ord, dtype)


def _same_device_move(args: Sequence, kwargs: dict) -> bool:
    """``partial.to(device)`` onto its own device (torch's get_total_norm does it)."""
    if len(args) != 2 or kwargs:
        return False
    target = args[1]
    if isinstance(target, str):
        target = torch.device(target)
    return isinstance(target, torch.device) and target == args[0].device


def _reduced(x: Any) -> Any:
    return x.reduce() if isinstance(x, PartialNorm) else x


#: Other names for the whole gradient (``p.grad.data.norm()`` is an old idiom), which stay
#: :class:`ShardedGrad`; everything computed from it is a plain tensor.
_ALIASES = frozenset(
    {torch.Tensor.data.__get__, torch.Tensor.detach, torch.detach}  # type: ignore[attr-defined]
)

#: Reads of what a tensor is (device, dtype, shape), which need no reduced values.
_METADATA = frozenset(
    {
        torch.Tensor.device.__get__,  # type: ignore[attr-defined]
        torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
        torch.Tensor.shape.__get__,  # type: ignore[attr-defined]
        torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
        torch.Tensor.is_cuda.__get__,  # type: ignore[attr-defined]
        torch.Tensor.layout.__get__,  # type: ignore[attr-defined]
        torch.Tensor.requires_grad.__get__,  # type: ignore[attr-defined]
        torch.Tensor.dim,
        torch.Tensor.size,
        torch.Tensor.numel,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
    }
)

_NORMS: dict[Callable, Callable[[Sequence, dict], Any]] = {
    torch.linalg.vector_norm: _grad_norm,
    torch.Tensor.norm: _grad_norm,
    torch.norm: _grad_norm,
    torch._foreach_norm: _foreach_grad_norm,
}
