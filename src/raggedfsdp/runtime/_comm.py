"""How each bucket communicates: one all-gather and one reduce-scatter strategy per bucket.

The strategies (:class:`AllGather`, :class:`ReduceScatter` and their kinds, by what this rank sends
from where) are chosen once, when ``fully_shard`` builds the bucket, and kept on its DBuffer ([Note:
one strategy per bucket] at :class:`AllGather`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._collectives import Pending, all_gather, all_reduce, reduce_scatter
from ._mesh import MeshInfo
from ._metrics import RuntimeStats
from ._offload import HostOffload
from ._pool import BufferPool

__all__ = [
    "AllGather",
    "BucketReduce",
    "CastAllGather",
    "CastReduceScatter",
    "CopyInAllGather",
    "HostOffloadAllGather",
    "InPlaceAllGather",
    "InPlaceReduceScatter",
    "ReduceScatter",
]


# [Note: one strategy per bucket] Everything that decides how a bucket's parameters are gathered and
# its gradients reduced (zero copy or not, mixed precision, CPU offload, compression) is fixed when
# ``fully_shard`` builds the bucket. So the choice is made there, once, and kept on the bucket's
# DBuffer as two objects, ``bucket.gather`` (an :class:`AllGather`) and ``bucket.reduce`` (a
# :class:`ReduceScatter`, ``None`` for a frozen bucket), as FSDP2 keeps its ``AllGather`` and
# ``ReduceScatter`` comm objects (``_fsdp_api.py``). The parameter group calls them without looking
# at the configuration again, and whatever a strategy keeps between calls (the HSDP shard held back
# from the replicas' all-reduce here; the quantized shard and the error-feedback residual in
# ``compression/``) lives on the strategy object, one per bucket.
#
# The all-gathers, by what this rank sends from where:
#
# - :class:`InPlaceAllGather` (zero copy, no cast): the shard as it lies; parameters this rank holds
#   whole are views of it, so nothing of theirs is placed;
# - :class:`CastAllGather` (mixed precision): the fp32 shard cast into its bf16 slot of ``full`` --
#   that cast is the only copy, and the all-gather then runs in place;
# - :class:`HostOffloadAllGather` (CPU offload): the host shard copied into its device slot;
# - :class:`CopyInAllGather` (``zero_copy=False``): a copy of the shard, FSDP2's copy-in, for A/B
#   measurement;
# - ``compression.QuantizedAllGather``: codes and scales.
#
# The reduce-scatters: :class:`InPlaceReduceScatter` reads the unsharded gradient block as it lies,
# :class:`CastReduceScatter` casts it to ``reduce_dtype`` first, and
# ``compression.QuantizedReduceScatter`` sends codes and scales.
class AllGather(ABC):
    """How one bucket's unsharded buffer is filled with every rank's shard ([Note: one strategy
    per bucket])."""

    #: whether parameters this rank holds whole may be views of its shard when unsharded
    #: (``DBuffer.bind_full``): only when the shard itself is what is sent, so no copy or
    #: transform of it is needed in ``full``
    whole_from_local: bool = False

    def all_gather(
        self,
        full: torch.Tensor,
        local: torch.Tensor,
        stats: RuntimeStats,
        pool: BufferPool,
        *,
        own_ranges: Sequence[tuple[int, int]],
    ) -> Pending:
        """Issue the all-gather of ``local`` (this rank's shard ``[S]``) into ``full`` (1-D
        ``[W*S]``), both steps on the current stream; ``own_ranges``: the pieces of this rank's
        slot that unsharded views read (``DBuffer.own_ranges``). Scratch comes from ``pool``.
        The parameter group runs the steps on streams of their own ([Note: streams and events]
        in ``_streams.py``)."""
        sent = self.copy_in(full, local, stats, pool)
        return self.issue(full, sent, stats, pool, own_ranges=own_ranges)

    @abstractmethod
    def copy_in(
        self, full: torch.Tensor, local: torch.Tensor, stats: RuntimeStats, pool: BufferPool
    ) -> torch.Tensor:
        """What this rank sends, made from its shard ``local``: ``local`` itself, or a copy (in
        its slot of ``full`` when the copy is a cast or a move, so the all-gather places nothing
        more), or a message (compressed). Runs on the all-gather copy-in stream."""

    @abstractmethod
    def issue(
        self,
        full: torch.Tensor,
        sent: torch.Tensor,
        stats: RuntimeStats,
        pool: BufferPool,
        *,
        own_ranges: Sequence[tuple[int, int]],
    ) -> Pending:
        """Issue the collective of ``sent`` (what :meth:`copy_in` made) into ``full``; what
        must follow its transfers (a dequantize) is the ``Pending``'s ``then``. Runs on the
        all-gather stream, and so does the wait for it."""

    def shard_may_change(self) -> None:
        """An iteration that reduced gradients ended: an optimizer step may change the shard
        before the next all-gather. Nothing to drop unless the strategy keeps something made
        from the shard."""
        return


class _PlainAllGather(AllGather):
    """The plain all-gather of the values themselves, ``_collectives.all_gather`` (NCCL's in
    place, Gloo's point to point unless ``gloo_point_to_point`` is off), of a shard each
    subclass puts somewhere (:meth:`copy_in`)."""

    def __init__(
        self, group: dist.ProcessGroup, rank: int, *, gloo_point_to_point: bool = True
    ) -> None:
        self.group = group
        self.rank = rank  # this rank's index in ``group``: its slot of ``full``
        self.gloo_point_to_point = gloo_point_to_point  # DBufferConfig's

    def issue(
        self,
        full: torch.Tensor,
        sent: torch.Tensor,
        stats: RuntimeStats,
        pool: BufferPool,
        *,
        own_ranges: Sequence[tuple[int, int]],
    ) -> Pending:
        return all_gather(
            full,
            sent,
            self.group,
            stats,
            own_ranges=own_ranges,
            gloo_point_to_point=self.gloo_point_to_point,
        )

    def _slot(self, full: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        size = local.numel()
        return full[self.rank * size : (self.rank + 1) * size]


class InPlaceAllGather(_PlainAllGather):
    """Zero copy, no cast: the shard is sent from where it lies."""

    whole_from_local = True

    def copy_in(
        self, full: torch.Tensor, local: torch.Tensor, stats: RuntimeStats, pool: BufferPool
    ) -> torch.Tensor:
        return local


class CastAllGather(_PlainAllGather):
    """Mixed precision: the master shard is cast into its slot of the ``param_dtype`` buffer;
    this cast is the only copy, and the all-gather then runs in place."""

    def copy_in(
        self, full: torch.Tensor, local: torch.Tensor, stats: RuntimeStats, pool: BufferPool
    ) -> torch.Tensor:
        slot = self._slot(full, local)
        slot.copy_(local)
        stats.add_copy(slot)
        return slot


class HostOffloadAllGather(_PlainAllGather):
    """CPU offload: the host shard is copied into its device slot (cast there under mixed
    precision, ``HostOffload.to_device``): the only copy. Parameters this rank holds whole are
    views of ``full`` too, never of host memory the compute must not read."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        offload: HostOffload,
        *,
        gloo_point_to_point: bool = True,
    ) -> None:
        super().__init__(group, rank, gloo_point_to_point=gloo_point_to_point)
        self.offload = offload  # the unit's, shared by its buckets

    def copy_in(
        self, full: torch.Tensor, local: torch.Tensor, stats: RuntimeStats, pool: BufferPool
    ) -> torch.Tensor:
        slot = self._slot(full, local)
        self.offload.to_device(slot, local, pool, stats)
        return slot


