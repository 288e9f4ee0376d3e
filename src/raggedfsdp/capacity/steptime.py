"""How long a training step takes, and what it sends, from the plans and a :class:`Hardware`.

- **compute**: a unit's FLOPs (:class:`~.shapes.ModelShape`) over ``peak_flops x efficiency``;
  backward is twice the forward, and activation checkpointing adds the blocks' forward again.
- **a collective** (all-gather or reduce-scatter of one bucket) as a ring over ``W`` devices:
  ``(W - 1) x (latency + S x itemsize / bandwidth)``, where ``S`` is the bucket's shard and the
  bandwidth and latency are those of the slowest hop (:meth:`Hardware.link_bytes_per_s`). Both
  collectives put ``(W - 1) S`` elements on each rank's link; they run one at a time on it.
- **overlap** as raggedfsdp achieves it, prefetch depth 1: in forward the next unit's all-gather
  runs under this unit's compute; in backward the previous unit's all-gather and the next one's
  reduce-scatter run under this unit's compute. Exposed: the root's and the first block's
  all-gathers, the root's reduce-scatter and the first block's at the end. The last block is
  not resharded after forward (raggedfsdp keeps it; FSDP2 re-gathers it under the head's
  backward).
  Without overlap (:attr:`Hardware.overlaps` off: CPU, where Gloo moves the bytes with the
  compute's cores) each collective's time at the host's own speed (the link unthrottled:
  :meth:`Hardware.unthrottled`) adds to the step; what a slower link adds beyond it is waiting,
  which overlaps the compute as above. The CPU the slower link itself costs while it carries the
  bytes (:attr:`Hardware.link_cpu_s_per_byte`, per byte sent) is work on the compute's core: a
  stretch where compute overlaps a collective takes ``max(compute + that CPU, waiting)``.
- **the optimizer step**: bound by memory bandwidth: it reads and writes the shard and its state
  and reads the gradient.
- **the runtime's own CPU work** (hooks, buffer bookkeeping, FSDP2's DTensor dispatch) is not
  derived from the shapes: a caller that measured it (``host_overhead_s``: a system's step at
  W = 1 minus the model's, on a host backend) adds it to the step. On an accelerator it runs
  ahead of the device and costs nothing, so it is 0 by default.
- **compressed communication** (raggedfsdp): the collectives move the messages of codes and
  scales (:mod:`.wire`), and quantizing and dequantizing add their memory traffic at memory
  bandwidth to the step, on the compute thread (``codec_s``).
- **CPU offload** (``step.offload``): every all-gather first copies the rank's shards from
  the host (master dtype, host to device), every reduce-scatter's shard goes back (master
  dtype, device to host), both over the device's PCIe link (:meth:`Hardware.offload_rates`).
  raggedfsdp issues these copies on the compute stream (``runtime/_offload.py``; it has no
  stream of its own), so they run one after another with the compute and each adds its whole
  time to the step (``host_copy_s``): the all-gather waits for its copy, the compute after it
  waits too. FSDP2 copies on its all-gather copy-in stream and its post-reduce stream
  (``_fsdp_collectives.py``), so a copy runs in series with its collective but beside the
  compute: it lengthens the collective's own time, which overlaps as above. The optimizer step
  runs on the host, at the rank's share of the node's host memory bandwidth.
- FSDP2 on the same shapes moves its padded per-parameter shards and copies them in and out of
  its collective buffers (``2 x`` the buffer, read and write, at memory bandwidth), in the
  critical path. Where the backend has no reduce-scatter of its own
  (:attr:`Hardware.native_reduce_scatter` off: Gloo), FSDP2's is an all-reduce of the whole
  gradient: twice the ring's steps and bytes, and the clone of its input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from .cost import StepShape, UnitBytes
from .hardware import Hardware
from .shapes import ModelShape
from .wire import codec_traffic_bytes

__all__ = ["CollectiveBytes", "StepTime", "collective_bytes", "host_copy_bytes", "step_time"]


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


def _gathers(units: Sequence[UnitBytes], system: str) -> list[UnitBytes]:
    """Units all-gathered in one step: every unit in forward, then in backward every block
    but the last (raggedfsdp keeps it unsharded; FSDP2 gathers it again)."""
    blocks = list(units[:-1])
    again = blocks if system == "fsdp2" else blocks[:-1]
    return [*units, *again]


def _shard(unit: UnitBytes, system: str) -> int:
    return unit.fsdp2_shard_numel if system == "fsdp2" else unit.shard_numel


def _gather_bytes(unit: UnitBytes, step: StepShape, system: str) -> int:
    """One all-gather of ``unit``: the rank's shards, or its messages under compression."""
    comm = step.param_dtype.itemsize
    if system == "fsdp2":
        return unit.fsdp2_shard_numel * comm
    return unit.gather_bytes(comm, step.compression)


