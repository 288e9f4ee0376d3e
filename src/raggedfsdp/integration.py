"""raggedfsdp's integration with torch: everything it changes in torch, installed in one place.

``import raggedfsdp`` calls :func:`install` once; no other module of the package changes torch
when it is imported. Each change is contained: torch behaves as before for whatever is not
raggedfsdp's (modules it did not shard, tensors that are not ragged shards, optimizers over
plain parameters).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed._state_dict_utils as state_dict_utils
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.tensor
import torch.distributed.tensor._api as dtensor_api
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement
from torch.utils._foreach_utils import _foreach_supported_types

from .checkpoint import install_torch_dsd
from .layout import RaggedShardPlacement
from .runtime import FSDPModule, RaggedTensor, distribute, register_fsdp_forward_method

__all__ = ["install"]


def install() -> None:
    """Make torch's own utilities right over raggedfsdp's sharded modules. Idempotent.

    1. torch's ``register_fsdp_forward_method`` (``torch.distributed.fsdp`` and its
       ``_fully_shard`` module) hands modules sharded by ``rf.fully_shard`` to
       :func:`raggedfsdp.register_fsdp_forward_method`, where it would return silently for
       them; other modules go to torch's, unchanged.
    2. :class:`~raggedfsdp.runtime.RaggedTensor`, the class of sharded parameters, their
       gradients and optimizer state, joins torch's foreach-supported types, so optimizers,
       ``clip_grad_norm_`` and the norm utilities take their fused paths over it, as over
       DTensor (torch/distributed/tensor/__init__.py registers DTensor the same way; the list
       is checked by exact type).
    3. ``torch.distributed.tensor.distribute_tensor`` (where torch exports it, and in every
       module already imported that bound it by name, DSD's among them) hands a whole tensor
       to be placed by a ragged placement to :func:`raggedfsdp.runtime.distribute`, where
       torch's would refuse the placement: DSD's
       full-state loads and accelerate's ``cpu_ram_efficient_loading`` call it with the
       parameters' own placements. Other placements go to torch's, unchanged.
    4. ``torch.distributed.checkpoint.state_dict`` over ragged shards: DSD's
       ``_distribute_tensors`` (its ``broadcast_from_rank0`` loads) places RaggedTensors by
       ``copy_`` ([Note: torch.distributed.checkpoint.state_dict over ragged shards] in
       ``checkpoint/_torch_dsd.py``). Optimizers need nothing: their state over sharded
       parameters is DTensors already ([Note: optimizer state across world sizes]).
    """
    _route_register_fsdp_forward_method()
    if RaggedTensor not in _foreach_supported_types:
        _foreach_supported_types.append(RaggedTensor)
    _route_distribute_tensor()
    install_torch_dsd()


def _route_register_fsdp_forward_method() -> None:
    """Item 1 of :func:`install`, where torch exports the function."""
    torch_register = torch_fsdp.register_fsdp_forward_method
    if getattr(torch_register, "_raggedfsdp", False):
        return

    @functools.wraps(torch_register)
    def route(module: nn.Module, method_name: str) -> None:
        if isinstance(module, FSDPModule):
            return register_fsdp_forward_method(module, method_name)
        return torch_register(module, method_name)

    route._raggedfsdp = True  # type: ignore[attr-defined]
    for exporter in (torch_fsdp, torch_fsdp._fully_shard):
        exporter.register_fsdp_forward_method = route


def _route_distribute_tensor() -> None:
    """Item 3 of :func:`install`: every module that binds ``distribute_tensor`` at import."""
    torch_distribute = dtensor_api.distribute_tensor
    if getattr(torch_distribute, "_raggedfsdp", False):
        return

    @functools.wraps(torch_distribute)
    def route(
        tensor: torch.Tensor,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        **kwargs: Any,
    ) -> DTensor:
        ragged = placements is not None and any(
            isinstance(p, RaggedShardPlacement) for p in placements
        )
        if ragged and device_mesh is not None:
            return distribute(tensor, device_mesh, placements, **kwargs)
        return torch_distribute(tensor, device_mesh, placements, **kwargs)

    route._raggedfsdp = True  # type: ignore[attr-defined]
    for exporter in (dtensor_api, torch.distributed.tensor, state_dict_utils):
        exporter.distribute_tensor = route  # type: ignore[attr-defined]
    # Modules imported before raggedfsdp that bound torch's function by name (``from
    # torch.distributed.tensor import distribute_tensor``: torch's test utilities, a framework)
    # get the route too; only that exact function object is replaced.
    for module in list(sys.modules.values()):
        if getattr(module, "distribute_tensor", None) is torch_distribute:
            module.distribute_tensor = route  # type: ignore[attr-defined]
