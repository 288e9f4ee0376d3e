"""The collectives the runtime issues, as free functions over explicit buffers.

Each returns a :class:`Pending` that carries the work handles; ``wait()`` blocks (timed into the
stats as exposed communication) and is idempotent. Everything is labelled for the profiler.
Collectives use the process group's timeout, so a rank that fails leaves the others with an
error rather than a hang.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from ._metrics import RuntimeStats
from ._pool import BufferPool
from ._transport import (
    Tag,
    all_gather_tensor,
    exchange,
    peers,
    point_to_point,
    reduce_scatter_tensor,
    world_tensor,
)

__all__ = ["Pending", "all_gather", "all_reduce", "reduce_scatter"]


@dataclass
class Pending:
    """An issued collective: its work handles (empty once waited, or when it ran inline), and
    what must run once they are done (``then``, e.g. the local sum of a Gloo reduce-scatter)."""

    works: list[dist.Work]
    stats: RuntimeStats
    then: Callable[[], None] | None = None

    @classmethod
    def of(cls, work: dist.Work | None, stats: RuntimeStats) -> Pending:
        """A native collective's handle (``None`` when it ran synchronously)."""
        return cls([work] if work is not None else [], stats)

    def wait(self, *, timed: bool = True) -> None:
        """Wait for the works, then run ``then``; ``timed``: the wait counts as exposed
        communication (not when only a communication stream waits, ``_streams.wait_all``)."""
        if self.works:
            # Labelled so profiles attribute what the backend does inside wait() to the
            # backend, not to the framework.
            with (
                self.stats.waiting() if timed else contextlib.nullcontext(),
                record_function("raggedfsdp::wait"),
            ):
                for work in self.works:
                    work.wait()
            self.works = []
        if self.then is not None:
            then, self.then = self.then, None
            then()


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: RuntimeStats,
    *,
    own_ranges: Sequence[tuple[int, int]] | None = None,
    async_op: bool = True,
    gloo_point_to_point: bool = True,
) -> Pending:
    """``output[r*S:(r+1)*S] = shard of rank r``; ``output`` is the unsharded bucket buffer.

    ``own_ranges`` (``(start, end)`` within the shard) limits what must land in this rank's own
    slot to what is read from there; ``None`` means all of it. ``gloo_point_to_point=False``
    runs NCCL's in-place all-gather on Gloo too (``DBufferConfig.gloo_point_to_point``).

    [Note: all-gather on Gloo] Gloo's all-gather allocates a flat output of its own, copies the
    input into it and copies all ``W`` chunks back out: ``(W+1)*S`` elements copied, and ``W*S``
    faulted in afresh whenever the allocator has returned that staging buffer to the OS.
    Point-to-point transfers write each peer's shard straight into its slot of ``output`` and
    send ``shard`` from where it lies, so the only copy left is this rank's own chunk into its
    slot -- the placement NCCL's kernel does on the GPU -- made here and counted, and only
    ``own_ranges`` of it: parameters a rank holds whole are views of its shard, so only the
    pieces of parameters that cross a rank boundary are copied (``benchmarks/
    bench_collectives.py``: 0.82x of Gloo's CPU time at a 6 MiB shard on 2 ranks, 0.64x at 24
    MiB). NCCL keeps its native in-place all-gather.
    """
    with record_function("raggedfsdp::all_gather"):
        nbytes = shard.numel() * shard.element_size()
        stats.note_all_gather(nbytes, uncompressed_bytes=nbytes)
        if point_to_point(group, output.device, gloo_point_to_point=gloo_point_to_point):
            pending = _gloo_all_gather(output, shard, group, stats, own_ranges)
        else:
            work = all_gather_tensor(output, shard, group=group, async_op=async_op)
            pending = Pending.of(work, stats)
    if not async_op:
        pending.wait()
    return pending


