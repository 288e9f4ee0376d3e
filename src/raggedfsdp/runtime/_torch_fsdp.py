"""``register_fsdp_forward_method`` for raggedfsdp's sharded modules, and torch's own routed to it.

:func:`adapt_torch` routes it, run by the first ``fully_shard`` (never at import), with the sharded
tensor's adaptations (:func:`raggedfsdp.tensor.adapt_torch`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch.distributed.fsdp as torch_fsdp
from torch import nn

from ..tensor import adapt_torch as adapt_torch_to_ragged_tensors
from ._fsdp_module import FSDPModule
from ._hooks import state_of

__all__ = ["adapt_torch", "register_fsdp_forward_method"]


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` unshard the module's parameters before it runs and reshard
    them after, as forward does (FSDP2's function; a no-op on a module not sharded by
    ``rf.fully_shard``, as FSDP2's is). torch's own ``register_fsdp_forward_method`` routes
    raggedfsdp modules here once the first ``fully_shard`` has run (:func:`adapt_torch`) when
    it is looked up on ``torch.distributed.fsdp``; a reference bound before that does nothing
    to them."""
    state = state_of(module)
    if state is None:
        return
    if not callable(getattr(module, method_name, None)):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")
    method = getattr(module, method_name)

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        hooked = state._pre_forward(module, args, kwargs)
        if hooked is not None:
            args, kwargs = hooked
        return state._post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped)


def adapt_torch() -> None:
    """Make torch's own utilities right over raggedfsdp's sharded modules. Idempotent (flags on
    torch's objects, so a second call changes nothing).

    torch's ``register_fsdp_forward_method`` (``torch.distributed.fsdp`` and its
    ``_fully_shard`` module) hands modules sharded by ``rf.fully_shard`` to
    :func:`register_fsdp_forward_method`, where it would return silently for them; other
    modules go to torch's, unchanged. Then the sharded tensor's adaptations
    (:func:`raggedfsdp.tensor.adapt_torch`: foreach types, ``distribute_tensor``, DSD's loads).
    """
    torch_register = torch_fsdp.register_fsdp_forward_method
    if not getattr(torch_register, "_raggedfsdp", False):

        @functools.wraps(torch_register)
        def route(module: nn.Module, method_name: str) -> None:
            if isinstance(module, FSDPModule):
                return register_fsdp_forward_method(module, method_name)
            return torch_register(module, method_name)

        route._raggedfsdp = True  # type: ignore[attr-defined]
        for exporter in (torch_fsdp, torch_fsdp._fully_shard):
            exporter.register_fsdp_forward_method = route
    adapt_torch_to_ragged_tensors()
