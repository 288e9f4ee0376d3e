"""What a sharding plan costs, side by side with FSDP2 and FSDP1 on the same shapes.

The logic behind ``raggedfsdp plan`` and ``benchmarks/bench_planner.py``: plan a whole model with
:class:`~raggedfsdp.planner.StructAwarePlanner` at several world sizes and measure, per world size,
padding, elements per rank, plan time and ``S`` over its bound (the comment at :func:`plan_report`).
Pure Python over shapes (models on the meta device); results are dataclasses, and rendering is the
caller's business (:mod:`raggedfsdp.cli.plan`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..layout import BlockSize, RaggedShard
from ..models import build_model
from ..planner import ShardPlan, StructAwarePlanner, model_buckets

__all__ = [
    "PlanOptions",
    "PlanReport",
    "WorldReport",
    "fsdp1_unit_split",
    "fsdp2_param_split",
    "plan_report",
]


@dataclass(frozen=True)
class PlanOptions:
    """How a model was planned.

    Attributes:
        optimizer: the planner's ``optimizer_type`` (``None`` plans for plain AdamW/SGD).
        block_size: the :class:`RaggedShard` block (``None``: element granularity).
        buffer_size: bucket cap in bytes (``None``: one bucket per FSDP unit and dtype).
        dtype: the communication dtype (alignment and bytes follow it).
    """

    optimizer: str | None = None
    block_size: BlockSize = None
    buffer_size: int | None = None
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class WorldReport:
    """One world size's figures. Ratios are fractions (0.01 is 1%); element counts are per rank
    unless named ``total``."""

    world_size: int
    #: Buckets (one all-gather each) the plan has.
    buckets: int
    #: Parameters' elements in the whole model (tied parameters counted once).
    param_numel: int
    #: ``sum(W*S) - param_numel`` over all buckets.
    padding_numel: int
    padding_ratio: float
    #: Elements each rank holds: the sum of every bucket's ``S``.
    rank_numel: int
    #: Bytes a rank sends in its largest all-gather (largest ``S`` times the element size).
    allgather_bytes_max: int
    #: Bytes a rank sends to gather every bucket once (one forward; a resharded backward repeats).
    allgather_bytes_total: int
    #: Wall seconds to plan the whole model (median over the repeats).
    plan_seconds: float
    #: Sum over buckets of the provable lower bound on ``S``.
    bound_rank_numel: int
    #: Padding the lower bounds force: ``(sum(W*bound) - param_numel) / param_numel``.
    bound_padding_ratio: float
    #: ``rank_numel / bound_rank_numel`` (1.0 when every bucket meets its bound).
    bound_ratio: float
    #: The largest ``S / bound`` of any bucket, and that bucket's label (the first bucket when
    #: every bucket meets its bound).
    worst_bound_ratio: float
    worst_bucket: str
    #: Policy blocks in the whole model (each parameter's ``ceil(numel / unit)``).
    blocks_total: int
    #: FSDP2: elements padded (each parameter to ``ceil(dim0/W)*W`` rows), per rank, blocks cut.
    fsdp2_padding_numel: int
    fsdp2_padding_ratio: float
    fsdp2_rank_numel: int
    fsdp2_cut_blocks: int
    #: FSDP1: elements padded (each unit to a multiple of ``W``), per rank, blocks cut.
    fsdp1_padding_numel: int
    fsdp1_padding_ratio: float
    fsdp1_rank_numel: int
    fsdp1_cut_blocks: int


@dataclass(frozen=True)
class PlanReport:
    """A model planned at several world sizes."""

    model: str
    options: PlanOptions
    #: Parameters (tied ones once) and their elements.
    num_params: int
    param_numel: int
    worlds: tuple[WorldReport, ...]

    def to_records(self) -> list[dict[str, object]]:
        """One JSON-ready dict per world size, each self-contained (model and options included)."""
        block = self.options.block_size
        head: dict[str, object] = {
            "model": self.model,
            "optimizer": self.options.optimizer or "adamw",
            "block_size": list(block) if isinstance(block, tuple) else block,
            "buffer_size": self.options.buffer_size,
            "dtype": str(self.options.dtype).removeprefix("torch."),
            "num_params": self.num_params,
        }
        return [{**head, **asdict(world)} for world in self.worlds]


# ---------------------------------------------------------------------------------------------
# The FSDP baselines, computed from shapes alone.


def _floor_sum(n: int, m: int, a: int, b: int) -> int:
    """``sum(floor((a*i + b) / m) for i in range(n))`` for ``n, a, b >= 0`` and ``m >= 1``, in
    ``O(log m)`` steps (the Euclid-like reduction of AtCoder's ``floor_sum``), so no loop runs
    over the ranks however large ``W`` is."""
    total = 0
    while True:
        if a >= m:
            total += n * (n - 1) // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        y_max = a * n + b
        if y_max < m:
            return total
        n, b = divmod(y_max, m)
        m, a = a, m


def _cut_units(start: int, numel: int, unit: int, chunk: int) -> int:
    """Units of ``unit`` elements of a parameter at ``[start, start + numel)`` of a flat buffer
    split every ``chunk`` elements that have a split strictly inside (a unit cut twice counts
    once: it is lost either way); the last unit may be partial.

    A full unit ``[a, a + unit)`` holds a multiple of ``chunk`` strictly inside when
    ``(a + unit - 1) // chunk > a // chunk``; with ``unit - 1 < chunk`` that difference is 0 or 1,
    so the count over the units ``a = start + j*unit`` is a difference of two floor sums.
    """
    if unit <= 1 or numel <= 0:
        return 0
    full, rest = divmod(numel, unit)
    if unit - 1 >= chunk:  # every full unit is longer than a chunk
        cut = full
    else:
        cut = _floor_sum(full, chunk, unit, start + unit - 1) - _floor_sum(full, chunk, unit, start)
    if rest > 1:  # the partial last unit [a, a + rest)
        a = start + full * unit
        cut += (a + rest - 1) // chunk > a // chunk
    return cut


def fsdp2_param_split(shape: Sequence[int], unit: int, world_size: int) -> tuple[int, int]:
    """FSDP2 ``Shard(0)`` of one parameter: ``(elements per rank, policy blocks cut)``.

    FSDP2 gives every rank ``ceil(dim0 / W)`` rows of dim 0 (the last ranks get padding, or
    nothing but padding), so each rank holds ``ceil(dim0/W) * numel/dim0`` elements, and the
    chunk edges ``k * ceil(dim0/W)`` rows in are its cuts. A 0-D parameter counts as one row.
    """
    numel = math.prod(shape)
    dim0 = shape[0] if shape else 1
    if numel == 0 or dim0 == 0:
        return 0, 0
    per_rank = -(-dim0 // world_size) * (numel // dim0)
    return per_rank, _cut_units(0, numel, unit, per_rank)


def fsdp1_unit_split(
    numels: Sequence[int], units: Sequence[int], world_size: int
) -> tuple[int, int, int]:
    """FSDP1 ``FlatParameter`` of one FSDP unit: ``(elements per rank, padding, blocks cut)``.

    The unit's parameters are flattened and concatenated in order (no alignment padding between
    them, as with ``use_orig_params=False``), padded to a multiple of ``W`` and split evenly;
    rank ``r`` holds ``[r*c, (r+1)*c)`` with ``c = ceil(total / W)``. Counted per parameter, in
    closed form (:func:`_cut_units`): a split at a parameter's first element cuts nothing.
    """
    total = sum(numels)
    if total == 0:
        return 0, 0, 0
    chunk = -(-total // world_size)
    cut, start = 0, 0
    for numel, unit in zip(numels, units, strict=True):
        cut += _cut_units(start, numel, unit, chunk)
        start += numel
    return chunk, chunk * world_size - total, cut


# ---------------------------------------------------------------------------------------------
# The report.


@dataclass(frozen=True)
class _Param:
    shape: tuple[int, ...]
    numel: int
    unit: int


def _fsdp_units(module: nn.Module, planner: StructAwarePlanner) -> list[tuple[_Param, ...]]:
    """The model's FSDP units (one per wrap unit and dtype, whatever the buffer size), each a
    tuple of its parameters in model order with the planner's unit."""
    units = []
    for bucket in model_buckets(module, buffer_size=None):
        units.append(
            tuple(
                _Param(tuple(p.shape), p.numel(), planner.unit_numel(name, p.shape))
                for name, p in bucket.params.items()
            )
        )
    return units