def _gloo_all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: RuntimeStats,
    own_ranges: Sequence[tuple[int, int]] | None,
) -> Pending:
    size = shard.numel()
    rank, others = peers(group)
    transfers = [(peer, shard, output[peer * size : (peer + 1) * size]) for peer in others]
    works = exchange(transfers, group, Tag.ALL_GATHER)
    own = output[rank * size : (rank + 1) * size]
    if own.data_ptr() != shard.data_ptr():
        for start, end in [(0, size)] if own_ranges is None else own_ranges:
            own[start:end].copy_(shard[start:end])
            stats.add_copy(own[start:end])
    return Pending(works, stats)


def reduce_scatter(
    output: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: RuntimeStats,
    *,
    scratch: BufferPool | None = None,
    async_op: bool = True,
    gloo_point_to_point: bool = True,
) -> Pending:
    """``output = mean over ranks of full[r*S:(r+1)*S]`` for this rank ``r``;
    ``gloo_point_to_point=False`` runs NCCL's ``AVG`` reduce-scatter on Gloo too.

    [Note: reduce-scatter on Gloo] Gloo's reduce-scatter clones its whole input, all-reduces
    it, and copies this rank's chunk out: twice the traffic and two full-size copies on CPU.
    Instead, chunk ``k`` of ``full`` is sent straight to rank ``k`` and the ``W-1`` chunks meant
    for this rank are received into a scratch buffer (from ``scratch``, so consecutive units
    reuse it rather than fault fresh memory in), then summed in rank order with this rank's own
    chunk, read in place: the bytes of a ring reduce-scatter and no copy (0.3x to 0.6x of Gloo's
    CPU time, ``benchmarks/bench_collectives.py``). NCCL keeps its native kernel.
    """
    with record_function("raggedfsdp::reduce_scatter"):
        nbytes = full.numel() * full.element_size()
        stats.note_reduce_scatter(nbytes, uncompressed_bytes=nbytes)
        if point_to_point(group, full.device, gloo_point_to_point=gloo_point_to_point):
            pending = _gloo_reduce_scatter(output, full, group, stats, scratch)
        else:
            work = reduce_scatter_tensor(
                output, full, op=dist.ReduceOp.AVG, group=group, async_op=async_op
            )
            pending = Pending.of(work, stats)
    if not async_op:
        pending.wait()
    return pending


def _gloo_reduce_scatter(
    output: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: RuntimeStats,
    scratch: BufferPool | None,
) -> Pending:
    size = output.numel()
    rank, others = peers(group)
    world = len(others) + 1
    numel = (world - 1) * size
    if scratch is not None:
        received = scratch.take(numel, full.dtype, full.device)
    else:
        received = torch.empty(numel, dtype=full.dtype, device=full.device)
    chunks = {rank: full[rank * size : (rank + 1) * size]}
    for i, peer in enumerate(others):
        chunks[peer] = received[i * size : (i + 1) * size]
    transfers = [(peer, full[peer * size : (peer + 1) * size], chunks[peer]) for peer in others]
    works = exchange(transfers, group, Tag.REDUCE_SCATTER)

    def mean() -> None:
        divisor = world_tensor(world, output.dtype, output.device)
        if world == 1:
            torch.div(chunks[0], divisor, out=output)
        else:
            # In rank order, as a sum over a [W, S] stack would add them.
            torch.add(chunks[0], chunks[1], out=output)
            for k in range(2, world):
                output.add_(chunks[k])
            output.div_(divisor)
        if scratch is not None:
            scratch.give(received)

    return Pending(works, stats, mean)


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: RuntimeStats,
    *,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.AVG,
    async_op: bool = True,
) -> Pending:
    """In-place all-reduce (HSDP: average the reduced shard over the replicas): the same call on
    every backend."""
    with record_function("raggedfsdp::all_reduce"):
        stats.all_reduce_calls += 1
        stats.all_reduce_bytes += tensor.numel() * tensor.element_size()
        # [Note: torch's collectives looked up per call] in ``_transport.py``
        work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return Pending.of(work, stats)
