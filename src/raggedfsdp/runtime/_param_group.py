"""One FSDP unit's parameters: its buckets, and unshard / reshard / reduce over them.

Layering runs one way: hooks (``_hooks.py``) -> this group -> collectives -> DBuffers.
The group owns the state of its parameters and of their reductions in flight; the hooks only
decide *when* to call it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function

from ..layout import RaggedShard
from ..planner import StructAwarePlanner, unit_buckets
from ._collectives import Pending, all_gather, all_reduce, reduce_scatter
from ._compressed import BucketCompression
from ._dbuffer import DBuffer, FlatStorage, carve, packed_nbytes
from ._mesh import MeshInfo
from ._metrics import RuntimeStats
from ._offload import HostOffload
from ._param import FSDPParam, Registration
from ._pool import BufferPool
from ._reduce import BucketReduce, ReduceQueue
from ._state_machine import ShardedState, TrainingState, check_state
from .api import CommCompression, DBufferConfig, MixedPrecisionPolicy

__all__ = ["FSDPParamGroup", "SharedResources"]


@dataclass
class Knobs:
    """What FSDP2's ``FSDPModule.set_*`` methods set on one unit."""

    #: reduce the gradients in the next backward (off: accumulate them unsharded, no_sync)
    requires_gradient_sync: bool = True
    #: free the unsharded parameters at the end of backward
    reshard_after_backward: bool = True
    #: HSDP: all-reduce the reduced shards over the replicas in this backward (off: they
    #: accumulate until a backward with it on adds them in)
    requires_all_reduce: bool = True
    #: the reduced gradient is the sum over the data-parallel ranks divided by this (``None``:
    #: their number, a mean)
    gradient_divide_factor: float | None = None
    #: gather the parameters for backward (off: the unit's backward needs none, e.g. an
    #: embedding, whose weight gradient comes from its inputs and output gradient alone)
    unshard_in_backward: bool = True