def _plan_once(
    module: nn.Module, world_size: int, options: PlanOptions
) -> tuple[list[ShardPlan], float]:
    """Plan the whole model with a fresh planner (no cache from earlier runs); wall seconds."""
    planner = _planner(options)
    start = time.perf_counter()
    plans = planner.plan_model(
        module, world_size, buffer_size=options.buffer_size, dtype=options.dtype
    )
    return plans, time.perf_counter() - start


def _planner(options: PlanOptions) -> StructAwarePlanner:
    return StructAwarePlanner(
        optimizer_type=options.optimizer,  # type: ignore[arg-type]
        shard_policy=RaggedShard(block_size=options.block_size),
    )


@dataclass
class _Baselines:
    """Per-rank elements, padding and cut policy blocks of FSDP2 and FSDP1 on the same units."""

    fsdp2_rank: int = 0
    fsdp2_cut: int = 0
    fsdp1_rank: int = 0
    fsdp1_pad: int = 0
    fsdp1_cut: int = 0
    blocks: int = 0  # policy blocks in the model


def _baselines(fsdp_units: Sequence[tuple[_Param, ...]], world_size: int) -> _Baselines:
    """FSDP2 (even rows per parameter) and FSDP1 (one flat split per unit) at ``world_size``.
    Repeated layers share shapes, so each distinct parameter / unit is computed once."""
    fsdp2_cache: dict[tuple[tuple[int, ...], int], tuple[int, int]] = {}
    fsdp1_cache: dict[tuple[tuple[int, int], ...], tuple[int, int, int]] = {}
    out = _Baselines()
    for unit in fsdp_units:
        for prm in unit:
            key2 = (prm.shape, prm.unit)
            if key2 not in fsdp2_cache:
                fsdp2_cache[key2] = fsdp2_param_split(prm.shape, prm.unit, world_size)
            per_rank, cut = fsdp2_cache[key2]
            out.fsdp2_rank += per_rank
            out.fsdp2_cut += cut
            out.blocks += -(-prm.numel // prm.unit)
        key1 = tuple((prm.numel, prm.unit) for prm in unit)
        if key1 not in fsdp1_cache:
            numels, units = [k[0] for k in key1], [k[1] for k in key1]
            fsdp1_cache[key1] = fsdp1_unit_split(numels, units, world_size)
        per_rank, pad, cut = fsdp1_cache[key1]
        out.fsdp1_rank += per_rank
        out.fsdp1_pad += pad
        out.fsdp1_cut += cut
    return out


def _worst_bucket(plans: Sequence[ShardPlan]) -> tuple[float, str]:
    """The largest ``S / bound`` of any bucket and that bucket's name (ties: model order)."""
    worst_ratio, worst_bucket = 1.0, plans[0].name if plans else ""
    for p in plans:
        if p.lower_bound and p.shard_numel / p.lower_bound > worst_ratio:
            worst_ratio, worst_bucket = p.shard_numel / p.lower_bound, p.name
    return worst_ratio, worst_bucket


def _world_report(
    world_size: int,
    plans: Sequence[ShardPlan],
    seconds: float,
    fsdp_units: Sequence[tuple[_Param, ...]],
    itemsize: int,
) -> WorldReport:
    w = world_size
    param_numel = sum(p.param_numel for p in plans)
    rank_numel = sum(p.shard_numel for p in plans)
    bound = sum(p.lower_bound for p in plans)
    worst_ratio, worst_bucket = _worst_bucket(plans)
    base = _baselines(fsdp_units, w)

    def ratio(padding: int) -> float:
        return padding / param_numel if param_numel else 0.0

    fsdp2_pad = w * base.fsdp2_rank - param_numel
    return WorldReport(
        world_size=w,
        buckets=len(plans),
        param_numel=param_numel,
        padding_numel=w * rank_numel - param_numel,
        padding_ratio=ratio(w * rank_numel - param_numel),
        rank_numel=rank_numel,
        allgather_bytes_max=max((p.shard_numel for p in plans), default=0) * itemsize,
        allgather_bytes_total=rank_numel * itemsize,
        plan_seconds=seconds,
        bound_rank_numel=bound,
        bound_padding_ratio=ratio(w * bound - param_numel),
        bound_ratio=rank_numel / bound if bound else 1.0,
        worst_bound_ratio=worst_ratio,
        worst_bucket=worst_bucket,
        blocks_total=base.blocks,
        fsdp2_padding_numel=fsdp2_pad,
        fsdp2_padding_ratio=ratio(fsdp2_pad),
        fsdp2_rank_numel=base.fsdp2_rank,
        fsdp2_cut_blocks=base.fsdp2_cut,
        fsdp1_padding_numel=base.fsdp1_pad,
        fsdp1_padding_ratio=ratio(base.fsdp1_pad),
        fsdp1_rank_numel=base.fsdp1_rank,
        fsdp1_cut_blocks=base.fsdp1_cut,
    )


def _check_world_sizes(world_sizes: Sequence[int]) -> tuple[int, ...]:
    sizes = tuple(world_sizes)
    if not sizes:
        raise ValueError("at least one world size is needed")
    for w in sizes:
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"world sizes must be integers >= 1, got {w!r}")
    return sizes


