"""What FSDP2's ``set_*`` methods set on one unit, and what every unit under one root shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ._metrics import RuntimeStats
from ._pool import BufferPool
from ._reduce import ReduceQueue
from ._streams import Streams
from .compression import NonFiniteCheck

__all__ = ["Knobs", "SharedResources"]


@dataclass
class Knobs:
    """What FSDP2's ``FSDPModule.set_*`` methods set on one unit."""

    #: reduce the gradients in the next backward (off: accumulate them unsharded, no_sync)
    requires_gradient_sync: bool = True
    #: free the unsharded parameters at the end of backward
    reshard_after_backward: bool = True
    #: HSDP: all-reduce the reduced shards over the replicas in this backward (off: they
    #: accumulate until a backward with it on adds them in)
    requires_all_reduce: bool = True
    #: the reduced gradient is the sum over the data-parallel ranks divided by this (``None``:
    #: the number of data-parallel ranks under the root, a mean; beside expert parallelism more
    #: than the unit's own, [Note: units on different meshes] in ``_data_parallel.py``)
    gradient_divide_factor: float | None = None
    #: gather the parameters for backward (off: the unit's backward needs none, e.g. an
    #: embedding, whose weight gradient comes from its inputs and output gradient alone)
    unshard_in_backward: bool = True
    #: every rank runs the same units and uses the same parameters in every step (read on the
    #: root): no agreement at the start of backward ([Note: ranks whose graphs differ])
    static_graph: bool = False
    #: FSDP2's ``set_all_reduce_hook``: called on each reduced gradient shard, in place
    #: (``_reduce.run_all_reduce_hook``), in ``all_reduce_hook_stream`` where one is given
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    all_reduce_hook_stream: Any = None


@dataclass(frozen=True)
class SharedResources:
    """What every unit under one root shares, made once by the root at lazy init."""

    stats: RuntimeStats  # counters of every unit, reset by model.reset_stats()
    reduce_queue: ReduceQueue  # the order in which reductions in flight are finished
    pool: BufferPool  # scratch blocks reused from unit to unit (group_level=True)
    unpooled: BufferPool  # the same, freeing every block at once (group_level=False)
    streams: Streams  # the communication streams and their events (_streams.py)
    #: what compressed collectives found non-finite, read at the end of forward and backward
    non_finite: NonFiniteCheck = field(default_factory=NonFiniteCheck)

    @classmethod
    def new(cls, device: torch.device | None = None) -> SharedResources:
        """``device``: the compute device, on which the stats time communication."""
        stats = RuntimeStats(device=device)
        streams = Streams(device if device is not None else torch.device("cpu"))
        pools = BufferPool(stats, streams=streams), BufferPool(stats, retain=False, streams=streams)
        return cls(stats, ReduceQueue(), *pools, streams)