@dataclass(frozen=True)
class SharedResources:
    """What every unit under one root shares, made once by the root at lazy init."""

    stats: RuntimeStats  # counters of every unit, reset by model.reset_stats()
    reduce_queue: ReduceQueue  # the order in which reductions in flight are finished
    pool: BufferPool  # scratch blocks reused from unit to unit (group_level=True)
    unpooled: BufferPool  # the same, freeing every block at once (group_level=False)

    @classmethod
    def new(cls) -> SharedResources:
        stats = RuntimeStats()
        return cls(stats, ReduceQueue(), BufferPool(stats), BufferPool(stats, retain=False))


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
        compression: CommCompression | None = None,
        offload: HostOffload | None = None,
    ) -> None:
        self.mesh_info = mesh_info
        self.config = config
        self.mp_policy = mp_policy or MixedPrecisionPolicy()
        self.device = device  # the compute device; the shards' too unless offloaded
        self.offload = offload  # CPU offload: the shards on the host (_offload.py)
        self.path = ""  # the module's path below the root (set_path); names buckets and params
        self.label = label  # for errors and profiler ranges: the path once known
        self.sharded_state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.knobs = Knobs()  # FSDP2's per-unit settings (FSDPModule.set_*)
        self._unreplicated: dict[int, torch.Tensor] = {}  # id(bucket) -> reduced shard
        self._shared: SharedResources | None = None  # the root's, bound at its lazy init
        self._pending_unshard: list[Pending] = []  # all-gathers issued by unshard(), until waited
        self._gathered_versions: list[int] = []  # the shards' version counters when gathered
        self._reduces: list[BucketReduce] = []  # this unit's reductions, from issue to finish
        self.buckets = self._build_buckets(registrations, planner)
        self._compression = (planner.shard_policy, compression)
        #: each bucket's compressed collectives, by id(bucket); none without compression
        self._compressed = _compressions(self.buckets, *self._compression, device)
        #: every parameter of the unit, bucket by bucket in buffer order
        self.params: list[FSDPParam] = [p for b in self.buckets for p in b.params]
        # Storage for the all-gather outputs; with zero copy the unsharded parameters are views
        # of it. The FSDP2-style path copies out into a second storage, as FSDP2 does.
        self._gather_storage = self._storages(self.buckets)
        self._param_storage = (
            self._gather_storage if config.zero_copy else self._storages(self.buckets)
        )
        gathered = _views(self._gather_storage)
        param_buffers = _views(self._param_storage)
        for bucket, full, param_buffer in zip(self.buckets, gathered, param_buffers, strict=True):
            bucket.bind_full(full, param_buffer, whole_from_local=self._whole_from_local(bucket))
        for storage in self._gather_storage + self._param_storage:
            storage.free()  # views taken; memory only while unsharded
        # The unsharded gradients of all trainable buckets: one pooled block per backward,
        # taken at the first gradient and given back when the reduce-scatters have read it.
        self._trainable = [b for b in self.buckets if b.requires_grad]
        self._grad_sizes = [(b.full_numel, b.comm_dtype) for b in self._trainable]
        self._grad_block: torch.Tensor | None = None
        for param in self.params:
            if param.unsharded.requires_grad:  # of a trainable bucket, then
                param.unsharded.register_hook(self._gradient_arrives)
            param.hold(unsharded=False)

    # -- construction --------------------------------------------------------------------------

    def reduce_dtype(self, bucket: DBuffer) -> torch.dtype:
        if self.mp_policy.reduce_dtype is not None and bucket.dtype.is_floating_point:
            return self.mp_policy.reduce_dtype
        return bucket.comm_dtype

    def _build_buckets(
        self, registrations: list[Registration], planner: StructAwarePlanner
    ) -> list[DBuffer]:
        """The unit's buckets as :func:`~raggedfsdp.planner.unit_buckets` decides them (the
        same function ``plan_model`` uses), each planned and made a DBuffer."""
        by_name = {r.fqn: r for r in registrations}
        buckets = unit_buckets(
            self.path,
            [(r.fqn, r.param) for r in registrations],
            param_dtype=self.mp_policy.param_dtype,
            buffer_size=self.config.buffer_size,
        )
        return [
            DBuffer(
                planner.plan_bucket(bucket, self.mesh_info.shard_size),
                [by_name[name] for name in bucket.params],
                rank=self.mesh_info.shard_rank,
                group=self.mesh_info.shard_group,
                comm_dtype=bucket.comm_dtype,
                device=self.device,
                offload=self.offload,
            )
            for bucket in buckets
        ]

    def _whole_from_local(self, bucket: DBuffer) -> bool:
        """Whether parameters this rank holds whole are views of its shard when unsharded (see
        ``DBuffer.bind_full``): with zero copy and no cast; not when a compressed all-gather
        dequantizes every parameter, the rank's own ones too, nor under offload, where the shard
        is host memory that the compute must not read."""
        return (
            self.config.zero_copy
            and bucket.comm_dtype == bucket.dtype
            and self._compressed_gather(bucket) is None
            and self.offload is None
        )

    def set_path(self, path: str) -> None:
        """This unit's module is ``path`` below the module ``fully_shard`` was last applied to
        (the root): its buckets and parameters take names from there, as ``plan_model`` gives
        them."""
        old = self.path
        for bucket in self.buckets:
            names = [_repath(n, old, path) for n in bucket.plan.model_order]
            bucket.plan = bucket.plan.renamed(names, _repath_bucket(bucket.plan.name, path))
        for param in self.params:
            param.fqn = _repath(param.fqn, old, path)
        # Named as the plans now are (nothing is quantized before the first forward).
        self._compressed = _compressions(self.buckets, *self._compression, self.device)
        self.path = path
        self.label = path or "<root>"

    def _storages(self, buckets: list[DBuffer]) -> list[FlatStorage]:
        """One storage for all ``buckets`` (``group_level``), or one each."""
        sizes = [(b.full_numel, b.comm_dtype) for b in buckets]
        if not sizes:
            return []
        if self.config.group_level:
            return [FlatStorage(sizes, self.device)]
        return [FlatStorage([size], self.device) for size in sizes]

    def bind(self, shared: SharedResources) -> None:
        """Use the root's shared resources (once, at the root's lazy init)."""
        if self._shared is not None and self._shared is not shared:
            raise RuntimeError(
                f"raggedfsdp: unit {self.label!r} already belongs to another root; apply "
                f"fully_shard to the root once and run forward through it"
            )
        self._shared = shared

    @property
    def shared(self) -> SharedResources:
        if self._shared is None:
            raise RuntimeError(
                f"raggedfsdp: unit {self.label!r} was used before its root's first forward "
                f"(or unshard) initialised it"
            )
        return self._shared

    @property
    def stats(self) -> RuntimeStats:
        return self.shared.stats

    @property
    def _pool(self) -> BufferPool:
        return self.shared.pool if self.config.group_level else self.shared.unpooled

    def _allocate(self, storages: list[FlatStorage]) -> None:
        """Allocate the storages not yet allocated."""
        fresh = [s for s in storages if s.allocate()]
        self.stats.note_unsharded(sum(s.nbytes for s in fresh))

    def _free(self, storages: list[FlatStorage]) -> None:
        live = [s for s in {id(s): s for s in storages}.values() if s.allocated]
        for storage in live:
            storage.free()
        self.stats.note_unsharded(-sum(s.nbytes for s in live))

    def _hold(self, *, unsharded: bool) -> None:
        """Make the modules hold the unsharded (or sharded) parameter objects."""
        for param in self.params:
            param.hold(unsharded=unsharded)

    def sharded_parameters(self) -> list[nn.Parameter]:
        return [param.sharded for param in self.params]

    def named_parameters_in(self, root: nn.Module, prefix: str) -> list[tuple[str, nn.Parameter]]:
        """``(state-dict key, what its module holds)`` for every name of every parameter of
        this unit, ``root`` being the unit's module (for its state-dict hooks)."""
        paths = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
        return [item for param in self.params for item in param.named_in(paths, prefix)]

    # -- unshard / reshard ---------------------------------------------------------------------

    def unshard(self) -> None:
        """Issue the all-gathers of every bucket (asynchronously); idempotent while the shards
        are unchanged."""
        if self.sharded_state is ShardedState.UNSHARDED and self._stale():
            # Kept unsharded (reshard_after_forward=False, a forward without gradients) across
            # an optimizer step or a load: gather again rather than compute with old values.
            # FSDP2 computes with the stale copy here.
            self.reshard()
        if self.sharded_state is not ShardedState.SHARDED:
            return
        with record_function(f"raggedfsdp::unshard({self.label})"):
            self._allocate(self._gather_storage)
            self._gathered_versions = self._shard_versions()
            for bucket in self.buckets:
                self._pending_unshard.append(self._all_gather(bucket))
        self.sharded_state = ShardedState.UNSHARDING

    def _shard_versions(self) -> list[int]:
        """The shards' version counters: their sharded parameters are views of them, so every
        in-place update (an optimizer step, a load) bumps them."""
        return [bucket.local._version for bucket in self.buckets]

    def _stale(self) -> bool:
        """Whether a shard changed in place since it was gathered."""
        return self._shard_versions() != self._gathered_versions

    def _compressed_gather(self, bucket: DBuffer) -> BucketCompression | None:
        compressed = self._compressed.get(id(bucket))
        return compressed if compressed and compressed.config.all_gather else None

    def _compressed_scatter(self, bucket: DBuffer) -> BucketCompression | None:
        compressed = self._compressed.get(id(bucket))
        return compressed if compressed and compressed.config.reduce_scatter else None

    def _all_gather(self, bucket: DBuffer) -> Pending:
        full = bucket.full
        assert full is not None
        compressed = self._compressed_gather(bucket)
        if compressed is not None:
            group = self.mesh_info.shard_group
            return compressed.all_gather(full, bucket.local, group, self.stats, self._pool)
        rank, size = bucket.rank, bucket.shard_numel
        if self.offload is not None:  # the host shard into its device slot: the only copy
            shard = full[rank * size : (rank + 1) * size]
            self.offload.to_device(shard, bucket.local, self._pool, self.stats)
        elif full.dtype != bucket.dtype:
            # Mixed precision: cast the fp32 shard into its slot of the bf16 buffer; this cast
            # is the only copy, and the all-gather then runs in place.
            shard = full[rank * size : (rank + 1) * size]
            shard.copy_(bucket.local)
            self.stats.add_copy(shard)
        elif self.config.zero_copy:
            shard = bucket.local
        else:
            shard = bucket.local.clone()  # FSDP2-style copy-in, for A/B measurement
            self.stats.add_copy(shard)
        return all_gather(
            full, shard, self.mesh_info.shard_group, self.stats, own_ranges=bucket.own_ranges
        )

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
                for param in bucket.params:
                    src = bucket.full[param.offset : param.offset + param.numel].view(param.shape)
                    param.unsharded.data.copy_(src)
                    self.stats.add_copy(src)
            self._free(self._gather_storage)
        self._hold(unsharded=True)
        self.sharded_state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        """Free the unsharded parameters; the modules hold the sharded ones again."""
        if self.sharded_state is ShardedState.UNSHARDING:
            self.wait_for_unshard()  # never free a buffer a collective is still writing
        if self.sharded_state is ShardedState.SHARDED:
            return
        if self.offload is not None:
            self.offload.wait()  # the host may write the shards from now on
        self._hold(unsharded=False)
        self._free(self._param_storage + self._gather_storage)
        self.sharded_state = ShardedState.SHARDED

    # -- forward -------------------------------------------------------------------------------

    def pre_forward(self) -> None:
        """This unit's forward starts: its parameters unsharded."""
        check_state(self.training_state, TrainingState.IDLE, unit=self.label)
        self.training_state = TrainingState.FORWARD
        self.wait_for_unshard()

    def post_forward(self, *, reshard: bool) -> None:
        """This unit's forward is done; free its unsharded parameters if ``reshard``."""
        check_state(self.training_state, TrainingState.FORWARD, unit=self.label)
        if reshard:
            self.reshard()
        self.training_state = TrainingState.IDLE

    # -- backward ------------------------------------------------------------------------------

    def pre_backward(self) -> None:
        """This unit's backward starts: parameters unsharded (its gradient block is taken when
        the first gradient arrives, see :meth:`_gradient_arrives`). Idempotent: every output
        that receives a gradient calls it."""
        check_state(
            self.training_state,
            (TrainingState.IDLE, TrainingState.PRE_BACKWARD),
            unit=self.label,
        )
        self.training_state = TrainingState.PRE_BACKWARD
        if self.knobs.unshard_in_backward or self.sharded_state is ShardedState.UNSHARDING:
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
        block = self._pool.take(packed_nbytes(self._grad_sizes), torch.uint8, self.device)
        block.zero_()
        for bucket, full_grad in zip(self._trainable, carve(block, self._grad_sizes), strict=True):
            bucket.attach_unsharded_grads(full_grad)
        self._grad_block = block

    def post_backward(self) -> None:
        """This unit's backward is done: reduce its gradients (unless accumulating without
        sync) and free its unsharded parameters. A no-op unless its backward ran."""
        if self.training_state is not TrainingState.PRE_BACKWARD:
            return
        self.training_state = TrainingState.POST_BACKWARD
        with record_function(f"raggedfsdp::post_backward({self.label})"):
            if self.knobs.requires_gradient_sync and self._trainable:
                # Every rank joins the reduce-scatter, whether or not gradients reached it.
                self._take_grad_block()
                self.shared.reduce_queue.make_room()
                self._reduce_scatter()
                self.shared.reduce_queue.push(self)
            if self.knobs.reshard_after_backward:
                self.reshard()

    def _reduce_scatter(self) -> None:
        """Issue the reduce-scatter of every trainable bucket."""
        if self._reduces:
            raise RuntimeError(
                f"raggedfsdp: unit {self.label!r} issued a reduction while its previous one "
                f"is unfinished"
            )
        for bucket in self._trainable:
            full_grad = bucket.full_grad
            assert full_grad is not None
            compressed = self._compressed_scatter(bucket)
            if compressed is not None:
                # Summed in fp32 (fully_shard refuses another reduce_dtype).
                output = torch.empty(bucket.shard_numel, dtype=torch.float32, device=self.device)
                scatter = compressed.reduce_scatter(
                    output,
                    full_grad,
                    self.mesh_info.shard_group,
                    self.stats,
                    self._pool,
                    replicated=self.mesh_info.replicate_group is not None,
                )
                self._reduces.append(BucketReduce(bucket, scatter, output, full_grad))
                continue
            reduce_dtype = self.reduce_dtype(bucket)
            scatter_input = full_grad
            if reduce_dtype != full_grad.dtype:
                scatter_input = full_grad.to(reduce_dtype)
                self.stats.add_copy(scatter_input)
            # A fresh [S] buffer: when no sharded gradient is held it becomes the gradient
            # itself (the sharded grads are views of it), so it lives exactly as long as they
            # do and zero_grad(set_to_none=True) frees it, as in FSDP2.
            output = torch.empty(bucket.shard_numel, dtype=reduce_dtype, device=self.device)
            scatter = reduce_scatter(
                output, scatter_input, self.mesh_info.shard_group, self.stats, scratch=self._pool
            )
            self._reduces.append(BucketReduce(bucket, scatter, output, scatter_input))

    def finish_reduce_scatter(self) -> bool:
        """Wait for this unit's reduce-scatters; its unsharded gradients are read, so their
        block goes back to the pool. Under HSDP issue the all-reduces over the replicas and
        return ``True`` (:meth:`finish_reduce` then waits for them)."""
        replicate_group = self.mesh_info.replicate_group
        for item in self._reduces:
            item.scatter.wait()
            item.scatter_input = None
            if replicate_group is not None:
                self._replicate(item, replicate_group)
        for bucket in self._trainable:
            bucket.detach_unsharded_grads()
        assert self._grad_block is not None
        self._pool.give(self._grad_block)
        self._grad_block = None
        return replicate_group is not None and self.knobs.requires_all_reduce

    def _replicate(self, item: BucketReduce, group: dist.ProcessGroup) -> None:
        """HSDP: all-reduce the reduced shard over the replicas, with what earlier backwards
        without the all-reduce left; or keep it for a later backward to add."""
        held = self._unreplicated.pop(id(item.bucket), None)
        if held is not None:
            item.output.add_(held)
        if self.knobs.requires_all_reduce:
            item.replicate = all_reduce(item.output, group, self.stats)
        else:
            self._unreplicated[id(item.bucket)] = item.output

    def finish_reduce(self) -> None:
        """Wait for the all-reduces over the replicas (HSDP); the reduced shards become the
        sharded gradients."""
        for item in self._reduces:
            if item.replicate is not None:
                item.replicate.wait()
                compressed = self._compressed_scatter(item.bucket)
                if compressed is not None:
                    compressed.check_replicated(item.output)
            if id(item.bucket) not in self._unreplicated:  # a gradient of every replica
                self._attach_reduced(item.bucket, self._divided(item.output))
        self._reduces.clear()

    def _divided(self, mean: torch.Tensor) -> torch.Tensor:
        """The mean over the data-parallel ranks, rescaled to the sum / gradient_divide_factor."""
        ranks = self.mesh_info.shard_size * self.mesh_info.replicate_size
        factor = self.knobs.gradient_divide_factor
        if factor is None or factor == ranks:
            return mean
        return mean.mul_(ranks / factor)

    def _attach_reduced(self, bucket: DBuffer, output: torch.Tensor) -> None:
        """The reduced gradient shard ``output`` becomes the sharded gradients (or is added to
        those still held: gradients accumulate across steps, as in torch). Under offload it is
        copied to the host first, and the sharded gradients are views of the host copy."""
        if self.offload is not None:
            output = self.offload.to_host(output, bucket.dtype, self.stats)
            if bucket.has_sharded_grads():
                self.offload.wait()  # the host adds the copy below
        if bucket.has_sharded_grads():
            for param in bucket.params:
                piece = output[param.local_start : param.local_end].view(param.sharded.shape)
                if param.sharded.grad is not None:
                    param.sharded.grad += piece
                elif param.sharded.requires_grad:
                    param.sharded.grad = bucket.as_grad(piece.to(bucket.dtype, copy=True))
                    self.stats.add_copy(piece)
        else:
            if output.dtype != bucket.dtype:  # reduce_dtype other than the master dtype
                output = output.to(bucket.dtype)
                self.stats.add_copy(output)
            bucket.attach_sharded_grads(output)

    def finish_iteration(self) -> None:
        """End of backward: this unit back to idle and sharded (unless it keeps its unsharded
        parameters: ``reshard_after_backward`` off). Under no_sync the unsharded gradient
        buffers stay, to keep accumulating."""
        self.post_backward()
        if self.knobs.reshard_after_backward:
            self.reshard()
        elif self.sharded_state is ShardedState.UNSHARDING:
            self.wait_for_unshard()  # no all-gather left in flight past the iteration
        if self.knobs.requires_gradient_sync:  # no optimizer step between no_sync micro-batches
            for compressed in self._compressed.values():
                compressed.drop_quantized_shard()
        if self.offload is not None:
            self.offload.wait()  # the optimizer may read the gradients and write the shards
        self.training_state = TrainingState.IDLE

    # -- state outside a step ------------------------------------------------------------------

    def full_parameters(self) -> dict[int, torch.Tensor]:
        """``id(sharded parameter) -> the full parameter`` on CPU; a collective over the shard
        group (every rank calls it, between steps)."""
        full: dict[int, torch.Tensor] = {}
        for bucket in self.buckets:
            gathered = torch.empty(bucket.full_numel, dtype=bucket.dtype, device=bucket.device)
            shard = bucket.local.to(bucket.device)  # itself, unless offloaded to the host
            all_gather(gathered, shard, self.mesh_info.shard_group, RuntimeStats(), async_op=False)
            for param in bucket.params:
                piece = gathered[param.offset : param.offset + param.numel].view(param.shape)
                full[id(param.sharded)] = piece.detach().to("cpu", copy=True)
        return full

    def residuals(self) -> dict[str, torch.Tensor]:
        """This rank's error-feedback residual of each bucket that keeps one, by bucket name:
        the tensors themselves (loading copies into them)."""
        out = {}
        for bucket in self.buckets:
            compressed = self._compressed.get(id(bucket))
            if compressed is not None and compressed.residual is not None:
                out[bucket.plan.name] = compressed.residual.data
        return out

    def persistent_bytes(self) -> int:
        residuals = sum(r.numel() * r.element_size() for r in self.residuals().values())
        return residuals + sum(bucket.persistent_bytes() for bucket in self.buckets)