class CopyInAllGather(_PlainAllGather):
    """``zero_copy=False``: FSDP2-style copy-in of the shard, kept for A/B measurement."""

    def copy_in(
        self, full: torch.Tensor, local: torch.Tensor, stats: RuntimeStats, pool: BufferPool
    ) -> torch.Tensor:
        shard = local.clone()
        stats.add_copy(shard)
        return shard


@dataclass
class BucketReduce:
    """One bucket's gradient reduction in flight: its reduce-scatter, then (HSDP) the
    all-reduce over the replicas; owned by the bucket's parameter group from issue to finish."""

    scatter: Pending
    #: 1-D [S] in the reduce dtype: the reduce-scatter writes it; it becomes the sharded
    #: gradients (or is added to them)
    output: torch.Tensor
    #: what the reduce-scatter reads (the unsharded gradients, or their cast), kept alive until
    #: it is done
    scatter_input: torch.Tensor | None
    replicate: Pending | None = None  # HSDP: the all-reduce of ``output``, once issued


class ReduceScatter(ABC):
    """How one trainable bucket's unsharded gradient becomes this rank's reduced shard, the
    mean over the shard group, then (HSDP) over the replicas ([Note: one strategy per
    bucket])."""

    def __init__(self, mesh: MeshInfo, *, gloo_point_to_point: bool = True) -> None:
        self.group = mesh.shard_group
        self.replicate_group = mesh.replicate_group  # HSDP; None without replicas
        #: DBufferConfig's: on Gloo, point to point (else the collectives NCCL runs)
        self.gloo_point_to_point = gloo_point_to_point
        #: HSDP: a reduced shard a backward without the all-reduce over the replicas kept
        #: (``set_requires_all_reduce(False)``), until a backward with it adds it in
        self.unreplicated: torch.Tensor | None = None

    @abstractmethod
    def reduce_scatter(
        self, full_grad: torch.Tensor, stats: RuntimeStats, pool: BufferPool
    ) -> BucketReduce:
        """Issue the reduce-scatter of ``full_grad`` (1-D ``[W*S]``, the unsharded gradients)
        into a fresh ``[S]`` output: when no sharded gradient is held it becomes the gradient
        itself (the sharded grads are views of it), so it lives exactly as long as they do and
        ``zero_grad(set_to_none=True)`` frees it, as in FSDP2."""

    def accumulate(self, full_grad: torch.Tensor, stats: RuntimeStats, pool: BufferPool) -> bool:
        """A backward that does not reduce (no_sync) ends with ``full_grad`` (1-D ``[W*S]``,
        the unsharded gradients): return whether the strategy took it into an accumulation of
        its own, so the caller may clear or free it. Here it does not: the gradients stay and
        the next backward adds to them in their own dtype."""
        return False

    def drop_accumulated(self) -> torch.Tensor | None:
        """An interrupted iteration: forget what :meth:`accumulate` took and return its block,
        for the caller to give back to the pool (``None``: nothing, as here)."""
        return None

    def replicate(self, item: BucketReduce, stats: RuntimeStats, *, all_reduce_now: bool) -> None:
        """HSDP, once ``item``'s reduce-scatter is done: add what earlier backwards without the
        all-reduce kept, then issue the all-reduce over the replicas (``all_reduce_now``) or
        keep the shard for a later backward."""
        assert self.replicate_group is not None
        if self.unreplicated is not None:
            item.output.add_(self.unreplicated)
            self.unreplicated = None
        if all_reduce_now:
            item.replicate = all_reduce(item.output, self.replicate_group, stats)
        else:
            self.unreplicated = item.output

    def check_replicated(self, output: torch.Tensor) -> None:
        """HSDP, after the all-reduce of ``output`` over the replicas: raise if what it brought
        cannot be used. Nothing to check unless the strategy defers errors to here."""
        return

    def error_feedback_state(self) -> torch.Tensor | None:
        """The per-rank state this strategy keeps across steps that a checkpoint must save (an
        error-feedback residual), or ``None``."""
        return None


