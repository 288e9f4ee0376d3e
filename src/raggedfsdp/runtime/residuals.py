"""Error-feedback residuals as training state (see ``CommCompression(error_feedback=True)``).

A rank's residual is what quantizing *its own* unsharded gradient dropped: one tensor per bucket
per rank, not a shard of anything, so it is saved per rank and means something only at the
world size and plan it was made with. Checkpoints keep it beside the RNG states, which have the
same nature (``train/checkpoints.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ._hooks import named_states_under
from ._param import bucket_name
from ._param_group import FSDPParamGroup

__all__ = ["error_feedback_state", "load_error_feedback_state", "unit_residuals"]


def error_feedback_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's residuals by bucket name, as ``plan_model(model)`` names the buckets (the
    live tensors; empty without error feedback). Not a collective."""
    out: dict[str, torch.Tensor] = {}
    for paths, state in named_states_under(model):
        out.update(unit_residuals(state.group, paths))
    return out


def unit_residuals(
    group: FSDPParamGroup, paths: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """The residual of each of a unit's buckets that keeps one, by the bucket's name when the
    unit's modules are ``paths`` below the model (as its ``named_plans``)."""
    out = {}
    for bucket in group.buckets:
        residual = bucket.reduce.error_feedback_state() if bucket.reduce is not None else None
        if residual is not None:
            out[bucket_name(bucket.plan.name, paths[0] if paths else "")] = residual
    return out


def load_error_feedback_state(model: nn.Module, saved: Mapping[str, torch.Tensor]) -> None:
    """Copy residuals saved by :func:`error_feedback_state` (same world size and plan) into the
    model's; ``ValueError`` naming the bucket when they do not match."""
    live = error_feedback_state(model)
    if saved.keys() != live.keys():
        raise ValueError(
            f"error-feedback residuals saved for buckets {sorted(saved)} do not match the "
            f"model's {sorted(live)} (another plan or compression)"
        )
    for name, tensor in live.items():
        value = saved[name]
        if value.shape != tensor.shape or value.dtype != tensor.dtype:
            raise ValueError(
                f"error-feedback residual of bucket {name!r} was saved as {value.dtype} "
                f"{list(value.shape)}, the model keeps {tensor.dtype} {list(tensor.shape)}"
            )
        tensor.copy_(value)
