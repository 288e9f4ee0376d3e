"""Pipeline parallelism in the capacity model: memory per stage, the bubble, and the search.

A layout ``(dp, tp, pp, ep)`` over ``W = dp x tp x pp`` ranks (``ep`` borrowed from ``dp``, as
without PP). The model is cut torchtitan's way (:func:`stage_layers`), each pipeline rank's stages
are FSDP-sharded over the ``W / pp`` ranks of its stage (the planner's own plans, with tensor and
expert parallelism inside as :mod:`.parallel` splits them), and the schedule
(:class:`~.schedules.PipelineSchedule`) says how many micro-batches' activations are held. What
is costed, term by term, is the comment at :func:`plan_pipeline`. Pure Python over shapes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from torch import nn

from ..facts.systems import RAGGEDFSDP, SYSTEMS, System
from ..layout import RaggedShard
from .capacity import (
    CapacityOptions,
    MeshFit,
    UnshardableWorld,
    capacity_planner,
    divisors,
    plan_buckets,
    search_mesh,
)
from .cost import activation_bytes, buffer_bytes, kept_activation_bytes, optimizer_state_bytes
from .hardware import Hardware
from .parallel import ModelSplit, UnsplittableModel, split_model
from .parallel_comm import parallel_bytes
from .schedules import PipelineSchedule
from .shapes import ModelShape, model_shape
from .stages import StageCut, stage_layers
from .step_shape import StepShape
from .steptime import collective_costs, optimizer_step_s, unit_compute_s
from .units import UnitBytes, unit_bytes

__all__ = [
    "PipelineFit",
    "PipelinePlan",
    "PipelineSearch",
    "RankCost",
    "plan_pipeline",
    "search_pipeline",
]


def _signature(block: nn.Module) -> tuple:
    """What a block's plan depends on: its parameters' names, shapes and dtypes."""
    return tuple(
        (name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in block.named_parameters()
    )


@dataclass(frozen=True)
class RankCost:
    """One pipeline rank's memory per device (bytes) and compute per micro-batch, for one
    system.

    Attributes:
        rank: its place in the pipeline (its stages ``rank, rank + pp, ...``).
        layers: transformer layers it holds (all its stages).
        embedding / head: whether it holds the embedding (the first stage) or the norm and head
            (the last).
        params, grads, optimizer: its shards (master dtype) and optimizer state.
        unsharded: its units' unsharded parameters and gradients, held for the whole step (no
            reshard after forward under PP; gradients accumulate over the micro-batches, in
            the reduce dtype where it differs).
        in_flight: local-stage micro-batches whose activations it holds at its peak.
        activations: their activations at the peak, and the backward's working set.
        peak: the larger of the step's (all of the above but the gradients' shards) and the
            optimizer step's (the persistent bytes).
        forward_s, backward_s: one micro-batch through all its layers; ``recompute_s`` of
            ``backward_s`` is checkpointing's recomputation.
        fsdp_s: its FSDP all-gathers (one per unit, the schedule's UNSHARD) and reduce-scatters
            (one per unit, REDUCE_GRAD) per step, each a ring over the stage's FSDP group.
        parallel_s: tensor and expert parallelism's collectives of all its micro-batches.
        optimizer_s: its optimizer step.
    """

    rank: int
    layers: int
    embedding: bool
    head: bool
    params: int
    grads: int
    optimizer: int
    unsharded: int
    in_flight: int
    activations: int
    peak: int
    forward_s: float
    backward_s: float
    recompute_s: float
    fsdp_s: float
    parallel_s: float
    optimizer_s: float

    @property
    def persistent(self) -> int:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class PipelinePlan:
    """A layout with PP costed for one system: every pipeline rank, the bubble and the step.

    Attributes:
        dims: ``(dp, tp, pp, ep)``; ``dp`` counts the experts' FSDP ranks as without PP
            (``W / (tp x pp x ep)``).
        ranks: each pipeline rank's :class:`RankCost`.
        bubble_s, bubble_fraction: the slowest rank's bubble (:meth:`PipelineSchedule.bubble_s`)
            and its share of compute and bubble.
        p2p_s: the activations and their gradients sent between stages, every micro-batch.
        step_s: the step (comment at :func:`plan_pipeline`).
        tokens_per_s: per device.
        fits: every rank's peak within the device's usable memory.
    """

    system: str
    dims: tuple[int, int, int, int]
    schedule: PipelineSchedule
    ranks: tuple[RankCost, ...]
    bubble_s: float
    bubble_fraction: float
    p2p_s: float
    step_s: float
    tokens_per_s: float
    fits: bool
    plan_seconds: float

    @property
    def peak(self) -> int:
        return max(r.peak for r in self.ranks)


def _options_for(options: CapacityOptions, tp: int, ep: int) -> CapacityOptions:
    return dataclasses.replace(options, tp=tp, ep=ep)


# What a layout with PP costs, per pipeline rank and system (torchtitan's settings, which
# docs/pipeline.md recommends: no reshard after forward, the loss scaled per micro-batch):
#
# - **persistent**: the rank's stages planned over the ``W / pp`` ranks of its FSDP group (each
#   stage's blocks units, and its root: the embedding on the first rank, the norm and head on
#   the last); shards and gradients in the master dtype, the optimizer's state, as without PP.
# - **unsharded for the whole step**: every unit's parameters (gathered at the schedule's
#   UNSHARD, kept to its RESHARD) in the communication dtype, and their gradients
#   (accumulated over the micro-batches, reduce-scattered once, at REDUCE_GRAD) in the reduce
#   dtype (``MixedPrecisionPolicy.reduce_dtype``: raggedfsdp's ``CastReduceScatter.accumulate``,
#   FSDP2's ``unsharded_accumulated_grad``), else the communication dtype. The reduce-scatters'
#   own buffers at the step's end (on Gloo a receive buffer, one unit at a time) are left out.
# - **activations**: ``in_flight / v`` micro-batches' worth of what the rank's blocks keep
#   (:meth:`PipelineSchedule.in_flight`), the one in backward at its working peak (the loss's
#   logits on the last rank): :func:`~.cost.activation_bytes` of one micro-batch, plus what each
#   further one keeps (:func:`~.cost.kept_activation_bytes`).
# - **step**: ``M`` micro-batches of the slowest rank's forward and backward, its bubble, and,
#   on the critical path, its FSDP all-gathers before the first forward and reduce-scatters after
#   the last backward (not overlapped: an upper bound; a rank later in the pipeline could hide its
#   gathers in the warm-up), tensor and expert parallelism's collectives of every micro-batch,
#   the stage-to-stage sends (``M v`` activations forward, ``M v`` gradients back, each ``b s
#   d / tp`` over the link ``W / pp`` ranks away: the pipeline dim is outermost, as torchtitan's
#   mesh orders it) and the optimizer step. Backward splits into the input gradients (with the
#   recomputation) and the weight gradients, half each of its matmuls.
def plan_pipeline(
    module: nn.Module,
    world_size: int,
    hw: Hardware,
    options: CapacityOptions,
    schedule: PipelineSchedule,
    *,
    experts_per_token: int | None = None,
    model_name: str | None = None,
    systems: Sequence[System] = SYSTEMS,
) -> dict[str, PipelinePlan]:
    """Cost ``module`` (meta) at ``world_size`` with ``schedule.pp`` pipeline ranks and
    ``options``' ``tp`` and ``ep`` inside each stage (``options.batch``: sequences per
    micro-batch), for each of ``systems``; by system name.

    Raises:
        ValueError: a degree that does not divide the world, a cut the model cannot take
            (:class:`~.parallel.UnsplittableModel`), a stage group larger than some bucket's
            blocks (:class:`~.capacity.UnshardableWorld`), all before costing.
    """
    start = time.perf_counter()
    model = model_name or type(module).__name__
    _check_layout(world_size, options, schedule)
    cut = StageCut.of(module, model)
    split, full = _split_and_shape(module, cut, options, experts_per_token, model)
    return _plan_layout(module, cut, split, full, world_size, hw, options, schedule, systems, start)


def _check_layout(world_size: int, options: CapacityOptions, schedule: PipelineSchedule) -> None:
    """The degrees divide the world, and the settings are those costed: one line each."""
    dataclasses.replace(options.dims, pp=schedule.pp).check_world(world_size)
    if options.reshard_after_forward is not None or options.offload or options.compression:
        raise ValueError(
            "pipeline parallelism is costed with torchtitan's settings (no reshard after "
            "forward), without CPU offload or compressed communication"
        )


def _split_and_shape(
    module: nn.Module,
    cut: StageCut,
    options: CapacityOptions,
    experts_per_token: int | None,
    model: str,
) -> tuple[ModelSplit, ModelShape]:
    """The whole model's split under ``options``' ``tp`` and ``ep`` (:func:`~.parallel.
    split_model`; :meth:`ModelSplit.whole` without them), its FSDP units the cut's blocks (and
    the expert containers under ``ep``), and one rank's shape with it."""
    dims = options.dims
    split = ModelSplit.whole()
    if dims.model_parallel > 1:
        policy = RaggedShard(block_size=options.block_size)
        split = split_model(
            module, dims, policy=policy, experts_per_token=experts_per_token, model_name=model
        )
    split = dataclasses.replace(split, unit_ids=split.unit_ids | cut.unit_ids)
    full = model_shape(
        module,
        experts_per_token=experts_per_token,
        wrap=split.wrap,
        split=split if split.splits else None,
    )
    return split, full


