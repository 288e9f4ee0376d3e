"""Gradient reductions in flight, and the order in which they are finished.

A unit issues the reduce-scatters of all its buckets together; its parameter group owns and finishes
them. The :class:`ReduceQueue`, shared by every unit of a model, only decides *when*: before a unit
issues its own, earlier units' are finished (oldest first) until fewer than ``depth`` units have any
in flight, so their buffers are back in the pool for this unit to reuse. By then they have had a
whole unit's backward to complete (under HSDP, so has the replicas' all-reduce a finished
reduce-scatter issues).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from ._streams import Streams

__all__ = ["ReduceQueue", "Reducing", "run_all_reduce_hook"]


class Reducing(Protocol):
    """What the queue asks of a unit with reductions in flight (its parameter group)."""

    def finish_reduce_scatter(self) -> bool:
        """Wait for the reduce-scatters; ``True`` when all-reduces over replicas follow."""
        ...

    def finish_reduce(self) -> None:
        """Wait for those all-reduces; the reduced shards become the sharded gradients."""
        ...


class ReduceQueue:
    """Units with reductions in flight, in the order they issued them (see the module doc)."""

    def __init__(self, depth: int = 1) -> None:
        self.depth = depth
        self._scattering: deque[Reducing] = deque()  # reduce-scatters in flight
        self._replicating: deque[Reducing] = deque()  # HSDP all-reduces in flight

    def make_room(self) -> None:
        """Finish the oldest reductions until fewer than ``depth`` units have any in flight."""
        while len(self._replicating) >= self.depth:
            self._replicating.popleft().finish_reduce()
        while len(self._scattering) >= self.depth:
            self._scattered(self._scattering.popleft())

    def push(self, group: Reducing) -> None:
        """``group`` has just issued its reduce-scatters."""
        self._scattering.append(group)

    def finish(self, group: Reducing) -> None:
        """Finish ``group``'s reductions now, and those issued before them (oldest first), so
        that it may reduce again: its backward runs a second time in this backward (a model run
        forward twice before one backward)."""
        while group in self._scattering:
            self._scattered(self._scattering.popleft())
        while group in self._replicating:
            self._replicating.popleft().finish_reduce()

    def clear(self) -> None:
        """Forget every unit (their reductions were waited for and dropped by their groups:
        ``FSDPParamGroup.reset``)."""
        self._scattering.clear()
        self._replicating.clear()

    def drain(self) -> None:
        """Finish every reduction (end of backward)."""
        while self._scattering:
            self._scattered(self._scattering.popleft())
        while self._replicating:
            self._replicating.popleft().finish_reduce()

    def _scattered(self, group: Reducing) -> None:
        if group.finish_reduce_scatter():  # an all-reduce over the replicas is now in flight
            self._replicating.append(group)
        else:
            group.finish_reduce()


def run_all_reduce_hook(
    hook: Callable[[torch.Tensor], None] | None,
    stream: Any,
    output: torch.Tensor,
    streams: Streams,
) -> None:
    """FSDP2's all-reduce hook (``FSDPModule.set_all_reduce_hook``) on ``output``, one reduced
    gradient shard (a bucket's: once per bucket of the unit, where FSDP2 calls it once per
    parameter group), in place: after its reduce-scatter and, under HSDP, the all-reduce over
    the replicas, before the divide factor's rescaling, where FSDP2 calls it. In ``stream`` where
    one is given (a 1-D mesh on an accelerator): it waits for the reduction, and the reduction's
    stream for it."""
    if hook is None:
        return
    if stream is None or streams.host:
        hook(output)
        return
    streams.wait(streams.record(), stream)
    with streams.use(stream):
        hook(output)
    streams.wait(streams.record(stream))
