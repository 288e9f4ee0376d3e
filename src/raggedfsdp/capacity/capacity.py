"""Will it fit, and how fast: a model planned at a world size and costed for raggedfsdp and for
FSDP2 on the same shapes (memory per rank, bytes per step, step time), against a
:class:`~.hardware.Hardware` with a memory reserve.

The logic behind ``raggedfsdp plan --gpu ...`` and the preflight of ``raggedfsdp train``; pure
Python over shapes. Memory comes from :mod:`.cost`, time from :mod:`.steptime`, what a model
computes and keeps from :mod:`.shapes`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..layout import BlockSize, RaggedShard
from ..models import build_model
from ..planner import Bucket, StructAwarePlanner, model_buckets
from ..planner.quant_blocks import Compression
from .cost import (
    OPTIMIZERS,
    MemoryBreakdown,
    StepShape,
    memory_breakdown,
    optimizer_state_bytes,
    unit_bytes,
)
from .hardware import Hardware
from .shapes import EXPERTS_PER_TOKEN, ModelShape, model_shape
from .steptime import CollectiveBytes, StepTime, collective_bytes, step_time
from .systems import RAGGEDFSDP, SYSTEMS
from .wire import message_bytes

__all__ = [
    "DEFAULT_RESERVE",
    "CapacityOptions",
    "CapacityReport",
    "SystemCost",
    "UnshardableWorld",
    "WorldCapacity",
    "capacity_report",
    "plan_capacity",
]

#: Device memory kept free for what the model does not see: the allocator's fragmentation,
#: the communication library's buffers, the CUDA context (the seed's "10% in reserve").
DEFAULT_RESERVE = 0.1

#: World sizes tried when looking for the smallest one that fits: powers of two.
_SEARCH_LIMIT = 16384


@dataclass(frozen=True, kw_only=True)
class CapacityOptions:
    """How the model is trained.

    Attributes:
        batch: sequences per rank per step.
        seq_len: tokens per sequence.
        optimizer: one of :data:`~.cost.OPTIMIZERS`.
        checkpointing: activation checkpointing of every block.
        block_size: the :class:`RaggedShard` block.
        buffer_size: bucket cap in bytes (``None``: one bucket per FSDP unit).
        param_dtype: what the blocks compute and the collectives move in (mixed precision).
        reduce_dtype: what the gradients are reduced in (``MixedPrecisionPolicy.reduce_dtype``;
            ``None``: ``param_dtype``); another dtype adds the cast of a unit's gradients while
            its reduce-scatter is in flight (fp32 of bf16: 3.4 GB for a Llama-70B layer).
        reserve: fraction of device memory kept free.
        compression: compressed communication of raggedfsdp (a :class:`raggedfsdp.
            CommCompression` or :class:`~.wire.CompressionSpec`): the plan keeps its
            quantization blocks whole, the collectives move codes and scales, the residuals and
            quantized shards count in memory and quantizing in the step time. FSDP2 beside it
            stays uncompressed.
        offload: CPU offload (``CPUOffloadPolicy``) for both systems: shards, gradients and
            optimizer state on the host, host <-> device copies over PCIe, the optimizer step
            on the host; ``fits`` is then the device's peak. Needs a preset with a host link.
        pin_memory: the policy's ``pin_memory`` (reported; the model gives pinned and pageable
            copies the same PCIe bandwidth, docs/capacity.md).
    """

    batch: int
    seq_len: int
    optimizer: str = "adamw"
    checkpointing: bool = False
    block_size: BlockSize = None
    buffer_size: int | None = None
    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = None
    reserve: float = DEFAULT_RESERVE
    compression: Compression | None = None
    offload: bool = False
    pin_memory: bool = False

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {self.optimizer!r}; known: {', '.join(OPTIMIZERS)}"
            )
        if not 0 <= self.reserve < 1:
            raise ValueError(f"reserve must be a fraction in [0, 1), got {self.reserve!r}")

    def step(self, hw: Hardware) -> StepShape:
        return StepShape(
            batch=self.batch,
            seq_len=self.seq_len,
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            checkpointing=self.checkpointing,
            gloo=hw.name == "cpu-gloo",
            compression=self.compression
            if self.compression is not None and self.compression.enabled
            else None,
            offload=self.offload,
        )


@dataclass(frozen=True)
class SystemCost:
    """One system at one world size."""

    memory: MemoryBreakdown
    bytes: CollectiveBytes
    time: StepTime
    #: peak <= (1 - reserve) x device memory (the device's peak under offload), and under
    #: offload ``host_fits`` too
    fits: bool
    host_per_node: int = 0  # under offload: the host bytes of a node's ranks together
    #: under offload: host_per_node <= (1 - reserve) x the node's host RAM (where known)
    host_fits: bool = True


@dataclass(frozen=True)
class WorldCapacity:
    world_size: int
    plan_seconds: float  # planning and costing, wall clock
    systems: dict[str, SystemCost]  # by the name of each of :data:`~.systems.SYSTEMS`


@dataclass(frozen=True)
class CapacityReport:
    model: str
    hardware: Hardware
    options: CapacityOptions
    param_numel: int
    worlds: tuple[WorldCapacity, ...]
    #: the smallest power of two W (up to 16,384) at which raggedfsdp fits, or None
    smallest_world: int | None
    #: under offload, the same search without it (None otherwise, or when none fits)
    smallest_world_without_offload: int | None = None

    @property
    def usable_bytes(self) -> int:
        return int(self.hardware.memory_bytes * (1 - self.options.reserve))

    @property
    def usable_host_bytes(self) -> int | None:
        """A node's host RAM less the reserve (``None``: the preset has no figure)."""
        ram = self.hardware.host_memory_bytes
        return None if ram is None else int(ram * (1 - self.options.reserve))


