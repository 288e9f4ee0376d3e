"""Will it fit, and how fast: a model planned at a world size and costed for raggedfsdp and FSDP2.

Memory per rank, bytes per step and step time against a :class:`~.hardware.Hardware` with a memory
reserve: the logic behind ``raggedfsdp plan --gpu ...`` and the preflight of ``raggedfsdp train``;
pure Python over shapes. Under tensor and expert parallelism each rank's pieces are planned over
their FSDP groups (:mod:`.parallel`), and :func:`search_mesh` finds the ``(dp, tp, ep)`` that fit a
number of devices.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..facts import ParallelDims
from ..facts.systems import RAGGEDFSDP, SYSTEMS, System
from ..layout import BlockSize, RaggedShard
from ..models import build_model
from ..planner import Bucket, ShardPlan, StructAwarePlanner, model_buckets
from ..planner.quant_blocks import Compression
from .cost import OPTIMIZERS, MemoryBreakdown, memory_breakdown, optimizer_state_bytes
from .hardware import Hardware
from .parallel import ModelSplit, UnsplittableModel, split_model
from .parallel_comm import ParallelBytes, parallel_bytes, with_parallel_time
from .parts import PartCost, part_costs
from .shapes import EXPERTS_PER_TOKEN, ModelShape, model_shape
from .step_shape import StepShape
from .steptime import CollectiveBytes, StepTime, collective_bytes, step_time
from .units import UnitBytes, unit_bytes
from .wire import message_bytes

__all__ = [
    "DEFAULT_RESERVE",
    "CapacityOptions",
    "CapacityReport",
    "MeshFit",
    "MeshSearch",
    "SystemCost",
    "UnshardableWorld",
    "WorldCapacity",
    "capacity_planner",
    "capacity_report",
    "divisors",
    "plan_buckets",
    "plan_capacity",
    "search_mesh",
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
        tp: tensor-parallel degree (:mod:`.parallel`: ``batch`` is then the sequences of a
            tensor-parallel group, which its ``tp`` devices share).
        ep: expert-parallel degree, borrowed from the data-parallel ranks.
        reshard_after_forward: ``fully_shard(block, reshard_after_forward=N)`` on every block
            for both systems (:attr:`~.cost.StepShape.reshard_after_forward`); ``None``: the
            default, ``True``. Like the runtime, only where every unit is sharded over the
            whole world (no ``tp`` or ``ep``).
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
    tp: int = 1
    ep: int = 1
    reshard_after_forward: int | None = None

    def __post_init__(self) -> None:
        ParallelDims(tp=self.tp, ep=self.ep)  # positive integers
        if self.reshard_after_forward is not None and self.dims.model_parallel > 1:
            raise ValueError(
                f"reshard_after_forward={self.reshard_after_forward} with tp={self.tp}, "
                f"ep={self.ep}: raggedfsdp keeps pieces within groups of ranks only where a "
                f"unit's mesh spans every rank (runtime/_reshard_to.py); use tp=1, ep=1"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {self.optimizer!r}; known: {', '.join(OPTIMIZERS)}"
            )
        if not 0 <= self.reserve < 1:
            raise ValueError(f"reserve must be a fraction in [0, 1), got {self.reserve!r}")

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(tp=self.tp, ep=self.ep)

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
            reshard_after_forward=self.reshard_after_forward,
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
    #: a vision-language model's vision side and language model apart (:mod:`.parts`); () else
    parts: tuple[PartCost, ...] = ()
    #: under offload: host_per_node <= (1 - reserve) x the node's host RAM (where known)
    host_fits: bool = True


@dataclass(frozen=True)
class WorldCapacity:
    world_size: int
    plan_seconds: float  # planning and costing, wall clock
    systems: dict[str, SystemCost]  # by the name of each of :data:`~raggedfsdp.facts.SYSTEMS`
    dims: ParallelDims = dataclasses.field(default_factory=ParallelDims)
    #: tensor and expert parallelism's traffic per rank (the same for both systems; their
    #: seconds are in each system's step time); ``None`` without them
    parallel: ParallelBytes | None = None

    @property
    def dp(self) -> int:
        """The experts' FSDP degree, ``W / (tp x ep)`` (every parameter's without experts)."""
        return self.dims.at_world(self.world_size).dp_shard_mod_ep


@dataclass(frozen=True)
class MeshFit:
    """One ``(dp, tp, ep)`` that fits at a world size, and what raggedfsdp costs there."""

    world_size: int
    dp: int
    tp: int
    ep: int
    peak: int  # bytes per device
    step_s: float
    tokens_per_s: float  # per device


@dataclass(frozen=True)
class MeshSearch:
    """The meshes tried at one world size (:func:`search_mesh`).

    Attributes:
        tried: ``(tp, ep)`` pairs the model could be split and sharded by (and so costed).
        smallest: the one that fits with the least model parallelism: smallest ``tp x ep``,
            then the smaller ``tp`` (tensor parallelism's all-reduces are in every layer,
            expert parallelism's all-to-alls only in the MoE layers); ``None``: none fits.
        fastest: the one that fits with the most tokens per second per device (modelled).
    """

    world_size: int
    tried: int
    smallest: MeshFit | None
    fastest: MeshFit | None


@dataclass(frozen=True)
class CapacityReport:
    model: str
    hardware: Hardware
    options: CapacityOptions
    param_numel: int
    worlds: tuple[WorldCapacity, ...]
    #: the smallest power of two W (up to 16,384; ``tp x ep`` times one under tensor or expert
    #: parallelism) at which raggedfsdp fits, or None
    smallest_world: int | None
    #: under offload, the same search without it (None otherwise, or when none fits)
    smallest_world_without_offload: int | None = None
    #: the ``(dp, tp, ep)`` search at each world size, when asked for (:func:`search_mesh`)
    meshes: tuple[MeshSearch, ...] = ()

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
    planner: StructAwarePlanner, buckets: Sequence[Bucket], sizes: Sequence[int], world_size: int
) -> None:
    """Each bucket has at least as many policy blocks as the ranks of its FSDP group
    (``sizes``): with fewer, some rank holds nothing of it whatever the plan, and the extra
    ranks only add padding. Counted from the shapes before any planning, so a world size too
    large is refused at once, naming the largest the model supports."""
    for bucket, size in zip(buckets, sizes, strict=True):
        blocks = sum(
            -(-p.numel() // planner.unit_numel(name, tuple(p.shape)))
            for name, p in bucket.params.items()
            if p.numel()
        )
        if blocks < size:
            who = f"W={size:,}" if size == world_size else f"W={world_size:,} ({size:,} FSDP ranks)"
            raise UnshardableWorld(
                f"{who} is more ranks than bucket {bucket.name!r} has blocks "
                f"({blocks:,} under this block size): some rank would hold none of it. Use W <= "
                f"{blocks * world_size // size:,} or a smaller --block-size"
            )


def capacity_planner(
    options: CapacityOptions, step: StepShape
) -> tuple[StructAwarePlanner, RaggedShard]:
    """The planner ``options`` plan with (and its shard policy): their optimizer, block size
    and compression."""
    policy = RaggedShard(block_size=options.block_size)
    planner = StructAwarePlanner(
        optimizer_type=None if options.optimizer == "adamw" else options.optimizer,  # type: ignore[arg-type]
        shard_policy=policy,
        compression=step.compression,
    )
    return planner, policy


def plan_buckets(
    module: nn.Module,
    planner: StructAwarePlanner,
    split: ModelSplit,
    world_size: int,
    options: CapacityOptions,
) -> list[ShardPlan]:
    """Every bucket of ``module``'s pieces on one rank (``split``'s), each planned over its
    FSDP group of ``world_size``; :class:`UnshardableWorld` where a group is larger than a
    bucket's blocks."""
    buckets = model_buckets(
        module,
        param_dtype=options.param_dtype,
        buffer_size=options.buffer_size,
        wrap=split.wrap_policy,
        local=split.local if split.splits else None,
    )
    sizes = [split.fsdp_size(bucket.name, world_size) for bucket in buckets]
    _check_shardable(planner, buckets, sizes, world_size)
    return [planner.plan_bucket(b, size) for b, size in zip(buckets, sizes, strict=True)]


