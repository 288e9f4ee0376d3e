"""One FSDP unit's parameters: its buckets, and unshard / reshard / reduce over them.

Layering runs one way: hooks (``backend.py``) -> this group -> collectives -> DBuffers.
The group owns the state of its parameters; the hooks only decide *when* to call it.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function

from .collectives import Pending, all_gather, all_reduce, reduce_scatter
from .dbuffer import DBuffer, DBufferConfig, FlatStorage, carve, packed_nbytes
from .metrics import RuntimeStats
from .planner import StructAwarePlanner, split_by_bytes
from .pool import BufferPool

__all__ = ["FSDPParamGroup", "MeshInfo", "MixedPrecisionPolicy", "ShardedState", "TrainingState"]


class ShardedState(enum.Enum):
    SHARDED = enum.auto()  # modules hold the sharded parameters; no unsharded storage
    UNSHARDING = enum.auto()  # all-gathers issued, not yet waited
    UNSHARDED = enum.auto()  # modules hold the unsharded parameters (views of DBuffer.full)


class TrainingState(enum.Enum):
    IDLE = enum.auto()  # between steps
    FORWARD = enum.auto()  # inside this unit's forward
    PRE_BACKWARD = enum.auto()  # this unit's backward has started (gradients flowing in)
    POST_BACKWARD = enum.auto()  # this unit's backward is done; its reduce-scatter is issued


@dataclass(frozen=True, kw_only=True)
class MixedPrecisionPolicy:
    """Dtypes for the unsharded parameters and the gradient reduction; master shards keep their
    own dtype (fp32). ``None`` keeps the parameter's dtype; ``reduce_dtype=None`` reduces in
    ``param_dtype`` (as FSDP2). Floating-point forward inputs are cast to ``param_dtype``."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class MeshInfo:
    """The process groups a unit communicates over: ``shard_group`` (all-gather and
    reduce-scatter) and, for HSDP, ``replicate_group`` (all-reduce of the reduced shard)."""

    shard_group: dist.ProcessGroup
    shard_rank: int
    shard_size: int
    replicate_group: dist.ProcessGroup | None = None
    replicate_size: int = 1


@dataclass
class Registration:
    """Where one parameter is registered: every ``(module, attribute)`` (tied parameters have
    several), so unshard and reshard can swap what the modules hold."""

    fqn: str
    param: nn.Parameter
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)


class ReduceQueue:
    """Gradient reductions in flight, shared by all units of a model.

    A unit issues the reduce-scatters of all its buckets together. Before it does, those of
    earlier units are finished (in order) until fewer than ``depth`` units have any in flight,
    so their gradient blocks and receive buffers are back in the pool for this unit to reuse
    rather than held beside its own. By then they have had a whole unit's backward to complete.
    Under HSDP a finished reduce-scatter issues the all-reduce of its shard over the replicas,
    which likewise stays in flight through the next unit's backward.
    """

    def __init__(self, depth: int = 1) -> None:
        self.depth = depth
        self._scattering: deque[list[_PendingReduce]] = deque()
        self._replicating: deque[list[_PendingReduce]] = deque()

    def make_room(self) -> None:
        while len(self._replicating) >= self.depth:
            _finish(self._replicating.popleft())
        while len(self._scattering) >= self.depth:
            self._scattered(self._scattering.popleft())

    def push(self, unit: list[_PendingReduce]) -> None:
        self._scattering.append(unit)

    def drain(self) -> None:
        while self._scattering:
            self._scattered(self._scattering.popleft())
        while self._replicating:
            _finish(self._replicating.popleft())

    def _scattered(self, unit: list[_PendingReduce]) -> None:
        for item in unit:
            item.scattered()
        if any(item.replicas is not None for item in unit):
            self._replicating.append(unit)
        else:
            _finish(unit)


def _finish(unit: list[_PendingReduce]) -> None:
    for item in unit:
        item.finish()


@dataclass
class _PendingReduce:
    """A bucket's gradient reduction: its reduce-scatter, then (HSDP) the all-reduce over the
    replicas, then the sharded gradients."""

    group: FSDPParamGroup
    bucket: DBuffer
    pending: Pending
    output: torch.Tensor  # [S] in reduce dtype: becomes the sharded gradients (or is added)
    rs_input: torch.Tensor | None  # kept alive until the reduce-scatter is done
    replicas: Pending | None = None  # HSDP: the all-reduce of ``output``, once issued

    def scattered(self) -> None:
        """Wait for the reduce-scatter; the unsharded gradients are read, so the unit may free
        them; under HSDP issue the all-reduce over the replicas."""
        self.pending.wait()
        self.rs_input = None
        self.group.reduce_scattered()
        mesh = self.group.mesh_info
        if mesh.replicate_group is not None:
            self.replicas = all_reduce(self.output, mesh.replicate_group, self.group.stats)

    def finish(self) -> None:
        if self.replicas is not None:
            self.replicas.wait()
        self.group.attach_reduced(self.bucket, self.output)


