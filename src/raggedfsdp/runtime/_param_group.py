"""One FSDP unit's parameters: its buckets, and unshard / reshard / reduce over them.

Layering runs one way: hooks (``_hooks.py``) -> this group -> each bucket's strategies
(``_comm.py``, ``compression/``) -> collectives -> DBuffers. The group chooses each bucket's
strategies once (``_strategies.py``), when it builds the bucket, and owns the state of its
parameters and of their reductions in flight; the hooks only decide *when* to call it.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.autograd.profiler import record_function

from ..planner import ShardPlan, StructAwarePlanner
from ._adopt import adopt
from ._collectives import Pending
from ._comm import (
    BucketReduce,
)
from ._dbuffer import DBuffer, FlatStorage, carve, packed_nbytes, storages_for, views_of
from ._mesh import MeshInfo
from ._metrics import RuntimeStats
from ._offload import HostOffload
from ._param import FSDPParam, Registration, bucket_name, qualified_name
from ._pool import BufferPool
from ._reduce import run_all_reduce_hook
from ._reshard_to import ReshardTo
from ._shared import Knobs, SharedResources
from ._state_machine import ShardedState, TrainingState, check_state
from ._strategies import UnitComm
from ._streams import wait_all
from ._unit_plan import plan_unit_buckets
from ._usage import Usage
from .api import CommCompression, DBufferConfig, MixedPrecisionPolicy
from .compression import (
    Finding,
)

__all__ = ["FSDPParamGroup"]


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
        module_name: str,
        compression: CommCompression | None = None,
        offload: HostOffload | None = None,
    ) -> None:
        self.mesh_info = mesh_info
        self.config = config
        self.mp_policy = mp_policy or MixedPrecisionPolicy()
        self.device = device  # the compute device; the shards' too unless offloaded
        self.offload = offload  # CPU offload: the shards on the host (_offload.py)
        #: its modules' paths below their root, given once by the root's lazy init (bind);
        #: until then the unit is named by its modules' classes (``module_name``)
        self.paths: list[str] | None = None
        self._module_name = module_name
        self.sharded_state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.knobs = Knobs()  # FSDP2's per-unit settings (FSDPModule.set_*)
        #: reshard_after_forward=N: what keeps the buckets sharded over N ranks after forward
        #: (``_reshard_to.py``); None: freed whole, or kept whole
        self.reshard_to: ReshardTo | None = None
        self._shared: SharedResources | None = None  # the root's, bound at its lazy init
        self._pending_unshard: list[Pending] = []  # all-gathers issued by unshard(), until waited
        self._gathered_versions: list[int] = []  # the shards' version counters when gathered
        #: this unit's reductions, one per trainable bucket in order, from issue to finish
        self._reduces: list[BucketReduce] = []
        #: the data-parallel ranks under the unit's root, over which gradients are averaged
        #: (more than the unit's own beside expert parallelism); set at the root's lazy init
        self.data_ranks = mesh_info.degrees.dp
        #: what each bucket's strategies are chosen from, at construction and by rebind()
        policy = planner.shard_policy
        self._comm = UnitComm(
            mesh_info, config, self.mp_policy, policy, compression, self.qualify, self._report
        )
        self.buckets = self._build_buckets(registrations, planner)
        #: every parameter of the unit, bucket by bucket in buffer order
        self.params: list[FSDPParam] = [p for b in self.buckets for p in b.params]
        # one pooled block of unsharded gradients per backward, from the first gradient to the
        # reduce-scatters' read
        self._trainable = [b for b in self.buckets if b.requires_grad]
        self._grad_block: torch.Tensor | None = None
        #: the event after which this unit's reduced gradients are attached, until the compute
        #: stream waits for it at the end of the iteration
        self._reduced: object = None
        self._bind_storages()
        #: which of its trainable parameters any rank used (``_usage.py``)
        self.usage = Usage([p for b in self._trainable for p in b.params])
        self._hook_gradients()
        for param in self.params:
            param.hold(unsharded=False)

    def _hook_gradients(self) -> None:
        """What each trainable unsharded parameter's gradient runs before autograd accumulates
        it: its form's own hook (``ParamPlacement.arm``), then :meth:`_gradient_arrives`."""
        for index, param in enumerate(self.usage.params):
            param.placement.arm(param.unsharded)
            param.unsharded.register_hook(functools.partial(self._gradient_arrives, index))

    # -- construction --------------------------------------------------------------------------

    def _build_buckets(
        self, registrations: list[Registration], planner: StructAwarePlanner
    ) -> list[DBuffer]:
        """The unit's buckets as :func:`~raggedfsdp.planner.unit_buckets` decides them (the
        same function ``plan_model`` uses, named below the unit's module), each planned and
        made a DBuffer with its collectives ([Note: one strategy per bucket] in ``_comm.py``)."""
        by_name = {r.fqn: r for r in registrations}
        planned = plan_unit_buckets(
            registrations,
            planner,
            self.mesh_info.shard_size,
            param_dtype=self.mp_policy.param_dtype,
            buffer_size=self.config.buffer_size,
        )
        out = []
        for bucket, plan in planned:
            gather, reduce = self._comm.choose(bucket, plan, self.device, self.offload)
            out.append(
                DBuffer(
                    plan,
                    [by_name[name] for name in bucket.params],
                    mesh_info=self.mesh_info,
                    comm_dtype=bucket.comm_dtype,
                    device=self.device,
                    gather=gather,
                    reduce=reduce,
                    offload=self.offload,
                )
            )
        return out

    def _bind_storages(self) -> None:
        """Storage for the all-gather outputs, on the compute device in each bucket's
        communication dtype; with zero copy the unsharded parameters are views of it. The
        FSDP2-style path copies out into a second storage, as FSDP2 does."""
        self._gather_storage = storages_for(self.buckets, self.device, self.config.group_level)
        self._param_storage = (
            self._gather_storage
            if self.config.zero_copy
            else storages_for(self.buckets, self.device, self.config.group_level)
        )
        gathered = views_of(self._gather_storage)
        param_buffers = views_of(self._param_storage)
        for bucket, full, param_buffer in zip(self.buckets, gathered, param_buffers, strict=True):
            bucket.bind_full(full, param_buffer)
        for storage in self._gather_storage + self._param_storage:
            storage.free()  # views taken; memory only while unsharded
        self._grad_sizes = [(b.full_numel, b.comm_dtype) for b in self._trainable]

    def rebind(self) -> None:
        """After a bucket's shard moved to another dtype or device (:func:`~._adopt.adopt`):
        its strategies chosen again and the unit's storages made anew, as at construction."""
        for bucket in self.buckets:
            bucket.gather, bucket.reduce = self._comm.choose(
                bucket, bucket.plan, self.device, self.offload
            )
        self._bind_storages()

    def bind(self, shared: SharedResources, paths: list[str], *, replace: bool = False) -> None:
        """Join the root, once (``replace``: leaving a root that never ran a forward), at its
        lazy init: use its shared resources, and take the unit's names, its modules' ``paths``
        below the root (as FSDP2's ``_init_fqns``), which errors and profiler ranges say from
        now on. The root then sets ``data_ranks`` ([Note: units on different meshes])."""
        if self._shared is not None and self._shared is not shared and not replace:
            raise RuntimeError(
                f"raggedfsdp: unit {self.label!r} already belongs to another root; apply "
                f"fully_shard to the root once and run forward through it"
            )
        self._shared = shared
        self.paths = paths

    @property
    def label(self) -> str:
        """The unit in errors and profiler ranges: its (first) module's path below the root
        once named, before that its modules' classes."""
        if self.paths is None:
            return self._module_name
        return self.paths[0] or "<root>"

    def qualify(self, name: str) -> str:
        """A parameter's name in this unit's plans (below the unit's module) as the model
        names it: with the unit's path once the root has named the unit."""
        return name if self.paths is None else qualified_name(name, self.paths)

    def _report(self, finding: Finding) -> None:
        """What a compressed collective found, to the root's check ([Note: one finiteness
        check per step] in ``compression/_finite.py``)."""
        self.shared.non_finite.note(finding)

    def named_plans(self, paths: list[str] | None = None) -> list[ShardPlan]:
        """The unit's plans with the names ``StructAwarePlanner.plan_model`` gives them when
        the unit's modules are ``paths`` below the planned module (``None``: the unit's own
        names)."""
        if paths is None or paths == [""]:
            return [bucket.plan for bucket in self.buckets]
        return [
            bucket.plan.renamed(
                [qualified_name(name, paths) for name in bucket.plan.model_order],
                bucket_name(bucket.plan.name, paths[0]),
            )
            for bucket in self.buckets
        ]

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

    def persistent_bytes(self) -> int:
        """Bytes the unit's shards and their gradients hold between steps (on the host under
        offload)."""
        return sum(bucket.persistent_bytes() for bucket in self.buckets)

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
        adopt(self)  # a parameter changed outside the unit is taken back first
        if self.reshard_to is not None and self.reshard_to.holding:
            if not self._stale():
                self._refill()
                return
            self.reshard_to.drop(self.stats)  # a step or a load since: gather the shards
        versions = self._shard_versions()
        for bucket, version, gathered in zip(
            self.buckets, versions, self._gathered_versions or versions, strict=True
        ):
            if version != gathered:
                bucket.gather.shard_may_change()  # a strategy's copy of the shard is old
        self._gathered_versions = versions
        streams = self.shared.streams  # [Note: streams and events] in _streams.py
        with record_function(f"raggedfsdp::unshard({self.label})"):
            streams.order_gathers()
            with streams.use(streams.copy_in):
                self._allocate(self._gather_storage)  # memory of the copy-in stream
                sent = [
                    b.gather.copy_in(b.gathered(), b.local, self.stats, self._pool)
                    for b in self.buckets
                ]
                copied = streams.record(label=f"copy_in:{self.label}")
            streams.wait(copied, streams.all_gather)
            with streams.use(streams.all_gather):
                for bucket, shard in zip(self.buckets, sent, strict=True):
                    pending = bucket.gather.issue(
                        bucket.gathered(),
                        shard,
                        self.stats,
                        self._pool,
                        own_ranges=bucket.own_ranges,
                    )
                    self._pending_unshard.append(pending)
        self.sharded_state = ShardedState.UNSHARDING

    def _refill(self) -> None:
        """Unshard from the pieces kept after forward: an all-gather within the group of
        ``reshard_after_forward`` ranks (synchronous), then as after any all-gather."""
        with record_function(f"raggedfsdp::unshard_within({self.label})"):
            self._allocate(self._gather_storage)
            p2p = self.config.gloo_point_to_point
            self.reshard_to.refill(self.buckets, self.stats, gloo_point_to_point=p2p)  # type: ignore[union-attr]
        self.sharded_state = ShardedState.UNSHARDING

    def _shard_versions(self) -> list[int]:
        """How often each bucket's shard was updated in place (:meth:`DBuffer.version`)."""
        return [bucket.version() for bucket in self.buckets]

    def _stale(self) -> bool:
        """Whether a shard changed in place since it was gathered."""
        return self._shard_versions() != self._gathered_versions

    def wait_for_unshard(self) -> None:
        """Wait for the all-gathers and hand the modules the unsharded parameters."""
        if self.sharded_state is ShardedState.SHARDED:
            self.unshard()
        if self.sharded_state is ShardedState.UNSHARDED:
            return
        streams = self.shared.streams
        # The all-gather stream waits for the transfers and runs what follows them (dequantize);
        # compute then waits for its event before reading the parameters.
        with streams.use(streams.all_gather):
            wait_all(self._pending_unshard)
            gathered = streams.record(label=f"all_gather:{self.label}")
        self._pending_unshard.clear()
        streams.join(gathered, self.stats)
        streams.compute_moved()  # what the copy-in stream made for the transfers is let go
        if not self.config.zero_copy:
            # FSDP2-style copy-out into the separately stored unsharded parameters.
            self._allocate(self._param_storage)
            for bucket in self.buckets:
                assert bucket.full is not None
                for param in bucket.params:
                    src = bucket.full[param.offset : param.offset + param.numel].view(param.shape)
                    param.unsharded_local().copy_(src)
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
        self.shared.streams.compute_moved()  # the copy-in stream may reuse what compute read
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
            self.reshard_after_forward()
        self.training_state = TrainingState.IDLE

    def reshard_after_forward(self) -> None:
        """Free the unsharded parameters after a forward (keeping pieces for backward, over
        fewer ranks, under ``reshard_after_forward=N``)."""
        if self.reshard_to is not None and self.sharded_state is ShardedState.UNSHARDED:
            self.reshard_to.keep(self.buckets, self.stats)
        self.reshard()

    # -- backward ------------------------------------------------------------------------------

    def pre_backward(self) -> None:
        """This unit's backward starts: parameters unsharded (its gradient block is taken when
        the first gradient arrives, see :meth:`_gradient_arrives`). Idempotent: every output
        that receives a gradient calls it."""
        check_state(
            self.training_state,
            (TrainingState.IDLE, TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD),
            unit=self.label,
        )
        if self.training_state is TrainingState.POST_BACKWARD:
            # Its backward runs again in this backward (two forwards, then one backward, as
            # DPO and contrastive losses do): the first pass's reduction is finished now, so
            # its gradient block is free; the next one adds to the sharded gradients it left.
            self.shared.reduce_queue.finish(self)
        self.training_state = TrainingState.PRE_BACKWARD
        if self.knobs.unshard_in_backward or self.sharded_state is ShardedState.UNSHARDING:
            self.wait_for_unshard()

    def _gradient_arrives(self, index: int, grad: torch.Tensor) -> None:
        """The ``index``-th trainable parameter's gradient arrives: it is used on this rank, and
        the unit's gradient block is taken now rather than when its backward starts, so it is
        not held while the unit's output gradients are computed (for the root, the whole loss
        backward, where the memory peak lies)."""
        self.usage.used[index] = True
        self._take_grad_block()

    def reduces_now(self) -> bool:
        """Whether this backward reduces the unit's gradients (trainable, not under no_sync)."""
        return bool(self._trainable) and self.knobs.requires_gradient_sync

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
            elif self._grad_block is not None:
                self._accumulate()
            if self.knobs.reshard_after_backward:
                self.reshard()

    def _accumulate(self) -> None:
        """After a backward under no_sync: buckets whose reduction casts to a wider dtype sum
        their gradients in it (FSDP2's ``unsharded_accumulated_grad``) and zero their slice of
        the block, which goes back to the pool if every bucket did."""
        assert self._grad_block is not None
        taken = [
            bucket.reducer().accumulate(bucket.full_grad, self.stats, self._pool)
            for bucket in self._trainable
        ]
        if all(taken):
            for bucket in self._trainable:
                bucket.detach_unsharded_grads()
            self._pool.give(self._grad_block)
            self._grad_block = None
            return
        for bucket, took in zip(self._trainable, taken, strict=True):
            if took:
                bucket.full_grad.zero_()

    def _reduce_scatter(self) -> None:
        """Issue the reduce-scatter of every trainable bucket."""
        if self._reduces:
            raise RuntimeError(
                f"raggedfsdp: unit {self.label!r} issued a reduction while its previous one "
                f"is unfinished"
            )
        streams = self.shared.streams
        # The gradients are written (on the compute stream): the reduce-scatter stream waits
        # for them, then casts them and issues the collectives.
        streams.wait(streams.record(label=f"gradients:{self.label}"), streams.reduce_scatter)
        with streams.use(streams.reduce_scatter):
            for bucket in self._trainable:
                assert bucket.full_grad is not None
                reduce = bucket.reducer().reduce_scatter(bucket.full_grad, self.stats, self._pool)
                self._reduces.append(reduce)

    def finish_reduce_scatter(self) -> bool:
        """Wait for this unit's reduce-scatters; its unsharded gradients are read, so their
        block goes back to the pool. Under HSDP issue the all-reduces over the replicas (or
        keep the shards for a later backward: ``requires_all_reduce`` off) and return whether
        any was issued (:meth:`finish_reduce` then waits for them)."""
        replicated = self.mesh_info.replicate_group is not None
        streams = self.shared.streams
        with streams.use(streams.reduce_scatter):
            wait_all(item.scatter for item in self._reduces)
            for bucket, item in zip(self._trainable, self._reduces, strict=True):
                item.scatter_input = None
                bucket.detach_unsharded_grads()
            assert self._grad_block is not None
            self._pool.give(self._grad_block)  # from the stream that read it last
            self._grad_block = None
            scattered = streams.record(label=f"reduce_scatter:{self.label}")
        if replicated:
            streams.wait(scattered, streams.all_reduce)
            with streams.use(streams.all_reduce):
                for bucket, item in zip(self._trainable, self._reduces, strict=True):
                    all_reduce_now = self.knobs.requires_all_reduce
                    bucket.reducer().replicate(item, self.stats, all_reduce_now=all_reduce_now)
        return replicated and self.knobs.requires_all_reduce

    def finish_reduce(self) -> None:
        """Wait for the all-reduces over the replicas (HSDP); the reduced shards become the
        sharded gradients, unless kept for a later backward's all-reduce."""
        streams = self.shared.streams
        replicated = self.mesh_info.replicate_group is not None
        stream = streams.all_reduce if replicated else streams.reduce_scatter
        with streams.use(stream):
            for bucket, item in zip(self._trainable, self._reduces, strict=True):
                reduce = bucket.reducer()
                if item.replicate is not None:
                    wait_all([item.replicate])
                    reduce.check_replicated(item.output)
                if reduce.unreplicated is None:  # a gradient of every replica
                    knobs = self.knobs
                    hook, hook_stream = knobs.all_reduce_hook, knobs.all_reduce_hook_stream
                    run_all_reduce_hook(hook, hook_stream, item.output, streams)
                    bucket.take_reduced(self._divided(item.output), self.offload, self.stats)
            # compute waits for this before the optimizer reads the gradients (finish_iteration)
            self._reduced = streams.record(label=f"reduced:{self.label}")
        self._reduces.clear()

    def _divided(self, mean: torch.Tensor) -> torch.Tensor:
        """The mean over the unit's ranks, rescaled to the sum / gradient_divide_factor (default:
        the root's data-parallel ranks, which beside expert parallelism outnumber the unit's)."""
        ranks = self.mesh_info.degrees.dp
        factor = self.knobs.gradient_divide_factor or self.data_ranks
        if factor == ranks:
            return mean
        return mean.mul_(ranks / factor)

    def reset(self) -> None:
        """After an interrupted iteration: wait for whatever is in flight and drop it (the
        unsharded gradients and reductions of the interrupted backward), then idle and
        sharded."""
        if self._shared is not None:  # else nothing was ever issued
            self._drain()
        self._reduces.clear()
        self._reduced = None
        for bucket in self._trainable:
            bucket.detach_unsharded_grads()
            dropped = bucket.reducer().drop_accumulated()
            if dropped is not None:
                self._pool.give(dropped)
        if self._grad_block is not None:
            self._pool.give(self._grad_block)
            self._grad_block = None
        if self.sharded_state is ShardedState.UNSHARDING:
            self.sharded_state = ShardedState.UNSHARDED  # its gathers are done: free them
        self.reshard()
        self.usage.restart()
        self.training_state = TrainingState.IDLE

    def _drain(self) -> None:
        """Wait for every collective in flight, each on its stream, and make the compute stream
        wait for them all (``reset``)."""
        streams = self.shared.streams
        with streams.use(streams.all_gather):
            wait_all(self._pending_unshard)
            gathered = streams.record()
        self._pending_unshard.clear()
        with streams.use(streams.reduce_scatter):
            wait_all(item.scatter for item in self._reduces)
            scattered = streams.record()
        with streams.use(streams.all_reduce):
            wait_all(item.replicate for item in self._reduces if item.replicate is not None)
            replicated = streams.record()
        for event in (gathered, scattered, replicated, self._reduced):
            streams.join(event, self.stats)

    def finish_iteration(self) -> None:
        """End of backward: this unit back to idle and sharded (unless it keeps its unsharded
        parameters: ``reshard_after_backward`` off). Under no_sync the unsharded gradient
        buffers stay, to keep accumulating."""
        self.post_backward()
        if self.knobs.reshard_after_backward:
            self.reshard()
        elif self.sharded_state is ShardedState.UNSHARDING:
            self.wait_for_unshard()  # no all-gather left in flight past the iteration
        if self._reduced is not None:  # the optimizer reads the gradients on the compute stream
            self.shared.streams.join(self._reduced, self.stats)
            self._reduced = None
        if self.knobs.requires_gradient_sync:  # no optimizer step between no_sync micro-batches
            for bucket in self.buckets:
                bucket.gather.shard_may_change()
        if self.offload is not None:
            self.offload.wait()  # the optimizer may read the gradients and write the shards
        self.training_state = TrainingState.IDLE
