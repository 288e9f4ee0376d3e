"""The DTensor placement of a ragged shard, :class:`RaggedShardPlacement`, and :class:`ShardInfo`.

:class:`ShardInfo` is what a sharded tensor knows about itself. The first ragged placement made
adapts torch to ragged shards, once ([Note: torch adapted on first use] at :func:`on_first_use`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from ..layout import ShardLayout

__all__ = ["RaggedShardPlacement", "ShardInfo", "first_use", "on_first_use", "ragged_dim"]

#: What the first use of a ragged placement or tensor still has to run (emptied by it).
_pending: list[Callable[[], None]] = []


# [Note: torch adapted on first use] ``import raggedfsdp`` changes nothing in torch. The first
# ragged placement made runs :func:`first_use`, which adapts torch to ragged shards once
# (``_adapt.py``: foreach types, ``distribute_tensor``, DSD's broadcast loads); later calls cost one
# check of an empty list. A RaggedTensor's placements hold one, so the first RaggedTensor comes
# after it (copies and unpickled placements are made by ``__init__`` too, ``__reduce__``). The
# adaptations import these classes, so the classes cannot import them: ``_adapt.py`` hands itself in
# through :func:`on_first_use` when the room is imported, which is always before anything here is
# made.
def on_first_use(adapt: Callable[[], None]) -> None:
    """Have the first ragged placement or tensor made run ``adapt`` (once)."""
    _pending.append(adapt)


def first_use() -> None:
    """Run what :func:`on_first_use` was given, once; afterwards one check of an empty list."""
    while _pending:
        _pending.pop(0)()


@dataclass(frozen=True)
class ShardInfo:
    """What a sharded tensor knows about itself: its layout, this process's rank along the
    ragged mesh dimension, and that dimension's process group."""

    layout: ShardLayout
    rank: int
    group: dist.ProcessGroup


class RaggedShardPlacement(Placement):
    """A DTensor placement: along its mesh dimension, rank ``r`` holds the flat range
    ``layout.ranges[r]`` of the tensor's row-major flattening -- runs of whole units, possibly
    none. The placement of raggedfsdp's sharded parameters on the data-parallel mesh dimension
    (``p.placements``); equal placements have equal layouts."""

    def __init__(self, layout: ShardLayout) -> None:
        super().__init__()
        self.layout = layout
        first_use()

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, RaggedShardPlacement) and other.layout == self.layout
        )

    def __hash__(self) -> int:
        return hash(self.layout)

    def __repr__(self) -> str:
        ranges = self.layout.ranges
        shown = ", ".join(f"{s}:{e}" for s, e in ranges[:4]) + (", ..." if len(ranges) > 4 else "")
        return f"RaggedShard(unit={self.layout.unit_numel}, ranges=[{shown}])"

    def __str__(self) -> str:
        return "RS"

    def __reduce__(self) -> tuple[type, tuple[ShardLayout]]:
        return (RaggedShardPlacement, (self.layout,))


def ragged_dim(tensor: DTensor) -> int | None:
    """The mesh dimension of ``tensor``'s :class:`RaggedShardPlacement`, or ``None``."""
    for dim, placement in enumerate(tensor.placements):
        if isinstance(placement, RaggedShardPlacement):
            return dim
    return None