class UnshardableWorld(ValueError):
    """More ranks than some bucket has policy blocks."""


def _check_shardable(
    planner: StructAwarePlanner, buckets: Sequence[Bucket], world_size: int
) -> None:
    """Each bucket has at least ``world_size`` policy blocks: with fewer, some rank holds
    nothing of it whatever the plan, and the extra ranks only add padding. Counted from the
    shapes before any planning, so a world size too large is refused at once, naming the
    largest the model supports."""
    for bucket in buckets:
        blocks = sum(
            -(-p.numel() // planner.unit_numel(name, tuple(p.shape)))
            for name, p in bucket.params.items()
            if p.numel()
        )
        if blocks < world_size:
            raise UnshardableWorld(
                f"W={world_size:,} is more ranks than bucket {bucket.name!r} has blocks "
                f"({blocks:,} under this block size): some rank would hold none of it. Use W <= "
                f"{blocks:,} or a smaller --block-size"
            )


def plan_capacity(
    module: nn.Module,
    shape: ModelShape,
    world_size: int,
    hw: Hardware,
    options: CapacityOptions,
) -> WorldCapacity:
    """Plan ``module`` (master dtype, best on meta) at ``world_size`` and cost both systems."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be an integer >= 1, got {world_size!r}")
    if options.offload:
        hw.offload_rates(world_size)  # raises for a preset without a host link
    start = time.perf_counter()
    step = options.step(hw)
    policy = RaggedShard(block_size=options.block_size)
    planner = StructAwarePlanner(
        optimizer_type=None if options.optimizer == "adamw" else options.optimizer,  # type: ignore[arg-type]
        shard_policy=policy,
        compression=step.compression,
    )
    buckets = model_buckets(
        module, param_dtype=options.param_dtype, buffer_size=options.buffer_size
    )
    _check_shardable(planner, buckets, world_size)
    plans = [planner.plan_bucket(bucket, world_size) for bucket in buckets]
    messages = None
    if step.compression is not None:
        messages = [message_bytes(p, policy, step.compression.block_size) for p in plans]
    units = unit_bytes(plans, messages)
    state = optimizer_state_bytes(plans, options.optimizer)
    usable = hw.memory_bytes * (1 - options.reserve)
    host_usable = (hw.host_memory_bytes or 0) * (1 - options.reserve)
    systems = {}
    for system in SYSTEMS:
        memory = memory_breakdown(shape, units, step, state, world_size=world_size, system=system)
        host_per_node = memory.host * min(world_size, hw.devices_per_node)
        host_fits = hw.host_memory_bytes is None or host_per_node <= host_usable
        systems[system.name] = SystemCost(
            memory=memory,
            bytes=collective_bytes(units, step, world_size, system),
            time=step_time(
                shape, units, step, hw, world_size, optimizer_bytes=state, system=system
            ),
            fits=memory.peak <= usable and host_fits,
            host_per_node=host_per_node,
            host_fits=host_fits,
        )
    return WorldCapacity(world_size, time.perf_counter() - start, systems)


def _smallest_world(
    module: nn.Module, shape: ModelShape, hw: Hardware, options: CapacityOptions
) -> int | None:
    """The smallest power of two at which raggedfsdp fits; ``None`` when even 16,384 ranks do
    not (activations do not shrink with W) or the model cannot be sharded further."""
    w = 1
    while w <= _SEARCH_LIMIT:
        try:
            if plan_capacity(module, shape, w, hw, options).systems[RAGGEDFSDP.name].fits:
                return w
        except UnshardableWorld:
            return None  # more ranks than some bucket has blocks: larger W cannot help
        w *= 2
    return None


def capacity_report(
    model: str | nn.Module,
    world_sizes: Sequence[int],
    hw: Hardware,
    options: CapacityOptions,
    *,
    experts_per_token: int | None = None,
    find_smallest: bool = True,
    model_name: str | None = None,
    up_to_shardable: bool = False,
) -> CapacityReport:
    """Cost ``model`` (a zoo name or a module in its master dtype) at each world size
    (``up_to_shardable``: increasing sizes, stopping at the first the model cannot be sharded
    over instead of raising).

    Raises:
        ValueError: an unknown model (the message lists the zoo), a bad world size, or one the
            model cannot be sharded over; offload on a preset without a host link.
    """
    if isinstance(model, str):
        name, module = model, build_model(model, device="meta")
        experts_per_token = experts_per_token or EXPERTS_PER_TOKEN.get(model)
    else:
        name, module = model_name or type(model).__name__, model
    shape = model_shape(module, experts_per_token=experts_per_token)
    worlds: list[WorldCapacity] = []
    for w in world_sizes:
        try:
            worlds.append(plan_capacity(module, shape, w, hw, options))
        except UnshardableWorld:
            if not up_to_shardable:
                raise
            break
    smallest = _smallest_world(module, shape, hw, options) if find_smallest else None
    plain = None
    if find_smallest and options.offload:
        without = dataclasses.replace(options, offload=False, pin_memory=False)
        plain = _smallest_world(module, shape, hw, without)
    return CapacityReport(
        model=name,
        hardware=hw,
        options=options,
        param_numel=sum(u.param_numel for u in shape.units),
        worlds=tuple(worlds),
        smallest_world=smallest,
        smallest_world_without_offload=plain,
    )