def _scatter_share(unit: UnitBytes, step: StepShape, system: str) -> int:
    """What the rank sends each peer in ``unit``'s reduce-scatter."""
    comm = step.param_dtype.itemsize
    if system == "fsdp2":
        return unit.fsdp2_shard_numel * comm
    return unit.scatter_share(comm, step.compression)


def collective_bytes(
    units: Sequence[UnitBytes], step: StepShape, world_size: int, system: str = "raggedfsdp"
) -> CollectiveBytes:
    """Bytes per step per rank of each collective kind (no HSDP: no all-reduce); under
    compression (raggedfsdp) the messages of codes and scales (:mod:`.wire`)."""
    w = world_size
    gathered = _gathers(units, system)
    reduced = [u for u in units if u.trainable_shard_numel]
    ag = sum(_gather_bytes(u, step, system) for u in gathered)
    rs = sum(_scatter_share(u, step, system) for u in reduced)
    calls = 1 if system == "fsdp2" else None  # FSDP2: one all-gather per unit
    return CollectiveBytes(
        all_gather_calls=sum(calls or u.buckets for u in gathered),
        all_gather_bytes=ag,
        reduce_scatter_calls=sum(calls or u.buckets for u in reduced),
        reduce_scatter_bytes=w * rs,
        wire_bytes=(w - 1) * (ag + rs) if w > 1 else 0,
    )


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


def _ring_s(hw: Hardware, world_size: int, shard_bytes: float, calls: int) -> float:
    """One unit's all-gather (or reduce-scatter): ``calls`` ring collectives whose shards add
    up to ``shard_bytes``."""
    if world_size == 1:
        return 0.0
    steps = world_size - 1
    return steps * (
        calls * hw.hop_latency_s(world_size) + shard_bytes / hw.link_bytes_per_s(world_size)
    )


def step_time(
    shape: ModelShape,
    units: Sequence[UnitBytes],
    step: StepShape,
    hw: Hardware,
    world_size: int,
    *,
    optimizer_bytes: int,
    system: str = "raggedfsdp",
    host_overhead_s: float = 0.0,
) -> StepTime:
    """The step time of ``system`` at ``world_size`` (module docstring: the model);
    ``host_overhead_s``: the system's measured CPU work per step beyond the model, added.

    Long by nature: the forward and backward pipelines, written out.
    """
    if host_overhead_s < 0:
        raise ValueError(f"host_overhead_s must be >= 0, got {host_overhead_s}")
    w = world_size
    rate = hw.peak_flops * hw.efficiency
    fsdp2 = system == "fsdp2"
    Cost = Callable[[UnitBytes, int], float]  # one collective's seconds from its bytes

    def over(link: Hardware) -> Cost:
        """A collective's seconds over ``link``."""

        def seconds(unit: UnitBytes, nbytes: int) -> float:
            ring = _ring_s(link, w, nbytes, 1 if fsdp2 else unit.buckets)
            # FSDP2's copy-out of the all-gather / copy-in of the reduce-scatter, read and write
            return ring + 2 * w * nbytes / hw.memory_bytes_per_s if fsdp2 else ring

        return seconds

    def link_cpu(unit: UnitBytes, nbytes: int) -> float:
        """The CPU a collective's bytes cost on the slower link (host backends only)."""
        slow = w > hw.devices_per_node and not hw.overlaps
        return (w - 1) * nbytes * hw.link_cpu_s_per_byte if slow else 0.0

    def collectives(cost: Cost) -> tuple[list[float], list[float]]:
        """Each unit's all-gather and reduce-scatter by ``cost``."""
        gathers = [cost(u, _gather_bytes(u, step, system)) for u in units]
        # where the backend has no reduce-scatter, FSDP2's is an all-reduce of a clone: twice
        twice = 2 if fsdp2 and not hw.native_reduce_scatter else 1
        scatters = [
            twice * cost(u, _scatter_share(u, step, system)) if u.trainable_shard_numel else 0.0
            for u in units
        ]
        return gathers, scatters

    pcie = hw.offload_rates(w)[0] if step.offload else 1.0
    h2d, d2h = host_copy_bytes(units, step, system)
    fwd = [shape.forward_flops_per_token(s, step.seq_len) * step.tokens / rate for s in shape.units]
    ag_total, rs_total = collectives(over(hw))
    if fsdp2:  # its copies run on its collectives' streams, in series with them
        ag_total = [t + b / pcie for t, b in zip(ag_total, h2d, strict=True)]
        rs_total = [t + b / pcie for t, b in zip(rs_total, d2h, strict=True)]
    # What the host's cores do (no overlap: the collectives at the host's own speed); the rest
    # of each collective is waiting for a slower link, which the prefetch overlaps with compute.
    ag_host, rs_host = (
        collectives(over(hw.unthrottled())) if not hw.overlaps else ([0.0] * len(units),) * 2
    )
    ag = [max(0.0, t - h) for t, h in zip(ag_total, ag_host, strict=True)]
    rs = [max(0.0, t - h) for t, h in zip(rs_total, rs_host, strict=True)]
    ag_cpu, rs_cpu = collectives(link_cpu)  # the slower link's own CPU, on the compute's core
    blocks = range(len(units) - 1)
    # checkpointing recomputes every unit's forward but the root's
    recompute = [f if step.checkpointing else 0.0 for f in fwd[:-1]] + [0.0]
    bwd = [2 * f + r for f, r in zip(fwd, recompute, strict=True)]

    def at(values: list[float], i: int) -> float:
        return values[i] if 0 <= i < len(blocks) else 0.0

    def beside(compute: float, cpu: float, waiting: float) -> float:
        """Compute beside a collective: the core does both, the link waits."""
        return max(compute + cpu, waiting)

    forward = beside(0.0, ag_cpu[-1], ag[-1]) + beside(0.0, at(ag_cpu, 0), at(ag, 0)) + fwd[-1]
    forward += sum(beside(fwd[i], at(ag_cpu, i + 1), at(ag, i + 1)) for i in blocks)
    last = len(blocks) - 1
    # FSDP2 gathers the last block again under the head's backward
    regather = (at(ag_cpu, last), at(ag, last)) if fsdp2 else (0.0, 0.0)
    backward = beside(bwd[-1], *regather)
    backward += sum(
        beside(bwd[i], at(ag_cpu, i - 1) + at(rs_cpu, i + 1), at(ag, i - 1) + at(rs, i + 1))
        for i in blocks
    )
    backward += beside(0.0, at(rs_cpu, 0), at(rs, 0)) + beside(0.0, rs_cpu[-1], rs[-1])
    optimizer = _optimizer_s(units, step, hw, w, optimizer_bytes, system)
    regathered = blocks if fsdp2 else range(last)
    # raggedfsdp's copies hold up the compute stream: every gather's and every reduce's
    copies = 0.0 if fsdp2 else (sum(h2d) + sum(h2d[i] for i in regathered) + sum(d2h)) / pcie
    codec = 0.0 if fsdp2 else _codec_s(units, step, hw, w, set(regathered))
    forward += sum(ag_host)  # the host's share, one collective after another
    backward += sum(ag_host[i] for i in regathered) + sum(rs_host)
    total = forward + backward + optimizer + codec + host_overhead_s + copies
    comm_s = sum(ag_total) + sum(ag_total[i] for i in regathered) + sum(rs_total)
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