def _compressions(
    buckets: list[DBuffer],
    policy: RaggedShard,
    compression: CommCompression | None,
    device: torch.device,
) -> dict[int, BucketCompression]:
    """Each bucket's :class:`BucketCompression` (by ``id``); floating parameters only."""
    if compression is None or not compression.enabled:
        return {}
    for bucket in buckets:
        if not bucket.dtype.is_floating_point:
            raise ValueError(
                f"parameter {bucket.params[0].fqn!r} is {bucket.dtype}: compressed "
                f"communication quantizes floating-point parameters only; make it a buffer or "
                f"shard it without compression"
            )
    return {
        id(b): BucketCompression(b.plan, policy, compression, device, trainable=b.requires_grad)
        for b in buckets
    }


def _views(storages: list[FlatStorage]) -> list[torch.Tensor]:
    """The buffers of ``storages``, in bucket order."""
    return [view for storage in storages for view in storage.views]


def _repath(name: str, old: str, new: str) -> str:
    """A parameter's name under unit path ``old``, renamed under ``new``."""
    if old and not name.startswith(f"{old}."):
        raise RuntimeError(f"raggedfsdp: parameter {name!r} is not under unit path {old!r}")
    relative = name[len(old) + 1 :] if old else name
    return f"{new}.{relative}" if new else relative


def _repath_bucket(name: str, new: str) -> str:
    """``<path>/<dtype>.../<i>`` with the path replaced."""
    return f"{new or '<root>'}/{name.split('/', 1)[1]}"
