"""Muon's own arguments: their checks, and which parameters go to the auxiliary AdamW."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._common import check_betas

__all__ = ["AdamWRule", "check_muon_args", "route"]

#: Selects which parameters go to the auxiliary AdamW: called as ``fn(param, global_shape)``.
AdamWRule = Callable[[torch.Tensor, torch.Size], bool]


def check_muon_args(
    momentum: float,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    adjust_lr_fn: str | None,
    ns_dtype: torch.dtype,
    adamw_betas: tuple[float, float],
) -> None:
    """``ValueError`` unless :class:`Muon`'s own arguments are valid (``lr`` and
    ``weight_decay`` are checked per param group)."""
    if not momentum >= 0.0:
        raise ValueError(f"momentum must be >= 0, got {momentum}")
    if len(tuple(ns_coefficients)) != 3:
        raise ValueError(f"ns_coefficients must be 3 numbers (a, b, c), got {ns_coefficients}")
    if not 0 <= ns_steps < 100:
        raise ValueError(f"ns_steps must be in [0, 100), got {ns_steps}")
    if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
        raise ValueError(
            f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}"
        )
    if not isinstance(ns_dtype, torch.dtype) or not ns_dtype.is_floating_point:
        raise ValueError(f"ns_dtype must be a floating-point torch.dtype, got {ns_dtype!r}")
    check_betas(adamw_betas, "adamw_betas")


def route(params: Any, adamw_params: Iterable[Any] | AdamWRule | None) -> list[dict[str, Any]]:
    """Param groups with the auxiliary AdamW's parameters in ``use_muon=False`` groups."""
    groups = [params] if isinstance(params, torch.Tensor) else list(params)
    if not groups:
        raise ValueError("Muon got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    groups = [dict(g) for g in groups]
    if adamw_params is None:
        return groups
    if callable(adamw_params):
        routed: list[dict[str, Any]] = []
        for group in groups:
            if not group.get("use_muon", True):
                routed.append(group)
                continue
            items = group["params"]
            items = [items] if isinstance(items, torch.Tensor) else list(items)

            def to_adamw(item: Any) -> bool:
                p = item[1] if isinstance(item, tuple) else item
                return bool(adamw_params(p, p.shape))  # type: ignore[operator]

            muon_items = [x for x in items if not to_adamw(x)]
            adamw_items = [x for x in items if to_adamw(x)]
            if muon_items:
                routed.append({**group, "params": muon_items})
            if adamw_items:
                routed.append({"params": adamw_items, "use_muon": False})
        return routed
    extra = [adamw_params] if isinstance(adamw_params, torch.Tensor) else list(adamw_params)
    return [*groups, {"params": extra, "use_muon": False}] if extra else groups
