"""The full (unsharded) state dict of a sharded model."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..runtime import full_parameters

__all__ = ["full_state_dict"]


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped model's ``state_dict()``: same keys (both names of a tied parameter,
    persistent buffers included), full tensors on CPU, on every rank. A collective: every rank
    must call it, with the model between steps (sharded)."""
    full = full_parameters(model)
    out: dict[str, torch.Tensor] = {}
    for key, value in _raw_state_dict(model).items():
        out[key] = full[id(value)] if id(value) in full else value.detach().to("cpu", copy=True)
    return out


def _raw_state_dict(model: nn.Module) -> Mapping[str, torch.Tensor]:
    """The keys and order of ``state_dict()`` (parameters, then persistent buffers, module by
    module, pre-order, shared ones under every name), with the parameter objects themselves
    rather than what our state-dict hooks make of them."""
    out: dict[str, torch.Tensor] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        prefix = f"{mname}." if mname else ""
        for name, param in module._parameters.items():
            if param is not None:
                out[prefix + name] = param
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[prefix + name] = buf
    return out
