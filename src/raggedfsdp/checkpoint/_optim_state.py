"""Optimizer state as DCP-reshardable values, and back.

[Note: optimizer state across world sizes]
The optimizer's state is keyed by parameter FQN and made of DCP-reshardable values
(:func:`optim_state_dict`); which values are sharded how is decided per state entry:

1. the optimizer may say: ``optimizer.sharded_state_layout(param, key, value)`` returns the
   :class:`ShardLayout` of ``value`` (a tensor, or a list of tensors taken as the concatenation of
   their flattenings), or ``None`` to fall through. This is how block-structured state (8-bit
   scales, Shampoo's per-block factors) reshards: the optimizer knows the global tensor its
   local blocks belong to;
2. a 0-D tensor (``step``) is a plain, replicated tensor;
3. state of an unsharded parameter (no :func:`shard_info`) is plain, held whole by every rank;
4. a tensor with as many elements as the parameter's local shard is *param-shaped*: it is sharded
   exactly as the parameter (the parameter's layout);
5. a non-tensor value (a Python number) is stored as is (replicated);
6. anything else is an error naming the optimizer, the parameter and the key.

Loading at another world size or policy needs a *template*: the new run's own state, in its own
layout, for DCP to fill. :func:`init_optimizer_state` creates it by one optimizer step with zero
gradients and every learning rate set to 0, after which the parameters are restored from a copy
(so whatever the update rule does with a zero step, the model is untouched); DCP then overwrites
every value of that template with the saved one, resharded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..layout import ShardLayout, shard_info
from ..runtime import RaggedTensor, local_flat, to_ragged_tensor

__all__ = [
    "copy_flat",
    "entry",
    "expected_entries",
    "init_optimizer_state",
    "load_optim_state_dict",
    "optim_state_dict",
    "same_storage",
    "state_layout",
]


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _state_items(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> Iterator[tuple[str, torch.Tensor, dict[str, Any]]]:
    """``(fqn, param, state)`` for every parameter of ``optimizer`` that has state."""
    names = _param_names(model)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"{type(optimizer).__name__} holds a parameter of shape {list(p.shape)} that "
                    f"is not a parameter of the model"
                )
            state = optimizer.state.get(p)
            if state:
                yield names[id(p)], p, state


def _flat(value: torch.Tensor | list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A state value as one flat local tensor: a view of a tensor, or the concatenation of a
    list's flattenings (a new tensor; an empty list is an empty float32 tensor on ``device``)."""
    if isinstance(value, torch.Tensor):
        return value.reshape(-1)
    if not value:
        return torch.empty(0, dtype=torch.float32, device=device)
    return torch.cat([v.reshape(-1) for v in value])


def _is_tensor_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value)


def entry(
    optimizer: torch.optim.Optimizer, fqn: str, param: torch.Tensor, key: str, value: Any
) -> Any:
    """One state value as DCP should store it (rules in the module's Note)."""
    info = shard_info(param)
    if info is None:  # rule 3 (and 2, 5): this process holds the whole parameter and its state
        return value
    hook: Callable[..., ShardLayout | None] | None = getattr(
        optimizer, "sharded_state_layout", None
    )
    layout = hook(param, key, value) if hook is not None else None
    if layout is not None:
        flat = _flat(value, param.device)
        if flat.numel() != layout.local_numel(info.rank):
            raise ValueError(
                f"{type(optimizer).__name__}.sharded_state_layout gave state {key!r} of "
                f"parameter {fqn!r} a layout with {layout.local_numel(info.rank)} elements on "
                f"rank {info.rank}, but the value has {flat.numel()}"
            )
        return to_ragged_tensor(flat, layout, param)
    if isinstance(value, DTensor) or (isinstance(value, torch.Tensor) and value.ndim == 0):
        return value  # placed already (made like the parameter: torch's optimizers), or scalar
    if info.layout.ndim == 0:
        raise ValueError(
            f"{type(optimizer).__name__} state {key!r} of the 0-D parameter {fqn!r} cannot be "
            f"checkpointed (it lives on one rank; its scalar state is ambiguous)"
        )
    if isinstance(value, torch.Tensor) and value.numel() == info.layout.local_numel(info.rank):
        if not value.is_contiguous():
            value = value.contiguous()  # a copy: loading then copies back into the state
        return to_ragged_tensor(value, info.layout, param)
    if not isinstance(value, (torch.Tensor, list, tuple, dict)):
        return value
    shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    raise ValueError(
        f"cannot checkpoint {type(optimizer).__name__} state {key!r} of parameter {fqn!r}: "
        f"it is {shape}, neither shaped like the parameter's local shard "
        f"({info.layout.local_numel(info.rank)} elements) nor a scalar, and the optimizer "
        f"defines no sharded_state_layout(param, key, value) saying how it is sharded"
    )


def optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{fqn: {state key: value}}`` with DCP-reshardable values (module Note). Tensor values are
    views of the optimizer's state (no copy), except lists, which are concatenated."""
    return {
        fqn: {key: entry(optimizer, fqn, p, key, value) for key, value in state.items()}
        for fqn, p, state in _state_items(model, optimizer)
    }


def same_storage(value: RaggedTensor, target: torch.Tensor) -> bool:
    """Whether ``value``'s piece lives in ``target``'s storage (DCP loaded into it in place)."""
    local = target._local_tensor if isinstance(target, DTensor) else target
    return local_flat(value).untyped_storage().data_ptr() == local.untyped_storage().data_ptr()


def loaded_piece(
    optimizer: torch.optim.Optimizer, param: torch.Tensor, key: str, value: RaggedTensor, where: str
) -> torch.Tensor:
    """This rank's piece of a loaded state value, which must be placed as this rank's state of
    ``param`` is (a piece of another plan may have the same size: copying it would be silently
    wrong; DCP reshards)."""
    info = shard_info(param)
    layout = state_layout(optimizer, param, key, local_flat(value))
    if info is None or layout is None or not value.placed_as(layout):
        raise ValueError(
            f"optimizer state of {where} ({key!r}): its RaggedTensor's rectangles do not match "
            f"this rank's layout; load it with torch.distributed.checkpoint, which reshards"
        )
    return local_flat(value)


def copy_flat(flat: torch.Tensor, target: torch.Tensor | list[torch.Tensor]) -> None:
    """Copy ``flat`` (1-D) into a state value: a tensor, or a list taken as the concatenation of
    its flattenings (as :func:`optim_state_dict` stores it)."""
    pieces = [target] if isinstance(target, torch.Tensor) else list(target)
    pieces = [p._local_tensor if isinstance(p, DTensor) else p for p in pieces]
    position = 0
    for piece in pieces:
        piece.copy_(flat[position : position + piece.numel()].view_as(piece))
        position += piece.numel()


def state_layout(
    optimizer: torch.optim.Optimizer, param: torch.Tensor, key: str, value: Any
) -> ShardLayout | None:
    """The layout of a sharded parameter's state value (rules 1 and 4 of the module's Note):
    the optimizer's ``sharded_state_layout``, else the parameter's when the value is shaped like
    its local shard; ``None`` for anything else (scalars, unsharded parameters)."""
    info = shard_info(param)
    if info is None:
        return None
    hook = getattr(optimizer, "sharded_state_layout", None)
    layout = hook(param, key, value) if hook is not None else None
    if layout is not None:
        return layout
    local_numel = info.layout.local_numel(info.rank)
    if isinstance(value, torch.Tensor) and value.ndim > 0 and value.numel() == local_numel:
        return info.layout
    return None


def load_optim_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
) -> None:
    """Put ``state`` (an :func:`optim_state_dict` of this optimizer, filled by ``dcp.load``) into
    the optimizer. Values DCP loaded in place are left alone; the others are copied in."""
    for fqn, param, current in _state_items(model, optimizer):
        if fqn not in state:
            raise ValueError(f"optimizer state has no entry for parameter {fqn!r}")
        for key, target in list(current.items()):
            if key not in state[fqn]:
                raise ValueError(f"optimizer state of {fqn!r} has no {key!r}")
            loaded = state[fqn][key]
            if isinstance(loaded, RaggedTensor):
                if isinstance(target, torch.Tensor) and same_storage(loaded, target):
                    continue
                copy_flat(loaded_piece(optimizer, param, key, loaded, repr(fqn)), target)
            elif isinstance(loaded, torch.Tensor) and isinstance(target, torch.Tensor):
                if loaded.data_ptr() != target.data_ptr():
                    target.copy_(loaded)
            elif _is_tensor_list(loaded) and _is_tensor_list(target):
                for piece, value in zip(target, loaded, strict=True):
                    piece.copy_(value)
            else:
                current[key] = loaded


@torch.no_grad()
def init_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (in the current layout) without changing the model: one step
    with zero gradients and learning rate 0, then the parameters restored bit for bit. A
    collective when the optimizer's step is (every rank must call it)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(optimizer.state.get(p) for p in params):
        return
    saved = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]
    lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        optimizer.step()
    finally:
        for p, value, grad in zip(params, saved, grads, strict=True):
            p.copy_(value)
            p.grad = grad
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr


def expected_entries(state: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(DCP key, shape or None)`` of every entry of a nested state dict (``None``: not a
    tensor), keys flattened as DCP flattens them: what a checkpoint must hold to load it."""
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from expected_entries(value, f"{name}.")
        elif isinstance(value, torch.Tensor):  # a RaggedTensor's shape is the global one
            yield name, tuple(value.shape)
        elif _is_tensor_list(value):
            for i, item in enumerate(value):
                yield f"{name}.{i}", tuple(item.shape)
        else:
            yield name, None
