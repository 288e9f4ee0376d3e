"""Each FSDP unit's buckets at one world size, from the plans: the bytes a unit holds and moves.

:class:`UnitBytes` is what the cost model knows of a unit (its buckets' shards, which train, its
FSDP group); :func:`unit_bytes` groups a model's plans into them, as the runtime groups buckets.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..facts.systems import System, storage_aligned
from ..planner import ShardPlan
from .step_shape import StepShape

__all__ = ["UnitBytes", "unit_bytes", "unit_path"]


@dataclass(frozen=True)
class UnitBytes:
    """One FSDP unit's buckets at one world size; element counts are per rank."""

    path: str  # "" for the root
    shards: tuple[int, ...]  # each bucket's S
    trainable: tuple[bool, ...]  # whether each bucket requires grad
    #: FSDP2's ``Shard(0)``: the sum over parameters of ``ceil(dim0 / W)`` rows
    dim0_shard_numel: int
    param_numel: int  # elements of the unit's parameters
    #: each bucket's message bytes under compression (:func:`.wire.message_bytes`); () without
    messages: tuple[int, ...] = ()
    #: the ranks its FSDP group shards it over (its plans' ``W``); ``None``: the run's world
    #: size. Under expert parallelism the routed experts' units are sharded over fewer ranks
    #: than the rest (:mod:`.parallel`), so every ``W`` of a formula is the unit's own.
    world_size: int | None = None
    #: bytes of the unit's parameters held outside its buckets once all-gathered: tensor
    #: subclasses that follow FSDP2's protocol (``runtime/_subclass.py``), an NF4 base as its
    #: codes and scales (:func:`.lora.lora_units`); frozen, so no gradient
    subclass_bytes: int = 0

    def group(self, world_size: int) -> int:
        """The ranks the unit is sharded over in a run of ``world_size``."""
        return self.world_size if self.world_size is not None else world_size

    @property
    def buckets(self) -> int:
        return len(self.shards)

    @property
    def trainable_buckets(self) -> int:
        """The buckets that require grad: the ones reduce-scattered."""
        return sum(self.trainable)

    @property
    def shard_numel(self) -> int:
        return sum(self.shards)

    @property
    def trainable_shard_numel(self) -> int:
        return sum(s for s, t in zip(self.shards, self.trainable, strict=True) if t)

    @property
    def trainable_messages(self) -> int:
        """Message bytes of the trainable buckets (under compression)."""
        return sum(m for m, t in zip(self.messages, self.trainable, strict=True) if t)

    def shard(self, system: System) -> int:
        """Elements the rank holds of the unit under ``system``: the plan's ``S`` of each
        bucket, or each parameter's padded dim-0 rows."""
        return self.shard_numel if system.ragged else self.dim0_shard_numel

    def trainable_shard(self, system: System) -> int:
        """Elements of the rank's shard that train (gradients, reduce-scatter): the trainable
        buckets' ``S``, or the whole padded shard of a unit that trains at all (a padded
        layout has no buckets to tell apart)."""
        if system.ragged:
            return self.trainable_shard_numel
        return self.dim0_shard_numel if self.trainable_shard_numel else 0

    def gather_bytes(self, system: System, step: StepShape) -> int:
        """What the rank feeds one all-gather of the unit: its shard in the communication
        dtype, or its messages when ``system`` compresses the all-gather."""
        compression = system.compression(step.compression)
        if compression is not None and compression.all_gather is not None:
            return sum(self.messages)
        return self.shard(system) * step.param_dtype.itemsize

    def scatter_share(self, system: System, step: StepShape) -> int:
        """What the rank sends each peer in the unit's reduce-scatter: the trainable shard's
        worth, or its messages when ``system`` compresses the reduce-scatter."""
        compression = system.compression(step.compression)
        if compression is not None and compression.reduce_scatter is not None:
            return self.trainable_messages
        return self.trainable_shard(system) * step.param_dtype.itemsize

    def within(self, size: int, world_size: int) -> UnitBytes:
        """The unit as ``reshard_after_forward=size`` keeps it after forward: each bucket's
        gathered buffer (``W S``) cut into ``size`` pieces, one per rank of a group of ``size``
        consecutive ranks, which backward's all-gather within that group refills
        (``runtime/_reshard_to.py``; FSDP2's post-forward mesh). Its ``shards`` are the pieces,
        its group the ``size`` ranks."""
        w = self.group(world_size)
        if size < 1 or w % size:
            raise ValueError(
                f"reshard_after_forward={size} is not a factor of the {w} ranks unit "
                f"{self.path or '<root>'!r} is sharded over; use a factor of {w}"
            )
        return dataclasses.replace(
            self,
            shards=tuple(w * s // size for s in self.shards),
            dim0_shard_numel=w * self.dim0_shard_numel // size,
            messages=(),
            world_size=size,
        )

    def storage_bytes(self, world_size: int, itemsize: int, *, trainable: bool = False) -> int:
        """Bytes of the unit's unsharded storage (``trainable``: its gradient block): every
        bucket's ``W S`` elements (``W`` its group's, :meth:`group`), each started on
        :data:`~raggedfsdp.facts.STORAGE_ALIGN` bytes."""
        w = self.group(world_size)
        return sum(
            storage_aligned(w * s * itemsize)
            for s, t in zip(self.shards, self.trainable, strict=True)
            if t or not trainable
        )


def unit_path(bucket_name: str) -> str:
    """``<unit path>/<dtype>[/frozen]/<i>`` -> the unit's path (``""`` for the root)."""
    path = bucket_name.rsplit("/", 3 if "/frozen/" in bucket_name else 2)[0]
    return "" if path == "<root>" else path


def unit_bytes(
    plans: Sequence[ShardPlan], messages: Sequence[int] | None = None
) -> list[UnitBytes]:
    """Group the plans by unit (plan order: nested units first, the root last); a bucket is
    trainable unless its name says ``/frozen/`` (:mod:`raggedfsdp.planner.bucketing`).
    ``messages``: each plan's message bytes under compression (:func:`.wire.message_bytes`).
    Each unit is sharded over its plans' world size."""
    units: dict[str, tuple[list[int], list[bool], list[int], list[int]]] = {}
    worlds: dict[str, int] = {}
    sizes = messages if messages is not None else [0] * len(plans)
    for plan, message in zip(plans, sizes, strict=True):
        path = unit_path(plan.name)
        if worlds.setdefault(path, plan.world_size) != plan.world_size:
            raise ValueError(f"unit {path!r} has buckets planned at different world sizes")
        shards, trainable, numels, codes = units.setdefault(path, ([], [], [0, 0], []))
        shards.append(plan.shard_numel)
        trainable.append("/frozen/" not in plan.name)
        codes.append(message)
        numels[1] += plan.param_numel
        for entry in plan.entries.values():
            # FSDP2's Shard(0): ceil(dim0 / W) rows on every rank (``report.fsdp2_param_split``)
            rows, *rest = entry.shape or (1,)
            numels[0] += -(-rows // plan.world_size) * math.prod(rest)
    return [
        UnitBytes(
            path,
            tuple(shards),
            tuple(trainable),
            *numels,
            tuple(codes) if messages else (),
            worlds[path],
        )
        for path, (shards, trainable, numels, codes) in units.items()
    ]