class FSDPParamGroup:
    """The parameters of one ``fully_shard``-ed module, in one or more buckets."""

    def __init__(
        self,
        registrations: list[Registration],
        *,
        mesh_info: MeshInfo,
        planner: StructAwarePlanner,
        config: DBufferConfig,
        mp_policy: MixedPrecisionPolicy | None,
        device: torch.device,
        label: str,
    ) -> None:
        self.mesh_info = mesh_info
        self.config = config
        self.mp_policy = mp_policy or MixedPrecisionPolicy()
        self.device = device
        self.label = label
        self.registrations = registrations
        # Replaced by the root's shared stats, queue and pool at lazy init.
        self.stats = RuntimeStats()
        self.reduce_queue = ReduceQueue()
        self.pool = BufferPool(self.stats, retain=config.group_level)
        self.sharded_state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.requires_gradient_sync = True
        self._pending_unshard: list[Pending] = []  # all-gathers issued by unshard()
        self._reduces_in_flight = 0  # reduce-scatters issued and not yet completed
        self._owners = {r.fqn: r.owners for r in registrations}
        self.buckets = self._build_buckets(registrations, planner)
        # From here on a registration names the sharded parameter: holding the original one
        # would keep the whole unsharded model alive.
        sharded = {slot.fqn: slot.sharded for b in self.buckets for slot in b.slots}
        for reg in registrations:
            reg.param = sharded[reg.fqn]
        # Storage for the all-gather outputs; with zero copy the unsharded parameters are views
        # of it. The FSDP2-style path copies out into a second storage, as FSDP2 does.
        self._gather_storage = self._storages(self.buckets)
        self._param_storage = (
            self._gather_storage if config.zero_copy else self._storages(self.buckets)
        )
        gathered = _views(self._gather_storage)
        params = _views(self._param_storage)
        for bucket, full, param_buffer in zip(self.buckets, gathered, params, strict=True):
            whole_from_local = config.zero_copy and bucket.comm_dtype == bucket.dtype
            bucket.bind_full(full, param_buffer, whole_from_local=whole_from_local)
        for storage in self._gather_storage + self._param_storage:
            storage.free()  # views taken; memory only while unsharded
        # The unsharded gradients of all trainable buckets: one pooled block per backward.
        self._trainable = [b for b in self.buckets if b.requires_grad]
        self._grad_sizes = [(b.full_numel, b.comm_dtype) for b in self._trainable]
        self._grad_block: torch.Tensor | None = None
        for bucket in self._trainable:
            for slot in bucket.slots:
                if slot.unsharded.requires_grad:
                    slot.unsharded.register_hook(self._gradient_arrives)
        self._swap_params(unsharded=False)

    # -- construction --------------------------------------------------------------------------

    def comm_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if self.mp_policy.param_dtype is not None and dtype.is_floating_point:
            return self.mp_policy.param_dtype
        return dtype

    def reduce_dtype(self, bucket: DBuffer) -> torch.dtype:
        if self.mp_policy.reduce_dtype is not None and bucket.dtype.is_floating_point:
            return self.mp_policy.reduce_dtype
        return bucket.comm_dtype

    def _build_buckets(
        self, registrations: list[Registration], planner: StructAwarePlanner
    ) -> list[DBuffer]:
        """Group by (dtype, requires_grad) in model order, split at ``buffer_size`` bytes of the
        communication dtype, plan each bucket, and build its DBuffer."""
        groups: dict[tuple[torch.dtype, bool], list[Registration]] = {}
        for reg in registrations:
            groups.setdefault((reg.param.dtype, reg.param.requires_grad), []).append(reg)
        buckets = []
        for (dtype, requires_grad), regs in groups.items():
            comm = self.comm_dtype(dtype)
            # Plan in the narrower dtype so the alignment (in elements) suits both buffers.
            plan_dtype = comm if comm.itemsize < dtype.itemsize else dtype
            for i, chunk in enumerate(
                split_by_bytes(
                    regs, lambda r, c=comm: r.param.numel() * c.itemsize, self.config.buffer_size
                )
            ):
                name = f"{self.label}/{str(dtype).removeprefix('torch.')}"
                name += "" if requires_grad else "/frozen"
                params = {r.fqn: r.param for r in chunk}
                plan = planner.plan(
                    params, self.mesh_info.shard_size, plan_dtype, name=f"{name}/{i}"
                )
                buckets.append(
                    DBuffer(
                        plan,
                        params,
                        rank=self.mesh_info.shard_rank,
                        group=self.mesh_info.shard_group,
                        comm_dtype=comm,
                        device=self.device,
                    )
                )
        return buckets

    def _storages(self, buckets: list[DBuffer]) -> list[FlatStorage]:
        """One storage for all ``buckets`` (``group_level``), or one each."""
        sizes = [(b.full_numel, b.comm_dtype) for b in buckets]
        if not sizes:
            return []
        if self.config.group_level:
            return [FlatStorage(sizes, self.device)]
        return [FlatStorage([size], self.device) for size in sizes]

    def use_shared(self, stats: RuntimeStats, queue: ReduceQueue, pool: BufferPool) -> None:
        """Adopt the root's stats, reduce queue and scratch pool (``group_level=False``: a pool
        of its own that keeps nothing)."""
        self.stats = stats
        self.reduce_queue = queue
        self.pool = pool if self.config.group_level else BufferPool(stats, retain=False)

    def _allocate(self, storages: list[FlatStorage]) -> None:
        """Allocate the storages not yet allocated."""
        fresh = [s for s in storages if s.allocate()]
        self.stats.note_unsharded(sum(s.nbytes for s in fresh))

    def _free(self, storages: list[FlatStorage]) -> None:
        live = [s for s in {id(s): s for s in storages}.values() if s.allocated]
        for storage in live:
            storage.free()
        self.stats.note_unsharded(-sum(s.nbytes for s in live))

    def _swap_params(self, *, unsharded: bool) -> None:
        """Make the modules hold the unsharded (or sharded) parameter objects."""
        for bucket in self.buckets:
            for slot in bucket.slots:
                param = slot.unsharded if unsharded else slot.sharded
                for module, attr in self._owners[slot.fqn]:
                    module._parameters[attr] = param

    def sharded_parameters(self) -> list[nn.Parameter]:
        return [slot.sharded for bucket in self.buckets for slot in bucket.slots]

    # -- unshard / reshard ---------------------------------------------------------------------

    def unshard(self) -> None:
        """Issue the all-gathers of every bucket (asynchronously); idempotent."""
        if self.sharded_state is not ShardedState.SHARDED:
            return
        with record_function(f"raggedfsdp::unshard({self.label})"):
            self._allocate(self._gather_storage)
            for bucket in self.buckets:
                full = bucket.full
                assert full is not None
                rank, size = bucket.rank, bucket.shard_numel
                if full.dtype != bucket.dtype:
                    # Mixed precision: cast the fp32 shard into its slot of the bf16 buffer;
                    # this cast is the only copy, and the all-gather then runs in place.
                    shard = full[rank * size : (rank + 1) * size]
                    shard.copy_(bucket.local)
                    self.stats.add_copy(shard)
                elif self.config.zero_copy:
                    shard = bucket.local
                else:
                    shard = bucket.local.clone()  # FSDP2-style copy-in, for A/B measurement
                    self.stats.add_copy(shard)
                self._pending_unshard.append(
                    all_gather(
                        full,
                        shard,
                        self.mesh_info.shard_group,
                        self.stats,
                        own_ranges=bucket.own_ranges,
                    )
                )
        self.sharded_state = ShardedState.UNSHARDING

    def wait_for_unshard(self) -> None:
        """Wait for the all-gathers and hand the modules the unsharded parameters."""
        if self.sharded_state is ShardedState.SHARDED:
            self.unshard()
        if self.sharded_state is ShardedState.UNSHARDED:
            return
        for pending in self._pending_unshard:
            pending.wait()
        self._pending_unshard.clear()
        if not self.config.zero_copy:
            # FSDP2-style copy-out into the separately stored unsharded parameters.
            self._allocate(self._param_storage)
            for bucket in self.buckets:
                assert bucket.full is not None
                for slot in bucket.slots:
                    src = bucket.full[slot.offset : slot.offset + slot.numel].view(slot.shape)
                    slot.unsharded.data.copy_(src)
                    self.stats.add_copy(src)
            self._free(self._gather_storage)
        self._swap_params(unsharded=True)
        self.sharded_state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        """Free the unsharded parameters; the modules hold the sharded ones again."""
        if self.sharded_state is ShardedState.UNSHARDING:
            self.wait_for_unshard()  # never free a buffer a collective is still writing
        if self.sharded_state is ShardedState.SHARDED:
            return
        self._swap_params(unsharded=False)
        self._free(self._param_storage + self._gather_storage)
        self.sharded_state = ShardedState.SHARDED

    # -- backward ------------------------------------------------------------------------------

    def pre_backward(self) -> None:
        """This unit's backward starts: parameters unsharded (its gradient block is taken when
        the first gradient arrives, see :meth:`_gradient_arrives`)."""
        self.training_state = TrainingState.PRE_BACKWARD
        self.wait_for_unshard()

    def _gradient_arrives(self, grad: torch.Tensor) -> None:
        """Hook on every trainable unsharded parameter, run just before autograd accumulates
        its gradient: the unit's gradient block is taken now rather than when its backward
        starts, so it is not held while the unit's output gradients are still being computed
        (for the root, the whole loss backward, which is where the memory peak lies)."""
        self._take_grad_block()

    def _take_grad_block(self) -> None:
        """Unsharded gradients become views of a zeroed block; under no_sync the block stays
        between backwards and keeps accumulating, so an existing one is kept as it is."""
        if self._grad_block is not None:
            return
        block = self.pool.take(packed_nbytes(self._grad_sizes), torch.uint8, self.device)
        block.zero_()
        for bucket, full_grad in zip(self._trainable, carve(block, self._grad_sizes), strict=True):
            bucket.attach_unsharded_grads(full_grad)
        self._grad_block = block

    def post_backward(self) -> None:
        """This unit's backward is done: reduce its gradients (unless accumulating without
        sync) and free its unsharded parameters."""
        if self.training_state is not TrainingState.PRE_BACKWARD:
            return
        self.training_state = TrainingState.POST_BACKWARD
        with record_function(f"raggedfsdp::post_backward({self.label})"):
            if self.requires_gradient_sync and self._trainable:
                # Every rank joins the reduce-scatter, whether or not gradients reached it.
                self._take_grad_block()
                self.reduce_queue.make_room()
                self.reduce_queue.push([self._reduce(bucket) for bucket in self._trainable])
            self.reshard()

    def _reduce(self, bucket: DBuffer) -> _PendingReduce:
        full_grad = bucket.full_grad
        assert full_grad is not None
        reduce_dtype = self.reduce_dtype(bucket)
        rs_input = full_grad
        if reduce_dtype != full_grad.dtype:
            rs_input = full_grad.to(reduce_dtype)
            self.stats.add_copy(rs_input)
        # A fresh [S] buffer: when no sharded gradient is held it becomes the gradient itself
        # (the sharded grads are views of it), so it lives exactly as long as they do and
        # zero_grad(set_to_none=True) frees it, as in FSDP2.
        output = torch.empty(bucket.shard_numel, dtype=reduce_dtype, device=self.device)
        pending = reduce_scatter(
            output, rs_input, self.mesh_info.shard_group, self.stats, scratch=self.pool
        )
        self._reduces_in_flight += 1
        return _PendingReduce(self, bucket, pending, output, rs_input)

    def reduce_scattered(self) -> None:
        """One of this unit's reduce-scatters is done; after the last, its unsharded gradients
        are read and their block goes back to the pool."""
        self._reduces_in_flight -= 1
        if self._reduces_in_flight == 0:
            for b in self._trainable:
                b.detach_unsharded_grads()
            assert self._grad_block is not None
            self.pool.give(self._grad_block)
            self._grad_block = None

    def attach_reduced(self, bucket: DBuffer, output: torch.Tensor) -> None:
        """The reduced gradient shard ``output`` becomes the sharded gradients (or is added to
        those still held: gradients accumulate across steps, as in torch)."""
        if bucket.has_sharded_grads():
            for slot in bucket.slots:
                piece = output[slot.local_start : slot.local_end].view(slot.sharded.shape)
                if slot.sharded.grad is not None:
                    slot.sharded.grad += piece
                elif slot.sharded.requires_grad:
                    slot.sharded.grad = piece.to(bucket.dtype, copy=True)
                    self.stats.add_copy(piece)
        else:
            if output.dtype != bucket.dtype:  # reduce_dtype other than the master dtype
                output = output.to(bucket.dtype)
                self.stats.add_copy(output)
            bucket.attach_sharded_grads(output)

    def finish_iteration(self) -> None:
        """End of backward: this unit back to idle and sharded. Under no_sync the unsharded
        gradient buffers stay, to keep accumulating."""
        self.post_backward()
        self.reshard()
        self.training_state = TrainingState.IDLE

    # -- accounting ----------------------------------------------------------------------------

    def persistent_bytes(self) -> int:
        return sum(bucket.persistent_bytes() for bucket in self.buckets)


def _views(storages: list[FlatStorage]) -> list[torch.Tensor]:
    """The buffers of ``storages``, in bucket order."""
    return [view for storage in storages for view in storage.views]
