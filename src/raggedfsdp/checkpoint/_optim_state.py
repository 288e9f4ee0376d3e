"""Optimizer state by parameter FQN, for ``torch.distributed.checkpoint``.

Optimizers keep the state of sharded parameters as DTensors ([Note: optimizer state across world
sizes] in ``optim/_state.py``), so ``optimizer.state_dict()`` is reshardable as it is:
:func:`optim_state_dict` keys it by parameter FQN, as DSD does, :func:`load_optim_state_dict` hands
it back, and :func:`init_optimizer_state` makes the template a load at another world size fills.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..tensor import shard_info

__all__ = [
    "expected_entries",
    "init_optimizer_state",
    "load_optim_state_dict",
    "optim_state_dict",
]


def _named_params(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> list[tuple[str, torch.Tensor]]:
    """``(fqn, param)`` of every parameter of ``optimizer``, in its order (the positions of its
    ``state_dict()``)."""
    names = {id(p): name for name, p in model.named_parameters()}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"{type(optimizer).__name__} holds a parameter of shape {list(p.shape)} that "
                    f"is not a parameter of the model"
                )
            out.append((names[id(p)], p))
    return out


def _check_placed(
    optimizer: torch.optim.Optimizer, fqn: str, param: torch.Tensor, values: Mapping[str, Any]
) -> None:
    """``ValueError`` unless every tensor state of a parameter sharded over several ranks is
    placed (a DTensor) or a scalar: DCP would take a plain piece for the whole entry."""
    info = shard_info(param)
    if info is None or info.layout.world_size == 1:
        return
    for key, value in values.items():
        tensors = value if isinstance(value, (list, tuple)) else [value]
        if any(
            isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.ndim > 0
            for t in tensors
        ):
            raise ValueError(
                f"cannot checkpoint {type(optimizer).__name__} state {key!r} of parameter "
                f"{fqn!r}: it holds plain tensors of a parameter sharded over "
                f"{info.layout.world_size} ranks, which DCP would take for the whole entry; "
                f"keep such state as DTensors placed over the parameter's ranks (zeros_like of "
                f"the parameter, or raggedfsdp.tensor.to_ragged_tensor for a layout of its own)"
            )


def optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{fqn: {state key: value}}``: the state of ``optimizer.state_dict()`` keyed by parameter
    FQN, with the optimizer's own tensors (no copy), so ``dcp.load`` into it loads in place."""
    state = optimizer.state_dict()["state"]
    out = {}
    for index, (fqn, param) in enumerate(_named_params(model, optimizer)):
        if index in state:
            values = dict(state[index])
            _check_placed(optimizer, fqn, param, values)
            out[fqn] = values
    return out


def load_optim_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
) -> None:
    """Put ``state`` (an :func:`optim_state_dict`, filled by ``dcp.load``) into the optimizer
    through its ``load_state_dict``. Every parameter that has state must have an entry with
    its keys, and a sharded value must be placed as the optimizer's own (DCP reshards; an
    optimizer would silently take a piece of another layout)."""
    current = optimizer.state_dict()
    loaded: dict[int, dict[str, Any]] = {}
    for index, (fqn, _) in enumerate(_named_params(model, optimizer)):
        held = current["state"].get(index, {})
        if fqn not in state:
            if held:
                raise ValueError(f"optimizer state has no entry for parameter {fqn!r}")
            continue
        for key, value in held.items():
            if key not in state[fqn]:
                raise ValueError(f"optimizer state of {fqn!r} has no {key!r}")
            _check_same_placement(fqn, key, state[fqn][key], value)
        loaded[index] = dict(state[fqn])
    optimizer.load_state_dict({"state": loaded, "param_groups": current["param_groups"]})


def _check_same_placement(fqn: str, key: str, value: Any, held: Any) -> None:
    """``ValueError`` when a sharded ``value`` is placed unlike the optimizer's ``held`` one."""
    placed = isinstance(value, DTensor) and isinstance(held, DTensor)
    if placed and value.placements != held.placements:
        raise ValueError(
            f"optimizer state of {fqn!r} ({key!r}) is placed {value.placements}, not as the "
            f"optimizer's ({held.placements}): its rectangles do not match this rank's layout; "
            f"load it with torch.distributed.checkpoint, which reshards"
        )


# Loading at another world size or policy needs a *template*: the new run's own state, in its own
# layout, for DCP to fill. :func:`init_optimizer_state` creates it by one optimizer step with zero
# gradients and every learning rate set to 0, after which the parameters are restored from a copy
# (so whatever the update rule does with a zero step, the model is untouched); DCP then overwrites
# every value of that template with the saved one, resharded, in place.
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


def _is_tensor_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value)


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