def _split_for(options: CapacityOptions, split: ModelSplit | None) -> ModelSplit:
    """The split ``plan_capacity`` costs: ``split`` (made for ``options``' degrees), or none."""
    if split is None and options.dims.model_parallel == 1:
        return ModelSplit.whole()
    if split is None or split.dims != options.dims:
        raise ValueError(
            f"tp={options.tp}, ep={options.ep} needs the model's split for them "
            f"(split_model(module, ParallelDims(tp, ep))) and its shape with it"
        )
    return split


def plan_capacity(
    module: nn.Module,
    shape: ModelShape,
    world_size: int,
    hw: Hardware,
    options: CapacityOptions,
    *,
    split: ModelSplit | None = None,
) -> WorldCapacity:
    """Plan ``module`` (master dtype, best on meta) at ``world_size`` and cost both systems.

    Under tensor or expert parallelism (``options.tp``, ``options.ep``) ``split`` is the
    model's :func:`~.parallel.split_model` for them and ``shape`` its
    :func:`~.shapes.model_shape` with it: the buckets hold the rank's pieces, each planned over
    its FSDP group, and the step adds their traffic (:mod:`.parallel_comm`)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be an integer >= 1, got {world_size!r}")
    split = _split_for(options, split)
    options.dims.check_world(world_size)
    if options.offload:
        hw.offload_rates(world_size)  # raises for a preset without a host link
    start = time.perf_counter()
    step = options.step(hw)
    planner, policy = capacity_planner(options, step)
    plans = plan_buckets(module, planner, split, world_size, options)
    messages = None
    if step.compression is not None:
        messages = [message_bytes(p, policy, step.compression.block_size) for p in plans]
    costing = _Costing(
        shape=shape,
        units=unit_bytes(plans, messages),
        step=step,
        state=optimizer_state_bytes(plans, options.optimizer),
        hw=hw,
        world_size=world_size,
        reserve=options.reserve,
        split=split,
        parallel=parallel_bytes(shape, step, hw, split),
        plans=plans,
    )
    systems = {system.name: costing.cost(system) for system in SYSTEMS}
    parallel = costing.parallel if split.splits else None
    return WorldCapacity(world_size, time.perf_counter() - start, systems, options.dims, parallel)


@dataclass(frozen=True, kw_only=True)
class _Costing:
    """One world size's plans, costed for one system at a time."""

    shape: ModelShape
    units: list[UnitBytes]
    step: StepShape
    state: int
    hw: Hardware
    world_size: int
    reserve: float
    split: ModelSplit
    parallel: ParallelBytes
    plans: Sequence[ShardPlan]

    def cost(self, system: System) -> SystemCost:
        hw, w, step = self.hw, self.world_size, self.step
        memory = memory_breakdown(
            self.shape, self.units, step, self.state, world_size=w, system=system
        )
        host_per_node = memory.host * min(w, hw.devices_per_node)
        host_usable = (hw.host_memory_bytes or 0) * (1 - self.reserve)
        host_fits = hw.host_memory_bytes is None or host_per_node <= host_usable
        took = step_time(
            self.shape, self.units, step, hw, w, optimizer_bytes=self.state, system=system
        )
        return SystemCost(
            memory=memory,
            bytes=collective_bytes(self.units, step, w, system),
            time=with_parallel_time(took, self.parallel, step, self.split),
            fits=memory.peak <= hw.memory_bytes * (1 - self.reserve) and host_fits,
            host_per_node=host_per_node,
            host_fits=host_fits,
            parts=part_costs(
                self.plans,
                self.units,
                persistent=memory.persistent,
                step=step,
                world_size=w,
                system=system,
            ),
        )