# Per world size:
#
# - **padding** over all buckets, ``(sum W*S - sum numel) / sum numel``, beside the padding the
#   planner's provable lower bound on ``S`` forces (so high padding can be shown to be unavoidable);
# - **elements per rank** (the sum of every bucket's ``S``) and the bytes a rank sends per
#   all-gather (the largest bucket) and per pass over the model (every bucket once);
# - **plan time**, wall clock for the whole model (median of ``repeats`` runs, a fresh planner each
#   run so the planner's bucket cache does not carry over);
# - **S / bound**, overall (sum of ``S`` over sum of bounds) and for the worst bucket;
# - **FSDP2** (``fully_shard``, ``Shard(0)``): each parameter padded to ``ceil(dim0/W)*W`` rows
#   along dim 0, and the policy blocks its row chunks cut;
# - **FSDP1** (``FlatParameter``): each FSDP unit's parameters flattened and concatenated, padded to
#   a multiple of ``W`` and split evenly, and the policy blocks those even splits cut.
#
# "Policy blocks" are the planner's units (the :class:`~raggedfsdp.layout.RaggedShard` block
# combined with the optimizer's need, see :meth:`StructAwarePlanner.unit_numel`), so FSDP2/FSDP1 are
# judged by the same rule our plans obey; our plans cut none (every :class:`ShardPlan` is
# validated).
def plan_report(
    model: nn.Module | str,
    world_sizes: Sequence[int],
    *,
    optimizer: str | None = None,
    block_size: BlockSize = None,
    buffer_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    repeats: int = 1,
    model_name: str | None = None,
) -> PlanReport:
    """Plan ``model`` at each world size and measure the plans against the bound, FSDP2, FSDP1.

    Args:
        model: a module (best on the meta device) or a name from
            :data:`raggedfsdp.models.MODEL_NAMES`, built on meta and cast to ``dtype`` (so
            ``buffer_size`` splits buckets by the communicated bytes).
        world_sizes: the world sizes to plan for, each >= 1.
        optimizer: ``None``/``"adamw"``, ``"muon"``, ``"shampoo"`` or ``"adamw8bit"``.
        block_size: the :class:`RaggedShard` block.
        buffer_size: bucket cap in bytes, ``None`` for one bucket per FSDP unit.
        dtype: communication dtype: alignment (16 bytes) and byte counts follow it. A module
            passed in is not cast; its parameters' dtypes decide where ``buffer_size`` splits.
        repeats: plan this many times per world size (fresh planner each) and keep the median time.
        model_name: the name to report (default: the name given, or the module's class name).

    Raises:
        ValueError: an unknown model, optimizer or block size, a bad world size or buffer size,
            or a policy the model's shapes cannot meet (the message names the parameter).
    """
    sizes = _check_world_sizes(world_sizes)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    if buffer_size is not None and (
        isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1
    ):
        raise ValueError(
            f"buffer_size must be a positive number of bytes or None, got {buffer_size!r}"
        )
    options = PlanOptions(optimizer, block_size, buffer_size, dtype)
    planner = _planner(options)  # validates optimizer and block size before any work
    if isinstance(model, str):
        name = model_name or model
        module = build_model(model, device="meta")
        if dtype != torch.float32:
            module = module.to(dtype)
    else:
        name = model_name or type(model).__name__
        module = model
    fsdp_units = _fsdp_units(module, planner)
    worlds = []
    for w in sizes:
        runs = [_plan_once(module, w, options) for _ in range(repeats)]
        seconds = statistics.median(t for _, t in runs)
        worlds.append(_world_report(w, runs[0][0], seconds, fsdp_units, dtype.itemsize))
    num_params = sum(len(unit) for unit in fsdp_units)
    param_numel = sum(prm.numel for unit in fsdp_units for prm in unit)
    return PlanReport(name, options, num_params, param_numel, tuple(worlds))
