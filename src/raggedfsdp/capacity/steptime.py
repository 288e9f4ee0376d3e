"""How long a training step takes, and what it sends, from the plans and a :class:`Hardware`.

The step is assembled from each unit's collective costs (:func:`collective_costs`), the forward and
backward pipelines over them, the optimizer step, the host copies and the quantizing; each
difference between the systems is a field of the :class:`~raggedfsdp.facts.System` costed. The
model, term by term, is the comment at :func:`step_time`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from ..facts.systems import RAGGEDFSDP, Stream, System, as_system
from ..planner.quant_blocks import Compression
from .hardware import Hardware
from .shapes import ModelShape
from .step_shape import StepShape
from .units import UnitBytes
from .wire import codec_traffic_bytes

__all__ = [
    "CollectiveBytes",
    "CollectiveCosts",
    "StepTime",
    "collective_bytes",
    "collective_costs",
    "gathers_per_unit",
    "host_copy_bytes",
    "optimizer_step_s",
    "step_time",
    "unit_compute_s",
]


@dataclass(frozen=True)
class CollectiveBytes:
    """What one rank moves per step. ``*_bytes`` follow the runtime's counters
    (:class:`~raggedfsdp.runtime.RuntimeStats`: all-gather, the rank's shard; reduce-scatter, the
    whole unsharded gradient); ``wire_bytes`` is what leaves the rank on its link."""

    all_gather_calls: int
    all_gather_bytes: int
    reduce_scatter_calls: int
    reduce_scatter_bytes: int
    wire_bytes: int
    #: ``reshard_after_forward=N``: backward's all-gathers of the pieces kept from forward,
    #: within groups of ``N`` ranks (in the all-gathers above too, as the runtime counts them)
    post_forward_all_gather_calls: int = 0
    post_forward_all_gather_bytes: int = 0


def gathers_per_unit(units: Sequence[UnitBytes], system: System) -> list[int]:
    """How many times each of ``units`` is all-gathered in one step (1, or 2 when ``system``
    gathers it again in backward)."""
    again = set(system.regathered(len(units) - 1))
    return [1 + (i in again) for i in range(len(units))]


def collective_bytes(
    units: Sequence[UnitBytes],
    step: StepShape,
    world_size: int,
    system: System | str = RAGGEDFSDP,
) -> CollectiveBytes:
    """Bytes per step per rank of each collective kind (no HSDP: no all-reduce); under
    compression (raggedfsdp) the messages of codes and scales (:mod:`.wire`). Each unit's
    collectives run over its own FSDP group (:meth:`UnitBytes.group`)."""
    system = as_system(system)
    w = world_size
    whole = [units[i] for i in _gathered_whole(units, step, w, system)]
    pieces = _pieces(units, step, w, system)
    reduced = [u for u in units if u.trainable_shard_numel]
    ag = [(u.group(w), u.gather_bytes(system, step)) for u in [*units, *whole]]
    ag += [(u.group(w), u.gather_bytes(system, _plain(step))) for u in pieces]
    rs = [(u.group(w), u.scatter_share(system, step)) for u in reduced]
    gathered = [*units, *whole, *pieces]
    return CollectiveBytes(
        all_gather_calls=sum(system.collective_calls(u.buckets) for u in gathered),
        all_gather_bytes=sum(b for _, b in ag),
        reduce_scatter_calls=sum(system.collective_calls(u.trainable_buckets) for u in reduced),
        reduce_scatter_bytes=sum(g * b for g, b in rs),
        wire_bytes=sum((g - 1) * b for g, b in ag + rs),
        post_forward_all_gather_calls=sum(system.collective_calls(u.buckets) for u in pieces),
        post_forward_all_gather_bytes=sum(u.gather_bytes(system, _plain(step)) for u in pieces),
    )


def _plain(step: StepShape) -> StepShape:
    """``step`` as backward's all-gather of kept pieces runs it: the pieces are already on the
    device, in ``param_dtype``, uncompressed."""
    return dataclasses.replace(step, offload=False, compression=None)


def _keeps_piece(unit: UnitBytes, step: StepShape, world_size: int) -> bool:
    """Whether ``unit``, resharded after forward, keeps a piece for backward (``1 < N <`` its
    group) rather than its shard (no ``N``, or ``N`` its group) or all of it (``N = 1``)."""
    n = step.reshard_after_forward
    return n is not None and 1 < n < unit.group(world_size)


def _gathered_whole(
    units: Sequence[UnitBytes], step: StepShape, world_size: int, system: System
) -> list[int]:
    """The blocks that backward all-gathers again from their shards, as forward did: every
    one ``system`` reshards (:meth:`System.regathered`) but those keeping a piece, none under
    ``N = 1``."""
    if step.reshard_after_forward == 1:
        return []
    again = system.regathered(len(units) - 1)
    return [i for i in again if not _keeps_piece(units[i], step, world_size)]


def _pieces(
    units: Sequence[UnitBytes], step: StepShape, world_size: int, system: System
) -> list[UnitBytes]:
    """The blocks whose backward all-gathers the piece they kept from forward, each as that
    all-gather sees it (:meth:`UnitBytes.within`)."""
    n = step.reshard_after_forward
    again = [units[i] for i in system.regathered(len(units) - 1)]
    return [u.within(n, world_size) for u in again if _keeps_piece(u, step, world_size)]


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step on one rank, by phase; ``comm_s`` is every collective's own time,
    ``exposed_comm_s`` what of it the step waits for (``total_s`` minus compute)."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    compute_s: float
    comm_s: float
    total_s: float
    tokens_per_s: float  # per device
    #: quantizing and dequantizing under compression, on the compute thread (in ``total_s``)
    codec_s: float = 0.0
    #: the runtime's own CPU work, as measured by the caller (in ``total_s``)
    host_overhead_s: float = 0.0
    #: CPU offload: the host <-> device copies that hold up the compute stream (raggedfsdp;
    #: FSDP2's run beside it, in ``comm_s``), in ``total_s``
    host_copy_s: float = 0.0
    #: tensor parallelism's all-reduces of activations and expert parallelism's all-to-alls
    #: of tokens, on the critical path (:mod:`.parallel_comm`), in ``total_s`` and in
    #: ``exposed_comm_s``; not in ``comm_s``, the FSDP collectives' own time
    tp_s: float = 0.0
    ep_s: float = 0.0

    @property
    def exposed_comm_s(self) -> float:
        busy = self.compute_s + self.optimizer_s + self.codec_s
        busy += self.host_overhead_s + self.host_copy_s
        return max(0.0, self.total_s - busy)

    @property
    def comm_share(self) -> float:
        """The fraction of the step spent waiting for communication."""
        return self.exposed_comm_s / self.total_s if self.total_s else 0.0

    def to_dict(self) -> dict[str, float]:
        return {
            **asdict(self),
            "exposed_comm_s": self.exposed_comm_s,
            "comm_share": self.comm_share,
        }


# ---------------------------------------------------------------------------------------------
# Each unit's collectives.

#: One collective's seconds from its unit, the bytes the rank feeds it and the buckets it
#: carries.
_Seconds = Callable[[UnitBytes, int, int], float]


def _ring_s(
    hw: Hardware, world_size: int, shard_bytes: float, calls: int, span: int | None = None
) -> float:
    """One unit's all-gather (or reduce-scatter): ``calls`` ring collectives over
    ``world_size`` ranks whose shards add up to ``shard_bytes``; ``span``: the consecutive
    ranks the group reaches across, which set its slowest hop (a group strided by tensor
    parallelism spans the world; default: ``world_size``)."""
    if world_size == 1:
        return 0.0
    steps, reach = world_size - 1, span or world_size
    return steps * (calls * hw.hop_latency_s(reach) + shard_bytes / hw.link_bytes_per_s(reach))


def _collective_s(
    unit: UnitBytes,
    nbytes: int,
    buckets: int,
    *,
    link: Hardware,
    hw: Hardware,
    world_size: int,
    system: System,
) -> float:
    """One collective of ``unit``'s ``buckets`` over ``link``: the ring over its FSDP group,
    which spans the world's ``world_size`` ranks, and a copying system's copy-out of the
    all-gather / copy-in of the reduce-scatter (read and write, at ``hw``'s memory
    bandwidth)."""
    w = unit.group(world_size)
    ring = _ring_s(link, w, nbytes, system.collective_calls(buckets), span=world_size)
    return ring if system.zero_copy else ring + 2 * w * nbytes / hw.memory_bytes_per_s


def _link_cpu_s(
    unit: UnitBytes, nbytes: int, buckets: int, *, hw: Hardware, world_size: int
) -> float:
    """The CPU a collective's bytes cost on the slower link (host backends only); its group
    spans the world."""
    slow = world_size > hw.devices_per_node and not hw.overlaps
    return (unit.group(world_size) - 1) * nbytes * hw.link_cpu_s_per_byte if slow else 0.0


def _per_unit(
    units: Sequence[UnitBytes], step: StepShape, hw: Hardware, system: System, seconds: _Seconds
) -> tuple[list[float], list[float]]:
    """Each unit's all-gather and reduce-scatter by ``seconds`` (a reduce-scatter that is an
    all-reduce counts twice: :meth:`System.reduce_scatter_passes`); a reduce-scatter carries
    the trainable buckets only."""
    gathers = [seconds(u, u.gather_bytes(system, step), u.buckets) for u in units]
    passes = system.reduce_scatter_passes(hw.native_reduce_scatter)
    scatters = [
        passes * seconds(u, u.scatter_share(system, step), u.trainable_buckets)
        if u.trainable_shard_numel
        else 0.0
        for u in units
    ]
    return gathers, scatters


@dataclass(frozen=True)
class CollectiveCosts:
    """One collective kind's seconds per unit (the root last).

    Attributes:
        total: each collective's own time: the ring, a copying system's copies around it, and
            offload copies issued on its stream.
        host: what of ``total`` the host's cores spend moving the bytes when the backend does
            not overlap (the collective at the host's own speed), in series with the compute;
            zeros where it overlaps.
        cpu: the CPU the slower link itself costs while it carries the bytes, on the compute's
            core.
    """

    total: tuple[float, ...]
    host: tuple[float, ...]
    cpu: tuple[float, ...]

    @property
    def waiting(self) -> tuple[float, ...]:
        """What of each collective is waiting for a slower link (overlapped by the prefetch)."""
        return tuple(max(0.0, t - h) for t, h in zip(self.total, self.host, strict=True))

    def block(self, i: int) -> tuple[float, float]:
        """``(cpu, waiting)`` of block ``i``'s collective; zeros for an index that is not a
        block (before the first, or the root)."""
        if 0 <= i < len(self.total) - 1:
            return self.cpu[i], self.waiting[i]
        return 0.0, 0.0

    def root(self) -> tuple[float, float]:
        """``(cpu, waiting)`` of the root's collective."""
        return self.cpu[-1], self.waiting[-1]


def collective_costs(
    units: Sequence[UnitBytes], step: StepShape, hw: Hardware, world_size: int, system: System
) -> tuple[CollectiveCosts, CollectiveCosts]:
    """Each unit's all-gather and reduce-scatter, as :class:`CollectiveCosts`."""
    w = world_size
    on = functools.partial(_collective_s, hw=hw, world_size=w, system=system)
    ag_total, rs_total = _per_unit(units, step, hw, system, functools.partial(on, link=hw))
    if step.offload:  # a copy on a collective's stream runs in series with that collective
        pcie = hw.offload_rates(w)[0]
        h2d, d2h = host_copy_bytes(units, step, system)
        if system.host_copies.to_device is not Stream.COMPUTE:
            ag_total = [t + b / pcie for t, b in zip(ag_total, h2d, strict=True)]
        if system.host_copies.to_host is not Stream.COMPUTE:
            rs_total = [t + b / pcie for t, b in zip(rs_total, d2h, strict=True)]
    if hw.overlaps:
        ag_host, rs_host = [0.0] * len(units), [0.0] * len(units)
    else:  # the host's cores move the bytes at its own speed: the link unthrottled
        unthrottled = functools.partial(on, link=hw.unthrottled())
        ag_host, rs_host = _per_unit(units, step, hw, system, unthrottled)
    link_cpu = functools.partial(_link_cpu_s, hw=hw, world_size=w)
    ag_cpu, rs_cpu = _per_unit(units, step, hw, system, link_cpu)
    return (
        CollectiveCosts(tuple(ag_total), tuple(ag_host), tuple(ag_cpu)),
        CollectiveCosts(tuple(rs_total), tuple(rs_host), tuple(rs_cpu)),
    )


# ---------------------------------------------------------------------------------------------
# The step.


def _beside(compute: float, *collectives: tuple[float, float]) -> float:
    """Compute beside ``(cpu, waiting)`` collectives: the core does the compute and their CPU,
    the link waits for them."""
    cpu = sum(c for c, _ in collectives)
    waiting = sum(w for _, w in collectives)
    return max(compute + cpu, waiting)


def unit_compute_s(
    shape: ModelShape, step: StepShape, hw: Hardware
) -> tuple[list[float], list[float]]:
    """Each unit's forward and backward compute: its FLOPs at ``peak x efficiency``; backward
    is twice the forward, and checkpointing recomputes every unit's forward but the root's."""
    rate = hw.peak_flops * hw.efficiency
    fwd = [shape.forward_flops_per_token(s, step.seq_len) * step.tokens / rate for s in shape.units]
    recompute = [f if step.checkpointing else 0.0 for f in fwd[:-1]] + [0.0]
    return fwd, [2 * f + r for f, r in zip(fwd, recompute, strict=True)]


def _forward_s(fwd: Sequence[float], gathers: CollectiveCosts) -> float:
    """Forward with prefetch depth 1: the root's and the first block's all-gathers exposed,
    then each block computes beside the next one's all-gather, then the root's compute; the
    host's share of every all-gather in series."""
    exposed = _beside(0.0, gathers.root()) + _beside(0.0, gathers.block(0))
    forward = exposed + fwd[-1]
    forward += sum(_beside(fwd[i], gathers.block(i + 1)) for i in range(len(fwd) - 1))
    return forward + sum(gathers.host)


def _backward_s(
    bwd: Sequence[float], gathers: CollectiveCosts, scatters: CollectiveCosts, system: System
) -> float:
    """Backward: the root's (beside the last block's all-gather again, where ``system``
    resharded it), each block's beside the previous block's all-gather and the next one's
    reduce-scatter, then the first block's and the root's reduce-scatters exposed; the host's
    share of the backward's collectives in series."""
    blocks = len(bwd) - 1
    last = blocks - 1
    regather = (0.0, 0.0) if system.keeps_last_block_unsharded else gathers.block(last)
    backward = _beside(bwd[-1], regather)
    backward += sum(
        _beside(bwd[i], gathers.block(i - 1), scatters.block(i + 1)) for i in range(blocks)
    )
    backward += _beside(0.0, scatters.block(0)) + _beside(0.0, scatters.root())
    again = sum(gathers.host[i] for i in system.regathered(blocks)) + sum(scatters.host)
    return backward + again


# The model of a step, term by term:
#
# - **compute**: a unit's FLOPs (:class:`~.shapes.ModelShape`) over ``peak_flops x efficiency``;
#   backward is twice the forward, and activation checkpointing adds the blocks' forward again.
# - **a collective** (all-gather or reduce-scatter of one bucket) as a ring over ``W`` devices: ``(W
#   - 1) x (latency + S x itemsize / bandwidth)``, where ``S`` is the bucket's shard and the
#   bandwidth and latency are those of the slowest hop (:meth:`Hardware.link_bytes_per_s`). Both
#   collectives put ``(W - 1) S`` elements on each rank's link; they run one at a time on it.
# - **overlap** as raggedfsdp achieves it, prefetch depth 1: in forward the next unit's all-gather
#   runs under this unit's compute; in backward the previous unit's all-gather and the next one's
#   reduce-scatter run under this unit's compute. Exposed: the root's and the first block's
#   all-gathers, the root's reduce-scatter and the first block's at the end. The last block is not
#   resharded after forward (raggedfsdp keeps it; FSDP2 re-gathers it under the head's backward).
#   Without overlap (:attr:`Hardware.overlaps` off: CPU, where Gloo moves the bytes with the
#   compute's cores) each collective's time at the host's own speed (the link unthrottled:
#   :meth:`Hardware.unthrottled`) adds to the step; what a slower link adds beyond it is waiting,
#   which overlaps the compute as above. The CPU the slower link itself costs while it carries the
#   bytes (:attr:`Hardware.link_cpu_s_per_byte`, per byte sent) is work on the compute's core: a
#   stretch where compute overlaps a collective takes ``max(compute + that CPU, waiting)``.
# - **the optimizer step**: bound by memory bandwidth: it reads and writes the shard and its state
#   and reads the gradient.
# - **the runtime's own CPU work** (hooks, buffer bookkeeping, FSDP2's DTensor dispatch) is not
#   derived from the shapes: a caller that measured it (``host_overhead_s``: a system's step at W =
#   1 minus the model's, on a host backend) adds it to the step. On an accelerator it runs ahead of
#   the device and costs nothing, so it is 0 by default.
# - **compressed communication** (raggedfsdp): the collectives move the messages of codes and scales
#   (:mod:`.wire`), and quantizing and dequantizing add their memory traffic at memory bandwidth to
#   the step, on the compute thread (``codec_s``).
# - **CPU offload** (``step.offload``): every all-gather first copies the rank's shards from the
#   host (master dtype, host to device), every reduce-scatter's shard goes back (master dtype,
#   device to host), both over the device's PCIe link (:meth:`Hardware.offload_rates`). Both systems
#   issue them on the all-gather copy-in stream and the stream that finishes the reduction
#   (raggedfsdp: ``runtime/_param_group.py``; FSDP2: ``_fsdp_collectives.py``;
#   :attr:`System.host_copies <raggedfsdp.facts.System>`), so a copy runs in series with its
#   collective but beside the compute: it lengthens the collective's own time, which overlaps as
#   above. A copy on the compute stream would add its whole time to the step (``host_copy_s``). The
#   optimizer step runs on the host, at the rank's share of the node's host memory bandwidth.
# - FSDP2 on the same shapes moves its padded per-parameter shards and copies them in and out of its
#   collective buffers (``2 x`` the buffer, read and write, at memory bandwidth), in the critical
#   path. Where the backend has no reduce-scatter of its own (:attr:`Hardware.native_reduce_scatter`
#   off: Gloo), FSDP2's is an all-reduce of the whole gradient: twice the ring's steps and bytes,
#   and the clone of its input.
def step_time(
    shape: ModelShape,
    units: Sequence[UnitBytes],
    step: StepShape,
    hw: Hardware,
    world_size: int,
    *,
    optimizer_bytes: int,
    system: System | str = RAGGEDFSDP,
    host_overhead_s: float = 0.0,
) -> StepTime:
    """The step time of ``system`` (a :class:`~raggedfsdp.facts.System` or its name) at
    ``world_size`` (module docstring: the model); ``host_overhead_s``: the system's measured CPU
    work per step beyond the model, added."""
    if host_overhead_s < 0:
        raise ValueError(f"host_overhead_s must be >= 0, got {host_overhead_s}")
    system = as_system(system)
    w = world_size
    gathers, scatters = collective_costs(units, step, hw, w, system)
    regathers = _regather_costs(units, step, hw, w, system, gathers)
    fwd, bwd = unit_compute_s(shape, step, hw)
    forward = _forward_s(fwd, gathers)
    backward = _backward_s(bwd, regathers, scatters, system)
    optimizer = optimizer_step_s(units, step, hw, w, optimizer_bytes, system)
    regathered = system.regathered(len(units) - 1)
    copies = _host_copy_s(units, step, hw, w, system)
    again = set(_gathered_whole(units, step, w, system))
    codec = _codec_s(units, step, hw, w, system.compression(step.compression), again)
    total = forward + backward + optimizer + codec + host_overhead_s + copies
    comm_s = sum(gathers.total) + sum(regathers.total[i] for i in regathered) + sum(scatters.total)
    return StepTime(
        forward_s=forward,
        backward_s=backward,
        optimizer_s=optimizer,
        compute_s=sum(fwd) + sum(bwd),
        comm_s=comm_s,
        total_s=total,
        tokens_per_s=step.tokens / total if total else 0.0,
        codec_s=codec,
        host_overhead_s=host_overhead_s,
        host_copy_s=copies,
    )


def _regather_costs(
    units: Sequence[UnitBytes],
    step: StepShape,
    hw: Hardware,
    world_size: int,
    system: System,
    gathers: CollectiveCosts,
) -> CollectiveCosts:
    """Each unit's all-gather again for its backward: as in forward (``gathers``), or under
    ``reshard_after_forward=N`` a ring over its group of ``N`` consecutive ranks (on NVLink when
    ``N`` fits a node) of the piece it kept (:meth:`UnitBytes.within`), no host copies or
    compression; nothing for ``N = 1`` (never resharded)."""
    n = step.reshard_after_forward
    if n is None:
        return gathers
    if n == 1:
        zeros = (0.0,) * len(units)
        return CollectiveCosts(zeros, zeros, zeros)
    keeps = [_keeps_piece(u, step, world_size) for u in units]
    views = [u.within(n, world_size) if k else u for u, k in zip(units, keeps, strict=True)]
    pieces, _ = collective_costs(views, _plain(step), hw, n, system)

    def pick(kept: tuple[float, ...], whole: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(a if k else b for a, b, k in zip(kept, whole, keeps, strict=True))

    return CollectiveCosts(
        pick(pieces.total, gathers.total),
        pick(pieces.host, gathers.host),
        pick(pieces.cpu, gathers.cpu),
    )


def host_copy_bytes(
    units: Sequence[UnitBytes], step: StepShape, system: System | str = RAGGEDFSDP
) -> tuple[list[int], list[int]]:
    """CPU offload: per unit, the bytes one all-gather copies host to device (the rank's
    shards in the master dtype: the cast happens on the device) and the bytes its
    reduce-scatter's shard copies back (master dtype, cast on the device first); FSDP2's are its
    padded shards (rank 0's: the largest). Zeros without offload."""
    if not step.offload:
        return [0] * len(units), [0] * len(units)
    system = as_system(system)
    master = step.master_dtype.itemsize
    h2d = [u.shard(system) * master for u in units]
    d2h = [u.trainable_shard(system) * master for u in units]
    return h2d, d2h


def _host_copy_s(
    units: Sequence[UnitBytes], step: StepShape, hw: Hardware, world_size: int, system: System
) -> float:
    """Offload copies on the compute stream (:attr:`Stream.COMPUTE
    <raggedfsdp.facts.Stream>`) hold it up: every all-gather's copy (the regathered blocks'
    twice) and every reduce-scatter's, of the directions a system issues there (neither
    raggedfsdp nor FSDP2 does: 0 for both)."""
    if not step.offload:
        return 0.0
    h2d, d2h = host_copy_bytes(units, step, system)
    again = sum(h2d[i] for i in system.regathered(len(units) - 1))
    on_compute = 0
    if system.host_copies.to_device is Stream.COMPUTE:
        on_compute += sum(h2d) + again
    if system.host_copies.to_host is Stream.COMPUTE:
        on_compute += sum(d2h)
    return on_compute / hw.offload_rates(world_size)[0]


def optimizer_step_s(
    units: Sequence[UnitBytes],
    step: StepShape,
    hw: Hardware,
    world_size: int,
    optimizer_bytes: int,
    system: System,
) -> float:
    """The optimizer step, bound by memory bandwidth: it reads and writes the shards and the
    state and reads the gradients; on the host under offload, where the node's ranks share its
    memory bandwidth."""
    local = sum(u.shard(system) for u in units) * step.master_dtype.itemsize
    traffic = 2 * local + local + 2 * optimizer_bytes
    if step.offload:
        return traffic / hw.offload_rates(world_size)[1]
    return traffic / hw.memory_bytes_per_s


def _codec_s(
    units: Sequence[UnitBytes],
    step: StepShape,
    hw: Hardware,
    world_size: int,
    compression: Compression | None,
    again: set[int],
) -> float:
    """Seconds of quantizing and dequantizing on the compute thread in one step: their memory
    traffic (:func:`.wire.codec_traffic_bytes`) at memory bandwidth; units in ``again`` are
    all-gathered twice."""
    if compression is None:
        return 0.0
    traffic = sum(
        codec_traffic_bytes(
            u.shards,
            u.messages,
            2 if i in again else 1,
            u.trainable,
            u.group(world_size),
            compression,
            param_itemsize=step.param_dtype.itemsize,
            master_itemsize=step.master_dtype.itemsize,
        )
        for i, u in enumerate(units)
        if u.group(world_size) > 1  # nothing is quantized for a group of one
    )
    return traffic / hw.memory_bytes_per_s