def _plan_layout(
    module: nn.Module,
    cut: StageCut,
    split: ModelSplit,
    full: ModelShape,
    world_size: int,
    hw: Hardware,
    options: CapacityOptions,
    schedule: PipelineSchedule,
    systems: Sequence[System],
    start: float,
) -> dict[str, PipelinePlan]:
    """:func:`plan_pipeline` once the cut, the split and the shape are known."""
    pp, v = schedule.pp, schedule.stages_per_rank
    cuts = stage_layers(len(cut.blocks), schedule.stages)
    stage_world = world_size // pp
    micro = options.step(hw)
    planner, _ = capacity_planner(options, micro)
    # ranks whose blocks have the same shapes plan the same: each kind is planned once
    kinds = [_signature(b) for b in cut.blocks]
    planned: dict[tuple, tuple] = {}
    costed = {s.name: [] for s in systems}
    for rank in range(pp):
        layers = [i for k in range(v) for i in cuts[rank + k * pp]]
        first, last = rank == 0, rank == pp - 1
        key = (first, last, tuple(kinds[i] for i in layers))
        if key not in planned:
            stage = cut.stage_module(layers, first, last)
            plans = plan_buckets(stage, planner, split, stage_world, options)
            units = unit_bytes(plans)
            if not units or units[-1].path:  # a middle rank's root holds nothing
                units.append(UnitBytes("", (), (), 0, 0, world_size=stage_world))
            shape = cut.stage_shape(full, stage, layers, last)
            state = optimizer_state_bytes(plans, options.optimizer)
            parallel = parallel_bytes(shape, micro, hw, split)
            planned[key] = (units, shape, state, parallel.tp_s + parallel.ep_s)
        units, shape, state, parallel_s = planned[key]
        for system in systems:
            costed[system.name].append(
                _rank_cost(
                    _Stage(rank, len(layers), first, last, shape, units, state, parallel_s),
                    micro,
                    hw,
                    stage_world,
                    system,
                    schedule,
                )
            )
    seconds = time.perf_counter() - start
    return {
        name: _plan(name, ranks, schedule, options, world_size, hw, full, seconds)
        for name, ranks in costed.items()
    }


