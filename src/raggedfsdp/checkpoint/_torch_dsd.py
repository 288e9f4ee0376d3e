"""torch's own checkpoint utilities over ragged shards: ``torch.distributed.checkpoint.state_dict``.

[Note: torch.distributed.checkpoint.state_dict over ragged shards]
Sharded parameters are DTensors (RaggedTensor, [Note: ragged shards as DTensors]), and so is the
state torch's optimizers make from them (``zeros_like(param)``): DSD's ``get_model_state_dict``
and ``get_optimizer_state_dict`` gather them for ``full_state_dict=True`` through
``redistribute(Replicate())`` and DCP reshards them, as FSDP2's. What is left is the state of
raggedfsdp's own optimizers, which they keep as this rank's plain pieces: an optimizer over
sharded parameters gets, at its first ``step()`` (a global step pre-hook; DSD steps a fresh
optimizer itself to create its state), a ``state_dict`` post-hook that, while DSD reads the
state (``_get_optim_state_dict``, wrapped to say so), turns the plain pieces into RaggedTensors
by the rules of [Note: optimizer state across world sizes] (DTensor values pass as they are);
and a ``load_state_dict`` pre-hook that accepts RaggedTensors (resharded by DCP), full tensors
(``full_state_dict=True``) or this rank's own pieces, and hands the loader this rank's pieces.

It is contained: an optimizer without sharded parameters gets no hooks. If a torch release moves
the wrapped function, the check in :func:`install` (at ``import raggedfsdp``) raises rather than
letting a state dict be wrong.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
import torch.distributed._state_dict_utils as state_dict_utils
import torch.distributed.checkpoint.state_dict as dsd
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..layout import shard_info
from ..runtime import RaggedTensor
from ..runtime import distribute as distribute_ragged
from ._optim_state import copy_flat, entry, loaded_piece, same_storage, state_layout

__all__ = ["install"]

_HOOKED = "_raggedfsdp_state_dict_hooks"
# Whether DSD is reading optimizer state: only then is it returned as RaggedTensors, so a plain
# optimizer.state_dict() keeps this rank's own tensors (loadable by any fresh optimizer).
_IN_DSD = contextvars.ContextVar("raggedfsdp_in_dsd", default=False)


def install() -> None:
    """Make DSD gather RaggedTensors and hook optimizers over sharded parameters. Idempotent."""
    torch_get_optim = _torch_function(dsd, "_get_optim_state_dict")
    if getattr(torch_get_optim, "_raggedfsdp", False):
        return
    dsd._get_optim_state_dict = _in_dsd(torch_get_optim)
    torch_tensors = _torch_function(state_dict_utils, "_distribute_tensors")
    state_dict_utils._distribute_tensors = _distribute_ragged_first(torch_tensors)
    register_optimizer_step_pre_hook(_hook_optimizer)


def _distribute_ragged_first(torch_tensors: Callable[..., None]) -> Callable[..., None]:
    """DSD's ``_distribute_tensors`` (``broadcast_from_rank0``: every rank has the whole tensor
    now) cuts a DTensor's chunk by torch's placements, which a ragged piece is not: sharded
    tensors of ours take their piece through ``copy_`` (a new piece where they are still on
    meta, which DSD then assigns); the rest goes to torch's function."""

    @functools.wraps(torch_tensors)
    def distribute(local_state_dict: dict[str, Any], keys: list[str], *args: Any) -> None:
        rest = []
        for key in keys:
            entry = local_state_dict.get(key)
            if isinstance(entry, tuple) and isinstance(entry[0], RaggedTensor):
                local, whole = entry
                if local.device.type == "meta":  # a meta model: DSD assigns what it gets here
                    local = distribute_ragged(
                        whole, local.device_mesh, local.placements, src_data_rank=None
                    )
                else:
                    with torch.no_grad():
                        local.copy_(whole)
                local_state_dict[key] = local
            else:
                rest.append(key)
        torch_tensors(local_state_dict, rest, *args)

    return distribute