def _smallest_world(
    module: nn.Module,
    shape: ModelShape,
    hw: Hardware,
    options: CapacityOptions,
    split: ModelSplit | None = None,
) -> int | None:
    """The smallest ``tp x ep x`` a power of two at which raggedfsdp fits (a power of two
    without them); ``None`` when even 16,384 ranks do not (activations do not shrink with W)
    or the model cannot be sharded further."""
    w = options.dims.world_multiple
    while w <= _SEARCH_LIMIT:
        if w % (options.reshard_after_forward or 1):  # groups of N need N to divide W
            w *= 2
            continue
        try:
            cost = plan_capacity(module, shape, w, hw, options, split=split)
        except UnshardableWorld:
            return None  # more ranks than some bucket has blocks: larger W cannot help
        if cost.systems[RAGGEDFSDP.name].fits:
            return w
        w *= 2
    return None


def _smallest_worlds(
    module: nn.Module,
    shape: ModelShape,
    hw: Hardware,
    options: CapacityOptions,
    split: ModelSplit | None,
) -> tuple[int | None, int | None]:
    """The smallest world that fits, and under offload the smallest without it (else None)."""
    smallest = _smallest_world(module, shape, hw, options, split)
    if not options.offload:
        return smallest, None
    without = dataclasses.replace(options, offload=False, pin_memory=False)
    return smallest, _smallest_world(module, shape, hw, without, split)


