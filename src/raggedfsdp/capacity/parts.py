"""A vision-language model's cost split into its parts: the vision side and the language model.

Which parameter is which: :func:`raggedfsdp.facts.is_vision`. Each FSDP unit's per-rank bytes go to
the parts in proportion to the elements each holds in that unit's buckets (a vision block wholly
to the vision side; the root, which holds the patch embedding and projector beside the token
embedding and head, split by their elements): exact for a unit of one part, and for the root the
share its padding and alignment take.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..facts import is_vision
from ..facts.systems import System
from ..planner import ShardPlan
from .step_shape import StepShape
from .steptime import gathers_per_unit
from .units import UnitBytes, unit_path

__all__ = ["PART_NAMES", "PartCost", "part_costs"]

#: The parts, in the order reports list them.
PART_NAMES = ("vision", "language model")


@dataclass(frozen=True)
class PartCost:
    """One part of the model at one world size, for one system, per rank."""

    name: str
    param_numel: int
    """Elements of the part's parameters (the whole model's, not a rank's)."""
    persistent: int
    """Bytes of its sharded parameters, gradients and optimizer state on a rank."""
    all_gather_bytes: int
    """What the rank feeds the all-gathers of a step for it."""
    reduce_scatter_bytes: int
    """What the rank's reduce-scatters of a step take in for it (the unsharded gradients)."""


def _vision_shares(plans: Sequence[ShardPlan]) -> tuple[dict[str, float], int, int]:
    """Per unit path, the share of its elements on the vision side; the elements of each
    part in the whole model."""
    vision: dict[str, int] = {}
    total: dict[str, int] = {}
    for plan in plans:
        path = unit_path(plan.name)
        for name, entry in plan.entries.items():
            total[path] = total.get(path, 0) + entry.numel
            vision[path] = vision.get(path, 0) + (entry.numel if is_vision(name) else 0)
    shares = {path: vision[path] / total[path] if total[path] else 0.0 for path in total}
    seen = sum(vision.values())
    return shares, seen, sum(total.values()) - seen


def part_costs(
    plans: Sequence[ShardPlan],
    units: Sequence[UnitBytes],
    *,
    persistent: int,
    step: StepShape,
    world_size: int,
    system: System,
) -> tuple[PartCost, ...]:
    """The vision side and the language model of ``plans`` (one world size), costed under
    ``system`` (``persistent``: its persistent bytes per rank, which the parts share by shard
    elements); ``()`` for a model without a vision side."""
    shares, vision_numel, language_numel = _vision_shares(plans)
    if not vision_numel:
        return ()
    gathers = gathers_per_unit(units, system)
    shard = sum(u.shard(system) for u in units) or 1
    parts = []
    for name, numel in zip(PART_NAMES, (vision_numel, language_numel), strict=True):
        weight = [shares.get(u.path, 0.0) for u in units]
        if name != "vision":
            weight = [1.0 - w for w in weight]
        held = sum(w * u.shard(system) for w, u in zip(weight, units, strict=True))
        gathered = sum(
            w * n * u.gather_bytes(system, step)
            for w, n, u in zip(weight, gathers, units, strict=True)
        )
        reduced = sum(
            w * u.group(world_size) * u.scatter_share(system, step)
            for w, u in zip(weight, units, strict=True)
            if u.trainable_shard_numel
        )
        parts.append(
            PartCost(
                name=name,
                param_numel=numel,
                persistent=round(persistent * held / shard),
                all_gather_bytes=round(gathered),
                reduce_scatter_bytes=round(reduced),
            )
        )
    return tuple(parts)