def _torch_function(module: Any, name: str) -> Callable[..., Any]:
    function = getattr(module, name, None)
    if function is None:
        raise ImportError(
            f"raggedfsdp: this torch has no {module.__name__}.{name}, which raggedfsdp wraps so "
            f"that torch.distributed.checkpoint.state_dict handles ragged shards; use "
            f"rf.full_state_dict / rf.optim_state_dict instead and report the torch version"
        )
    return function


def _in_dsd(torch_get_optim: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(torch_get_optim)
    def get_optim(*args: Any, **kwargs: Any) -> Any:
        token = _IN_DSD.set(True)
        try:
            return torch_get_optim(*args, **kwargs)
        finally:
            _IN_DSD.reset(token)

    get_optim._raggedfsdp = True  # type: ignore[attr-defined]
    return get_optim


def _hook_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step pre-hook of every optimizer: hook those over sharded parameters, once."""
    if getattr(optimizer, _HOOKED, False):
        return
    setattr(optimizer, _HOOKED, True)
    params = chain.from_iterable(g["params"] for g in optimizer.param_groups)
    if any(_spread(p) for p in params):
        optimizer.register_state_dict_post_hook(_sharded_state)
        optimizer.register_load_state_dict_pre_hook(_local_state)


def _spread(param: torch.Tensor) -> bool:
    """Whether ``param`` is sharded over more than one rank (a one-rank layout's state is whole,
    as a plain parameter's)."""
    info = shard_info(param)
    return info is not None and info.layout.world_size > 1


def _sharded_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict:
    """Under DSD, ``optimizer.state_dict()`` with the state of sharded parameters as
    RaggedTensors (new per-parameter dicts: torch's are the optimizer's own)."""
    if not _IN_DSD.get():
        return state_dict
    params = list(chain.from_iterable(g["params"] for g in optimizer.param_groups))
    state = state_dict["state"]
    for index, values in list(state.items()):
        param = params[index]
        if _spread(param):
            name = f"parameter {index}"
            state[index] = {k: entry(optimizer, name, param, k, v) for k, v in values.items()}
    return state_dict


def _local_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict:
    """What ``optimizer.load_state_dict`` receives, with every sharded parameter's state turned
    into this rank's pieces. Keys are matched to parameters by position, as torch does (DSD
    keys them by FQN)."""
    saved = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    current = chain.from_iterable(g["params"] for g in optimizer.param_groups)
    param_of = dict(zip(saved, current, strict=False))
    state = dict(state_dict["state"])
    for key, values in state.items():
        param = param_of.get(key)
        if param is not None and _spread(param):
            held = optimizer.state.get(param, {})
            state[key] = {
                k: _local_value(optimizer, param, k, v, held.get(k)) for k, v in values.items()
            }
    return {**state_dict, "state": state}


def _local_value(
    optimizer: torch.optim.Optimizer, param: torch.Tensor, key: str, value: Any, held: Any
) -> Any:
    """This rank's piece of one loaded state value, copied into the state it replaces when there
    is one (so the optimizer keeps its own tensors, and a value DCP loaded in place is kept)."""
    if isinstance(value, RaggedTensor):
        if isinstance(held, torch.Tensor) and same_storage(value, held):
            return held
        flat = loaded_piece(optimizer, param, key, value, "a parameter")
    else:
        layout = state_layout(optimizer, param, key, held if held is not None else value)
        full = isinstance(value, torch.Tensor) and layout is not None
        if not full or value.shape != layout.global_shape:  # type: ignore[union-attr]
            return value  # a scalar, or this rank's own piece already
        info = shard_info(param)
        assert info is not None
        flat = layout.to_local(value.to(param.device), info.rank).reshape(-1)  # type: ignore[union-attr]
    if held is not None:
        copy_flat(flat, held)
        return held
    if flat.numel() == param.numel():
        return flat.clone().view(param.shape)
    raise ValueError(
        f"{type(optimizer).__name__}: cannot load state {key!r} of a sharded parameter of global "
        f"shape {list(shard_info(param).layout.global_shape)} before the optimizer has state of "  # type: ignore[union-attr]
        f"its own to fill; load it with set_optimizer_state_dict (which creates the state "
        f"first) or rf.load_optim_state_dict"
    )