def _split_and_shape(
    module: nn.Module, options: CapacityOptions, experts_per_token: int | None, name: str
) -> tuple[ModelSplit | None, ModelShape]:
    """The model's split under ``options``' degrees (``None`` without them) and the rank's
    shape with it; the split's checks run here, before any planning."""
    if options.dims.model_parallel == 1:
        return None, model_shape(module, experts_per_token=experts_per_token)
    split = split_model(
        module,
        options.dims,
        policy=RaggedShard(block_size=options.block_size),
        experts_per_token=experts_per_token,
        model_name=name,
    )
    return split, model_shape(module, experts_per_token=experts_per_token, split=split)


def divisors(n: int) -> list[int]:
    """The degrees ``n`` ranks split into evenly, ascending (the layout searches' candidates)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def search_mesh(
    module: nn.Module,
    world_size: int,
    hw: Hardware,
    options: CapacityOptions,
    *,
    experts_per_token: int | None = None,
    model_name: str | None = None,
) -> MeshSearch:
    """Every ``(tp, ep)`` with ``tp x ep`` dividing ``world_size`` and ``tp`` inside a node
    (``hw.devices_per_node``: tensor parallelism's per-layer all-reduces stay on NVLink, as
    Megatron and torchtitan run it), costed for raggedfsdp with ``options`` (its ``tp`` and
    ``ep`` replaced); those the model cannot take (heads, experts, blocks, more ranks than
    blocks) are skipped. Returns the smallest and the fastest (tokens per second per device) that
    fit (:class:`MeshSearch`)."""
    name = model_name or type(module).__name__
    fits, tried = [], 0
    for tp in [d for d in divisors(world_size) if d <= hw.devices_per_node]:
        for ep in divisors(world_size // tp):
            opts = dataclasses.replace(options, tp=tp, ep=ep)
            try:
                split, shape = _split_and_shape(module, opts, experts_per_token, name)
                cost = plan_capacity(module, shape, world_size, hw, opts, split=split)
            except (UnsplittableModel, UnshardableWorld):
                continue
            tried += 1
            ours = cost.systems[RAGGEDFSDP.name]
            if ours.fits:
                fits.append(
                    MeshFit(
                        world_size,
                        cost.dp,
                        tp,
                        ep,
                        ours.memory.peak,
                        ours.time.total_s,
                        ours.time.tokens_per_s,
                    )
                )
    smallest = min(fits, key=lambda f: (f.tp * f.ep, f.tp), default=None)
    # per device: a tensor-parallel group's devices share its tokens, so steps do not compare
    fastest = max(fits, key=lambda f: f.tokens_per_s, default=None)
    return MeshSearch(world_size, tried, smallest, fastest)


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
    search_meshes: bool = False,
) -> CapacityReport:
    """Cost ``model`` (a zoo name or a module in its master dtype) at each world size
    (``up_to_shardable``: increasing sizes, stopping at the first the model cannot be sharded
    over instead of raising), with ``options``' tensor and expert parallelism;
    ``search_meshes``: also :func:`search_mesh` at each world size.

    Raises:
        ValueError: an unknown model (the message lists the zoo), a bad world size, or one the
            model cannot be sharded over; ``tp x ep`` not dividing a world size, a split the
            model cannot take (:class:`~.parallel.UnsplittableModel`), both before any
            planning; offload on a preset without a host link.
    """
    if isinstance(model, str):
        name, module = model, build_model(model, device="meta")
        experts_per_token = experts_per_token or EXPERTS_PER_TOKEN.get(model)
    else:
        name, module = model_name or type(model).__name__, model
    if not up_to_shardable:
        for w in world_sizes:
            options.dims.check_world(w)
    split, shape = _split_and_shape(module, options, experts_per_token, name)
    worlds: list[WorldCapacity] = []
    for w in world_sizes:
        try:
            worlds.append(plan_capacity(module, shape, w, hw, options, split=split))
        except UnshardableWorld:
            if not up_to_shardable:
                raise
            break
    smallest, plain = (None, None)
    if find_smallest:
        smallest, plain = _smallest_worlds(module, shape, hw, options, split)
    meshes = ()
    if search_meshes:
        k = experts_per_token
        meshes = tuple(
            search_mesh(module, w, hw, options, experts_per_token=k, model_name=name)
            for w in world_sizes
        )
    return CapacityReport(
        model=name,
        hardware=hw,
        options=options,
        param_numel=sum(u.param_numel for u in shape.units),
        worlds=tuple(worlds),
        smallest_world=smallest,
        smallest_world_without_offload=plain,
        meshes=meshes,
    )