@dataclass(frozen=True)
class _Stage:
    """One pipeline rank's stages as planned: what :func:`_rank_cost` costs per system."""

    rank: int
    layers: int
    first: bool
    last: bool
    shape: ModelShape
    units: Sequence[UnitBytes]
    state: int  # optimizer state bytes
    parallel_s: float  # tensor and expert parallelism's seconds per micro-batch


def _rank_cost(
    stage: _Stage,
    micro: StepShape,
    hw: Hardware,
    stage_world: int,
    system: System,
    schedule: PipelineSchedule,
) -> RankCost:
    """One rank's :class:`RankCost` under ``system`` (comment at :func:`plan_pipeline`)."""
    rank, first, last, shape, units = stage.rank, stage.first, stage.last, stage.shape, stage.units
    state = stage.state
    comm, master = micro.param_dtype.itemsize, micro.master_dtype.itemsize
    local, local_grads, params, _, _ = buffer_bytes(units, comm, stage_world, system)
    # the micro-batches' gradients accumulate in the reduce dtype (both systems, where it
    # differs: raggedfsdp's CastReduceScatter.accumulate, FSDP2's unsharded_accumulated_grad)
    accumulate = micro.reduce_input_itemsize(system)
    grads = buffer_bytes(units, accumulate, stage_world, system).grads
    in_flight = schedule.in_flight(rank)
    loss, block = activation_bytes(shape, micro)
    working = max(block, loss if last else 0)
    kept = kept_activation_bytes(shape, micro)
    # in_flight counts local stages' micro-batches, each 1 / v of the rank's layers
    activations = working + round(kept * (in_flight / schedule.stages_per_rank - 1))
    unsharded = sum(params) + sum(grads)
    persistent = (local + local_grads) * master + state
    peak = max(local * master + state + unsharded + activations, persistent)
    fwd, bwd = unit_compute_s(shape, micro, hw)
    recompute = sum(fwd[:-1]) if micro.checkpointing else 0.0
    gathers, scatters = collective_costs(units, micro, hw, stage_world, system)
    return RankCost(
        rank=rank,
        layers=stage.layers,
        embedding=first,
        head=last,
        params=local * master,
        grads=local_grads * master,
        optimizer=state,
        unsharded=unsharded,
        in_flight=in_flight,
        activations=activations,
        peak=peak,
        forward_s=sum(fwd),
        backward_s=sum(bwd),
        recompute_s=recompute,
        fsdp_s=sum(gathers.total) + sum(scatters.total),
        parallel_s=stage.parallel_s * schedule.microbatches,
        optimizer_s=optimizer_step_s(units, micro, hw, stage_world, state, system),
    )


