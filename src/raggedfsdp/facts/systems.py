"""The systems the cost model compares: how each lays out, moves and keeps a unit's bytes.

raggedfsdp (:data:`RAGGEDFSDP`) and PyTorch's FSDP2 (:data:`FSDP2`), each a frozen description. The
capacity planner's memory and time formulas (``capacity/cost.py``, ``capacity/steptime.py``) read
these fields, so a difference between the systems is stated here, with the runtime code it comes
from, and nowhere else. raggedfsdp's description is held to what its runtime records (the stream
log, the collective log, ``stats()``) by ``tests/distributed/test_facts_conformance.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

__all__ = [
    "FSDP2",
    "RAGGEDFSDP",
    "STORAGE_ALIGN",
    "SYSTEMS",
    "GlooReduceScatter",
    "HostCopies",
    "Staging",
    "Stream",
    "System",
    "as_system",
    "storage_aligned",
]

#: raggedfsdp starts each buffer in a unit's storage (a bucket's shard, unsharded block or
#: gradient block) on this many bytes: enough for any dtype and for vector loads.
STORAGE_ALIGN = 256


def storage_aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole :data:`STORAGE_ALIGN`: what a buffer takes in storage."""
    return -(-nbytes // STORAGE_ALIGN) * STORAGE_ALIGN


_T = TypeVar("_T")


class Stream(Enum):
    """The streams a unit tree runs on, by the names ``runtime/_streams.py`` gives them (FSDP2's
    four communication streams beside the compute stream)."""

    COMPUTE = "compute"
    COPY_IN = "all_gather_copy_in"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"


class GlooReduceScatter(Enum):
    """How a system reduce-scatters where the backend has no reduce-scatter of its own (Gloo)."""

    POINT_TO_POINT = "point-to-point"
    """Each rank sends chunk ``k`` to rank ``k`` and the owner sums in rank order
    (``runtime/_collectives.py``, [Note: reduce-scatter on Gloo]): the ring's bytes, a receive
    buffer of ``(W - 1) S`` elements while it is in flight, and one cached 0-d divisor."""

    ALL_REDUCE = "all-reduce"
    """torch's Gloo ``reduce_scatter``: an all-reduce of a clone of the whole gradient, so twice
    the ring's steps and bytes."""


class Staging(Enum):
    """What CPU offload's host-to-device copy holds on the device besides the unsharded
    buffer."""

    POOLED_CAST = "pooled cast buffer"
    """The shard is copied into its own slot of the all-gather buffer; under a cast it is
    copied as it is into a pooled master-dtype buffer and cast into its slot from there, the
    pool keeping one such buffer per shard size until backward ends (raggedfsdp:
    ``runtime/_offload.py``, ``HostOffload.to_device``)."""

    PREFETCHED_SHARDS = "prefetched shards"
    """The prefetched unit's copied shards (and their cast) live until its copy-in (FSDP2:
    ``_fsdp_param.py``, ``all_gather_inputs``)."""


@dataclass(frozen=True)
class HostCopies:
    """Where a system issues CPU offload's copies and what they stage.

    Attributes:
        to_device: the stream the host shard's copy to the device runs on, before its
            all-gather.
        to_host: the stream the reduced shard's copy back runs on, after its reduce-scatter.
        to_host_replicated: the same under HSDP, after the all-reduce over the replicas.
        staging: what the copy to the device holds on the device.
    """

    to_device: Stream
    to_host: Stream
    to_host_replicated: Stream
    staging: Staging


@dataclass(frozen=True, kw_only=True)
class System:
    """One FSDP implementation as the cost model sees it.

    Attributes:
        name: how reports and tables name it.
        ragged: shards as the structure-aware plan places them: each bucket's ``S`` elements
            per rank, every unit whole. Off: FSDP2's ``Shard(0)``, each parameter's dim 0
            padded to ``ceil(dim0 / W)`` rows per rank.
        zero_copy: the all-gather writes the unsharded parameters and the reduce-scatter reads
            the unsharded gradients, both views of one storage per unit (DBuffer). Off: the
            all-gather output is copied out into per-parameter tensors and the gradients
            (autograd's, per parameter) into a padded reduce-scatter input: ``2 x`` the buffer
            read and written at memory bandwidth in each collective's critical path, and those
            buffers beside the unsharded parameters and gradients. Needs ``ragged``.
        collective_per_bucket: one collective per bucket of a unit (``buffer_size`` splits);
            off, one per unit.
        keeps_last_block_unsharded: the unit that runs forward last stays unsharded into its
            backward, which comes first; off, it is resharded after forward and gathered again
            under the head's backward.
        compresses: honours ``raggedfsdp.CommCompression``: its collectives move codes and
            scales, quantizing costs memory traffic, the quantized shards and residuals are
            memory. Needs ``ragged`` (the plan keeps quantization blocks whole).
        gloo_reduce_scatter: its reduce-scatter where the backend has none.
        host_copies: where its CPU offload copies run and what they stage.
        agrees_on_usage: at the start of each backward, one small all-reduce (over
            each dim of the data-parallel mesh) of which parameters any rank used, so that one
            no rank used keeps ``.grad = None`` (``runtime/_usage.py``); off, none.
    """

    name: str
    ragged: bool
    zero_copy: bool
    collective_per_bucket: bool
    keeps_last_block_unsharded: bool
    compresses: bool
    gloo_reduce_scatter: GlooReduceScatter
    host_copies: HostCopies
    agrees_on_usage: bool

    def __post_init__(self) -> None:
        for need in ("zero_copy", "compresses"):
            if getattr(self, need) and not self.ragged:
                raise ValueError(
                    f"system {self.name!r}: {need} needs ragged shards (one planned buffer per "
                    f"bucket)"
                )

    def collective_calls(self, buckets: int) -> int:
        """Collectives of one kind for a unit of ``buckets`` buckets."""
        return buckets if self.collective_per_bucket else 1

    def regathered(self, num_blocks: int) -> range:
        """The blocks (units before the root) all-gathered again for their backward."""
        return range(num_blocks if not self.keeps_last_block_unsharded else num_blocks - 1)

    def compression(self, compression: _T | None) -> _T | None:
        """The step's compression as this system applies it (``None``: it moves full shards)."""
        return compression if self.compresses else None

    def reduce_scatter_passes(self, native_reduce_scatter: bool) -> int:
        """Ring passes of one reduce-scatter on a backend with (``native_reduce_scatter``) or
        without a reduce-scatter of its own: 2 where it all-reduces for want of one
        (:attr:`GlooReduceScatter.ALL_REDUCE`), else 1."""
        all_reduce = self.gloo_reduce_scatter is GlooReduceScatter.ALL_REDUCE
        return 2 if all_reduce and not native_reduce_scatter else 1

    def reduces_point_to_point(self, gloo: bool) -> bool:
        """Whether its reduce-scatter is point-to-point transfers here (on Gloo, ``gloo``):
        then one in flight holds a receive buffer, and the rank a cached divisor
        (:attr:`GlooReduceScatter.POINT_TO_POINT`)."""
        return gloo and self.gloo_reduce_scatter is GlooReduceScatter.POINT_TO_POINT


RAGGEDFSDP = System(
    name="raggedfsdp",
    ragged=True,
    zero_copy=True,
    collective_per_bucket=True,
    keeps_last_block_unsharded=True,
    compresses=True,
    gloo_reduce_scatter=GlooReduceScatter.POINT_TO_POINT,
    # runtime/_param_group.py: the copy-in (HostOffload.to_device) inside the copy-in stream's
    # block of unshard, the copy back (take_reduced) inside finish_reduce, on the stream that
    # finished the reduction ([Note: streams and events] in runtime/_streams.py)
    host_copies=HostCopies(
        to_device=Stream.COPY_IN,
        to_host=Stream.REDUCE_SCATTER,
        to_host_replicated=Stream.ALL_REDUCE,
        staging=Staging.POOLED_CAST,
    ),
    agrees_on_usage=True,
)
"""raggedfsdp as its runtime runs by default (``DBufferConfig(zero_copy=True)``)."""

FSDP2 = System(
    name="fsdp2",
    ragged=False,
    zero_copy=False,
    collective_per_bucket=False,
    keeps_last_block_unsharded=False,
    compresses=False,
    gloo_reduce_scatter=GlooReduceScatter.ALL_REDUCE,
    # _fsdp_collectives.py: foreach_all_gather's inputs made on the all-gather copy-in stream,
    # foreach_reduce's copy to the host on its post-reduce stream (the all-reduce stream under
    # HSDP)
    host_copies=HostCopies(
        to_device=Stream.COPY_IN,
        to_host=Stream.REDUCE_SCATTER,
        to_host_replicated=Stream.ALL_REDUCE,
        staging=Staging.PREFETCHED_SHARDS,
    ),
    agrees_on_usage=False,
)
"""PyTorch FSDP2 (``fully_shard`` on each block, then the root) with its defaults."""

SYSTEMS: tuple[System, ...] = (RAGGEDFSDP, FSDP2)
"""The systems a capacity report costs, in the order its tables show them."""

_BY_NAME = {system.name: system for system in SYSTEMS}


def as_system(system: System | str) -> System:
    """``system`` itself, or the one of :data:`SYSTEMS` with that name."""
    if isinstance(system, System):
        return system
    if system not in _BY_NAME:
        raise ValueError(f"unknown system {system!r}: expected one of {', '.join(_BY_NAME)}")
    return _BY_NAME[system]
