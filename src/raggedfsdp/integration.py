"""raggedfsdp's integration with torch: everything it changes in torch, installed in one place.

``import raggedfsdp`` calls :func:`install` once; no other module of the package changes torch
when it is imported. Each change is contained: torch behaves as before for whatever is not
raggedfsdp's (modules it did not shard, tensors that are not ragged shards, optimizers over
plain parameters).
"""

from __future__ import annotations

import functools

import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.utils._foreach_utils import _foreach_supported_types

from .checkpoint import install_torch_dsd
from .runtime import FSDPModule, ShardedGrad, register_fsdp_forward_method

__all__ = ["install"]


def install() -> None:
    """Make torch's own utilities right over raggedfsdp's sharded modules. Idempotent.

    1. torch's ``register_fsdp_forward_method`` (``torch.distributed.fsdp`` and its
       ``_fully_shard`` module) hands modules sharded by ``rf.fully_shard`` to
       :func:`raggedfsdp.register_fsdp_forward_method`, where it would return silently for
       them; other modules go to torch's, unchanged.
    2. :class:`~raggedfsdp.runtime.ShardedGrad`, the class of sharded parameters' gradients,
       joins torch's foreach-supported types, so ``clip_grad_norm_`` and the norm utilities take
       their fused path over it (DTensor registers itself the same way).
    3. ``torch.distributed.checkpoint.state_dict`` over ragged shards: DSD's
       ``_gather_state_dict`` and ``_get_optim_state_dict`` are wrapped and a process-wide
       optimizer step pre-hook gives optimizers over sharded parameters their state-dict hooks
       ([Note: torch.distributed.checkpoint.state_dict over ragged shards] in
       ``checkpoint/_torch_dsd.py``).
    """
    _route_register_fsdp_forward_method()
    if ShardedGrad not in _foreach_supported_types:
        _foreach_supported_types.append(ShardedGrad)
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
