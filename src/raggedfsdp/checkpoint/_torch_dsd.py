"""torch's own checkpoint utilities over ragged shards: ``torch.distributed.checkpoint.state_dict``.

[Note: torch.distributed.checkpoint.state_dict over ragged shards]
FSDP2's parameters and optimizer state are DTensors, which ``get_model_state_dict`` /
``get_optimizer_state_dict`` (DSD) gather for ``full_state_dict=True`` and DCP reshards. Ours are
plain local tensors; the model's ``state_dict()`` already turns them into RaggedTensors (see
[Note: ragged shards in DCP]). Two things make the rest of DSD right, installed once by
:func:`install` (which ``raggedfsdp.integration.install`` calls at ``import raggedfsdp``):

1. **Full state**: DSD gathers through ``_gather_state_dict``, whose walk
   (``torch.distributed._state_dict_utils._iterate_state_dict``) dispatches on a closed list of
   types (ShardedTensor, DTensor, Tensor) to functions private to each caller. A RaggedTensor is
   a plain ``torch.Tensor`` there, which is what every other walk wants (``cpu_offload`` moves it
   with ``.to("cpu")``, a copy of its piece); only the gather must differ. So DSD's
   ``_gather_state_dict`` is wrapped, not the walk: RaggedTensors (and nothing else) are first
   replaced by :func:`~raggedfsdp.runtime.gather_full` (the pieces padded to the largest, one
   all-gather over the shard group, cut by the layout), then torch's function runs unchanged on
   what is left. Every rank joins every gather before torch's walk drops the values of ranks
   other than 0, so ``cpu_offload=True`` (values on rank 0 only) cannot hang. This depends on
   one name and its first argument only, not on the walk's internals, which change between
   releases.
2. **Optimizer state**: an optimizer over sharded parameters gets, at its first ``step()`` (a
   global step pre-hook; DSD steps a fresh optimizer itself to create its state), a
   ``state_dict`` post-hook that, while DSD reads the state (``_get_optim_state_dict``, wrapped
   to say so), turns the state of sharded parameters into RaggedTensors by the rules of [Note:
   optimizer state across world sizes]; and a ``load_state_dict`` pre-hook that accepts
   RaggedTensors (resharded by DCP), full tensors (``full_state_dict=True``) or this rank's own
   pieces, and hands torch's loader this rank's pieces. A plain ``optimizer.state_dict()`` keeps
   this rank's own tensors (FSDP2's holds DTensors), so a per-rank ``torch.save`` loads into any
   fresh optimizer at the same world size, as before.

Both are contained: the gather wrapper hands everything else to torch's function, and an
optimizer without sharded parameters gets no hooks. If a torch release moves either wrapped
function, the check in :func:`install` (at ``import raggedfsdp``) raises rather than letting a
state dict be wrong.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
import torch.distributed.checkpoint.state_dict as dsd
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..layout import shard_info
from ..runtime import RaggedTensor, gather_full
from ._optim_state import copy_flat, entry, loaded_piece, same_storage, state_layout

__all__ = ["install"]

_HOOKED = "_raggedfsdp_state_dict_hooks"
# Whether DSD is reading optimizer state: only then is it returned as RaggedTensors, so a plain
# optimizer.state_dict() keeps this rank's own tensors (loadable by any fresh optimizer).
_IN_DSD = contextvars.ContextVar("raggedfsdp_in_dsd", default=False)


def install() -> None:
    """Make DSD gather RaggedTensors and hook optimizers over sharded parameters. Idempotent."""
    torch_gather = _torch_function(dsd, "_gather_state_dict")
    torch_get_optim = _torch_function(dsd, "_get_optim_state_dict")
    if getattr(torch_gather, "_raggedfsdp", False):
        return
    dsd._gather_state_dict = _gather_wrapper(torch_gather)
    dsd._get_optim_state_dict = _in_dsd(torch_get_optim)
    register_optimizer_step_pre_hook(_hook_optimizer)


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

    return get_optim


def _gather_wrapper(torch_gather: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(torch_gather)
    def gather(state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        return torch_gather(_gather_ragged(state_dict), *args, **kwargs)

    gather._raggedfsdp = True  # type: ignore[attr-defined]
    return gather


def _gather_ragged(value: Any) -> Any:
    """``value`` with every RaggedTensor, in nested dicts, lists and tuples, replaced by its full
    tensor (a collective per RaggedTensor, in the walk's order, the same on every rank)."""
    if isinstance(value, RaggedTensor):
        return gather_full(value)
    if isinstance(value, dict):
        return {key: _gather_ragged(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_gather_ragged(item) for item in value)
    return value


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