class InPlaceReduceScatter(ReduceScatter):
    """The unsharded gradient block is reduced as it lies (``_collectives.reduce_scatter``:
    NCCL's ``AVG``, Gloo's point to point summed in rank order): no copy-in, no copy-out."""

    def __init__(
        self, mesh: MeshInfo, shard_numel: int, *, gloo_point_to_point: bool = True
    ) -> None:
        super().__init__(mesh, gloo_point_to_point=gloo_point_to_point)
        self.shard_numel = shard_numel

    def reduce_scatter(
        self, full_grad: torch.Tensor, stats: RuntimeStats, pool: BufferPool
    ) -> BucketReduce:
        return self._scatter(full_grad, stats, pool)

    def _scatter(
        self, scatter_input: torch.Tensor, stats: RuntimeStats, pool: BufferPool
    ) -> BucketReduce:
        output = torch.empty(
            self.shard_numel, dtype=scatter_input.dtype, device=scatter_input.device
        )
        scatter = reduce_scatter(
            output,
            scatter_input,
            self.group,
            stats,
            scratch=pool,
            gloo_point_to_point=self.gloo_point_to_point,
        )
        return BucketReduce(scatter, output, scatter_input)


class CastReduceScatter(InPlaceReduceScatter):
    """``MixedPrecisionPolicy.reduce_dtype`` other than the gradients': the block is cast to it
    first (one copy, read by the reduce-scatter). The cast is a block of the scratch pool, so
    it is counted with the unsharded bytes (``W S`` of the reduce dtype: a Llama-70B layer's
    gradient in fp32 is 3.4 GB) and reused by the next unit once the reduce-scatter is done.

    Backwards that do not reduce (no_sync: gradient accumulation, torchtitan's chunked loss)
    leave their gradients here, summed in the reduce dtype (:meth:`accumulate`), and the
    backward that reduces adds its own to that sum and sends it, as FSDP2 does with its
    ``unsharded_accumulated_grad``: bf16 micro-batch gradients are added in fp32, not rounded
    to bf16 at each addition, and the numbers are FSDP2's bit for bit."""

    def __init__(
        self,
        mesh: MeshInfo,
        shard_numel: int,
        reduce_dtype: torch.dtype,
        *,
        gloo_point_to_point: bool = True,
    ) -> None:
        super().__init__(mesh, shard_numel, gloo_point_to_point=gloo_point_to_point)
        self.reduce_dtype = reduce_dtype
        #: the unsharded gradients of the backwards since the last reduction, in the reduce
        #: dtype (a block of the pool, ``[W*S]``), while any backward did not reduce
        self.accumulated: torch.Tensor | None = None

    def accumulate(self, full_grad: torch.Tensor, stats: RuntimeStats, pool: BufferPool) -> bool:
        """``full_grad`` added into :attr:`accumulated` (the first one cast into it)."""
        if self.accumulated is None:
            self.accumulated = self._cast(full_grad, stats, pool)
        else:
            self.accumulated.add_(full_grad)
        return True

    def drop_accumulated(self) -> torch.Tensor | None:
        block, self.accumulated = self.accumulated, None
        return block

    def reduce_scatter(
        self, full_grad: torch.Tensor, stats: RuntimeStats, pool: BufferPool
    ) -> BucketReduce:
        if self.accumulated is None:
            scatter_input = self._cast(full_grad, stats, pool)
        else:  # this backward's gradients join those of the backwards that did not reduce
            scatter_input, self.accumulated = self.accumulated, None
            scatter_input.add_(full_grad)
        item = self._scatter(scatter_input, stats, pool)
        item.scatter.then = _then_give_back(item.scatter.then, pool, scatter_input)
        return item

    def _cast(self, full_grad: torch.Tensor, stats: RuntimeStats, pool: BufferPool) -> torch.Tensor:
        """``full_grad`` cast into a block of the pool in the reduce dtype."""
        cast = pool.take(full_grad.numel(), self.reduce_dtype, full_grad.device)
        cast.copy_(full_grad)
        stats.add_copy(cast)
        return cast


def _then_give_back(
    then: Callable[[], None] | None, pool: BufferPool, block: torch.Tensor
) -> Callable[[], None]:
    """``then`` (what a collective runs once its transfers are done), then ``block`` back to
    ``pool``: the collective no longer reads it."""

    def done() -> None:
        if then is not None:
            then()
        pool.give(block)

    return done
