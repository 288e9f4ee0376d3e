"""The runtime's state machines, and the one check that every transition goes through.

A unit is in one :class:`ShardedState` and one :class:`TrainingState`; the root of a model is in one
:class:`RootPhase`. Training states and root phases move only through :func:`check_state`, which
turns an impossible transition into an error naming the rank, the unit and the state. Sharded states
need no check: ``unshard`` and ``reshard`` are idempotent by design (a prefetch may have issued the
all-gather already), each one step along SHARDED -> UNSHARDING -> UNSHARDED.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import torch.distributed as dist

__all__ = ["RootPhase", "ShardedState", "TrainingState", "check_state"]


class ShardedState(enum.Enum):
    """Which form of its parameters a unit's modules hold."""

    SHARDED = enum.auto()  # the sharded parameters; no unsharded storage allocated
    UNSHARDING = enum.auto()  # storage allocated, all-gathers issued and not yet waited
    UNSHARDED = enum.auto()  # the unsharded parameters (views of the gathered buffers)


class TrainingState(enum.Enum):
    """Where a unit is in the current step."""

    IDLE = enum.auto()  # between its forward and its backward, or between steps
    FORWARD = enum.auto()  # inside its forward
    PRE_BACKWARD = enum.auto()  # its backward has started (gradients flowing in)
    POST_BACKWARD = enum.auto()  # its backward is done; its reduce-scatter is issued


class RootPhase(enum.Enum):
    """Where the whole model is, as the root sees it."""

    FIRST_FORWARD = enum.auto()  # before the first forward ends: the unit order is recorded
    READY = enum.auto()  # the order is known: forwards prefetch; no backward is running
    BACKWARD = enum.auto()  # inside a backward: its end-of-backward callback is queued


def check_state(
    current: enum.Enum, expected: enum.Enum | Iterable[enum.Enum], *, unit: str
) -> None:
    """Raise unless ``current`` is (one of) ``expected``: a bug in the runtime or a use it
    does not support (e.g. a forward of an inner unit outside the root's)."""
    allowed = (expected,) if isinstance(expected, enum.Enum) else tuple(expected)
    if current in allowed:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    names = " or ".join(s.name for s in allowed)
    raise RuntimeError(
        f"raggedfsdp: rank {rank}: unit {unit!r} is in state {current.name}, expected {names}"
    )
