"""torch's own checkpoint utilities over ragged shards: ``torch.distributed.checkpoint.state_dict``.

DSD takes RaggedTensors as FSDP2's DTensors but for one step, the broadcast load's cut of each
rank's chunk, which :func:`route_distribute_tensors` routes through ``copy_`` ([Note:
torch.distributed.checkpoint.state_dict over ragged shards] at :func:`route_distribute_tensors`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed._state_dict_utils as state_dict_utils

from ._ragged_tensor import RaggedTensor
from ._ragged_tensor import distribute as distribute_ragged

__all__ = ["route_distribute_tensors"]


# [Note: torch.distributed.checkpoint.state_dict over ragged shards] Sharded parameters are DTensors
# (RaggedTensor, [Note: ragged shards as DTensors]), and so is the state of optimizers over them:
# torch's make it with ``zeros_like(param)``, raggedfsdp's keep it as RaggedTensors ([Note:
# optimizer state across world sizes]). So DSD's ``get_model_state_dict`` /
# ``get_optimizer_state_dict`` take them as FSDP2's: for ``full_state_dict=True`` they gather
# through ``redistribute(Replicate())``, DCP reshards them, and ``set_optimizer_state_dict`` places
# whole tensors through ``distribute_tensor`` (routed to :func:`raggedfsdp.tensor.distribute`,
# ``_adapt.py``) and hands ``optimizer.load_state_dict`` the rest, which raggedfsdp's optimizers
# take as they are.
#
# One step of DSD needs help: with ``broadcast_from_rank0=True``, ``_distribute_tensors`` cuts each
# rank's chunk out of the broadcast whole tensor by torch's placements, which a ragged piece is not;
# :func:`route_distribute_tensors` wraps it so that RaggedTensors take their piece through
# ``copy_``. It is contained: other tensors go to torch's function unchanged. If a torch release
# moves the wrapped function, the check there (at the first ragged placement or tensor, [Note: torch
# adapted on first use]) raises rather than letting a state dict be wrong.
def route_distribute_tensors() -> None:
    """Make DSD's ``broadcast_from_rank0`` loads place RaggedTensors. Idempotent."""
    torch_tensors = _torch_function(state_dict_utils, "_distribute_tensors")
    if getattr(torch_tensors, "_raggedfsdp", False):
        return
    state_dict_utils._distribute_tensors = _distribute_ragged_first(torch_tensors)


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

    distribute._raggedfsdp = True  # type: ignore[attr-defined]
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