def _plan(
    name: str,
    ranks: Sequence[RankCost],
    schedule: PipelineSchedule,
    options: CapacityOptions,
    world_size: int,
    hw: Hardware,
    shape: ModelShape,
    seconds: float,
) -> PipelinePlan:
    """The step from the ranks' costs (comment at :func:`plan_pipeline`)."""
    m, v = schedule.microbatches, schedule.stages_per_rank
    slowest = max(ranks, key=lambda r: r.forward_s + r.backward_s)
    weight = (slowest.backward_s - slowest.recompute_s) / 2
    split = (slowest.forward_s, slowest.backward_s - weight, weight)
    bubble = schedule.bubble_s(*split)
    message = options.batch * options.seq_len * shape.hidden * options.param_dtype.itemsize
    # the pipeline dim is outermost (torchtitan's mesh): a stage's neighbour is W / pp ranks
    # away, across the inter-node link once that span leaves a node
    reach = min(world_size, world_size // schedule.pp + 1)
    one = hw.hop_latency_s(reach) + message / hw.link_bytes_per_s(reach)
    p2p = 2 * m * v * one if schedule.pp > 1 else 0.0
    extra = max(r.fsdp_s + r.parallel_s + r.optimizer_s for r in ranks)
    step = m * (slowest.forward_s + slowest.backward_s) + bubble + p2p + extra
    tp, ep, pp = options.tp, options.ep, schedule.pp
    tokens = m * options.batch * options.seq_len / (pp * tp)
    usable = hw.memory_bytes * (1 - options.reserve)
    return PipelinePlan(
        system=name,
        dims=(world_size // (tp * pp * ep), tp, pp, ep),
        schedule=schedule,
        ranks=tuple(ranks),
        bubble_s=bubble,
        bubble_fraction=schedule.bubble_fraction(*split),
        p2p_s=p2p,
        step_s=step,
        tokens_per_s=tokens / step if step else 0.0,
        fits=all(r.peak <= usable for r in ranks),
        plan_seconds=seconds,
    )


@dataclass(frozen=True)
class PipelineFit:
    """One ``(dp, tp, pp, ep)`` that fits, and what raggedfsdp costs there (``pp = 1``: FSDP
    with tensor and expert parallelism alone, one micro-batch per step)."""

    dp: int
    tp: int
    pp: int
    ep: int
    peak: int
    step_s: float
    tokens_per_s: float
    bubble_fraction: float


@dataclass(frozen=True)
class PipelineSearch:
    """The layouts tried at one world size (:func:`search_pipeline`)."""

    world_size: int
    schedule: str
    tried: int
    fits: tuple[PipelineFit, ...]
    seconds: float

    @property
    def fastest(self) -> PipelineFit | None:
        """The fit with the most tokens per second per device."""
        return max(self.fits, key=lambda f: f.tokens_per_s, default=None)


def search_pipeline(
    module: nn.Module,
    world_size: int,
    hw: Hardware,
    options: CapacityOptions,
    *,
    schedule: str,
    microbatches: int | None = None,
    stages_per_rank: int = 1,
    experts_per_token: int | None = None,
    model_name: str | None = None,
) -> PipelineSearch:
    """Every ``(dp, tp, pp, ep)`` over ``world_size`` with ``tp`` inside a node, costed for
    raggedfsdp with ``schedule`` (``microbatches`` per step, default ``4 x pp``) and ``pp = 1``
    (:func:`~.capacity.search_mesh`); those the model or the schedule cannot take are skipped.
    Returns those that fit, the fastest first."""
    start = time.perf_counter()
    model = model_name or type(module).__name__
    flat = search_mesh(
        module, world_size, hw, options, experts_per_token=experts_per_token, model_name=model_name
    )
    fits = [_flat_fit(flat.fastest)] if flat.fastest is not None else []
    tried = flat.tried
    cut = StageCut.of(module, model)
    for tp in [d for d in divisors(world_size) if d <= hw.devices_per_node]:
        for ep in divisors(world_size // tp):
            opts = _options_for(options, tp, ep)
            try:
                split, full = _split_and_shape(module, cut, opts, experts_per_token, model)
            except UnsplittableModel:
                continue
            layout = _Layout(module, cut, split, full, world_size, hw, opts)
            for plan in layout.plans(schedule, microbatches, stages_per_rank):
                tried += 1
                if plan.fits:
                    fits.append(
                        PipelineFit(
                            *plan.dims,
                            peak=plan.peak,
                            step_s=plan.step_s,
                            tokens_per_s=plan.tokens_per_s,
                            bubble_fraction=plan.bubble_fraction,
                        )
                    )
    fits.sort(key=lambda f: -f.tokens_per_s)
    return PipelineSearch(world_size, schedule, tried, tuple(fits), time.perf_counter() - start)


@dataclass(frozen=True)
class _Layout:
    """A model cut and split for one ``(tp, ep)`` (``options``'), at one world size: what
    :func:`search_pipeline` costs at each ``pp``."""

    module: nn.Module
    cut: StageCut
    split: ModelSplit
    full: ModelShape
    world_size: int
    hw: Hardware
    options: CapacityOptions

    def plans(
        self, schedule: str, microbatches: int | None, stages_per_rank: int
    ) -> Iterator[PipelinePlan]:
        """raggedfsdp's plan at each ``pp`` the world leaves, skipping those the schedule, the
        cut or the world refuses."""
        dims = self.options.dims
        for pp in divisors(self.world_size // (dims.tp * dims.ep))[1:]:
            try:
                sched = PipelineSchedule(schedule, pp, microbatches or 4 * pp, stages_per_rank)
                stage_layers(len(self.cut.blocks), sched.stages)
                _check_layout(self.world_size, self.options, sched)
                plans = _plan_layout(
                    self.module,
                    self.cut,
                    self.split,
                    self.full,
                    self.world_size,
                    self.hw,
                    self.options,
                    sched,
                    (RAGGEDFSDP,),
                    time.perf_counter(),
                )
            except (ValueError, UnshardableWorld):
                continue
            yield plans[RAGGEDFSDP.name]


def _flat_fit(fit: MeshFit) -> PipelineFit:
    return PipelineFit(fit.dp, fit.tp, 1, fit.ep, fit.peak, fit.step_s, fit.tokens_per_s, 0.0)
