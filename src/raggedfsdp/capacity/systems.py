"""The systems the cost model compares, each a frozen description of how it lays out, moves and
keeps a unit's bytes: raggedfsdp (:data:`RAGGEDFSDP`) and PyTorch's FSDP2 (:data:`FSDP2`) on
the same shapes.

The memory (:mod:`.cost`) and time (:mod:`.steptime`) formulas are written once and read these
fields, so a difference between the systems is stated here, with the runtime code it comes
from, and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..planner.quant_blocks import Compression
from .hardware import Hardware

__all__ = [
    "FSDP2",
    "RAGGEDFSDP",
    "SYSTEMS",
    "GlooReduceScatter",
    "HostCopies",
    "System",
    "as_system",
]


class GlooReduceScatter(Enum):
    """How a system reduce-scatters where the backend has no reduce-scatter of its own (Gloo:
    :attr:`Hardware.native_reduce_scatter` off, :attr:`StepShape.gloo <.cost.StepShape>` on)."""

    POINT_TO_POINT = "point-to-point"
    """Each rank sends chunk ``k`` to rank ``k`` and the owner sums in rank order
    (``runtime/_collectives.py``, [Note: reduce-scatter on Gloo]): the ring's bytes, a receive
    buffer of ``(W - 1) S`` elements while it is in flight, and one cached 0-d divisor."""

    ALL_REDUCE = "all-reduce"
    """torch's Gloo ``reduce_scatter``: an all-reduce of a clone of the whole gradient, so twice
    the ring's steps and bytes."""


class HostCopies(Enum):
    """Where a system issues CPU offload's copies: shards host to device before their
    all-gather, reduced shards device to host after their reduce-scatter."""

    COMPUTE_STREAM = "compute stream"
    """On the compute stream (``runtime/_offload.py``: raggedfsdp has no stream of its own):
    each copy adds its whole time to the step. Under a cast the shard is copied as it is into a
    pooled master-dtype buffer, one per shard size until backward ends, and cast into its
    slot."""

    COLLECTIVE_STREAMS = "collective streams"
    """On the all-gather copy-in and post-reduce streams (FSDP2, ``_fsdp_collectives.py``): a
    copy runs in series with its collective, beside the compute. The prefetched unit's copied
    shards (and their cast) live until its copy-in (``_fsdp_param.py``:
    ``all_gather_inputs``)."""


@dataclass(frozen=True, kw_only=True)
class System:
    """One FSDP implementation as the cost model sees it.

    Attributes:
        name: how reports and tables name it.
        ragged: shards as the structure-aware plan places them: each bucket's ``S`` elements
            per rank, every unit whole (:class:`~raggedfsdp.planner.ShardPlan`). Off: FSDP2's
            ``Shard(0)``, each parameter's dim 0 padded to ``ceil(dim0 / W)`` rows per rank.
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
        compresses: honours :class:`raggedfsdp.CommCompression`: its collectives move codes and
            scales, quantizing costs memory traffic, the quantized shards and residuals are
            memory. Needs ``ragged`` (the plan keeps quantization blocks whole).
        gloo_reduce_scatter: its reduce-scatter where the backend has none.
        host_copies: where its CPU offload copies run.
    """

    name: str
    ragged: bool
    zero_copy: bool
    collective_per_bucket: bool
    keeps_last_block_unsharded: bool
    compresses: bool
    gloo_reduce_scatter: GlooReduceScatter
    host_copies: HostCopies

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

    def compression(self, compression: Compression | None) -> Compression | None:
        """The step's compression as this system applies it (``None``: it moves full shards)."""
        return compression if self.compresses else None

    def reduce_scatter_passes(self, hw: Hardware) -> int:
        """Ring passes of one reduce-scatter on ``hw``: 2 where it all-reduces for want of a
        reduce-scatter (:attr:`GlooReduceScatter.ALL_REDUCE`), else 1."""
        all_reduce = self.gloo_reduce_scatter is GlooReduceScatter.ALL_REDUCE
        return 2 if all_reduce and not hw.native_reduce_scatter else 1

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
    host_copies=HostCopies.COMPUTE_STREAM,
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
    host_copies=HostCopies.COLLECTIVE_STREAMS,
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