def host_copy_bytes(
    units: Sequence[UnitBytes], step: StepShape, system: str = "raggedfsdp"
) -> tuple[list[int], list[int]]:
    """CPU offload: per unit, the bytes one all-gather copies host to device (the rank's
    shards in the master dtype: the cast happens on the device) and the bytes its
    reduce-scatter's shard copies back (master dtype, cast on the device first); FSDP2's are its
    padded shards (rank 0's: the largest). Zeros without offload."""
    if not step.offload:
        return [0] * len(units), [0] * len(units)
    master = step.master_dtype.itemsize
    h2d = [_shard(u, system) * master for u in units]
    if system == "fsdp2":
        d2h = [u.fsdp2_shard_numel * master if u.trainable_shard_numel else 0 for u in units]
    else:
        d2h = [u.trainable_shard_numel * master for u in units]
    return h2d, d2h


def _optimizer_s(
    units: Sequence[UnitBytes],
    step: StepShape,
    hw: Hardware,
    world_size: int,
    optimizer_bytes: int,
    system: str,
) -> float:
    """The optimizer step, bound by memory bandwidth: it reads and writes the shards and the
    state and reads the gradients; on the host under offload, where the node's ranks share its
    memory bandwidth."""
    local = sum(_shard(u, system) for u in units) * step.master_dtype.itemsize
    traffic = 2 * local + local + 2 * optimizer_bytes
    if step.offload:
        return traffic / hw.offload_rates(world_size)[1]
    return traffic / hw.memory_bytes_per_s


def _codec_s(
    units: Sequence[UnitBytes], step: StepShape, hw: Hardware, world_size: int, again: set[int]
) -> float:
    """Seconds of quantizing and dequantizing on the compute thread in one step: their memory
    traffic (:func:`.wire.codec_traffic_bytes`) at memory bandwidth; units in ``again`` are
    all-gathered twice."""
    if step.compression is None or world_size == 1:
        return 0.0
    traffic = sum(
        codec_traffic_bytes(
            u.shards,
            u.messages,
            2 if i in again else 1,
            u.trainable,
            world_size,
            step.compression,
            param_itemsize=step.param_dtype.itemsize,
            master_itemsize=step.master_dtype.itemsize,
        )
        for i, u in enumerate(units)
    )
    return traffic / hw.memory_bytes_per_s
