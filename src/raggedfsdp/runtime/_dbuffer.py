"""DBuffer: one flat buffer per bucket, with parameters and gradients as views into it.

A bucket's :class:`~raggedfsdp.planner.ShardPlan` places every parameter in a global buffer of ``W *
S`` elements; rank ``r`` owns ``[r*S, (r+1)*S)``. A :class:`DBuffer` holds the buffers the
collectives read and write as they are (its comment says which), so neither needs a copy-in or a
copy-out; a :class:`FlatStorage` holds a unit's unsharded buffers in one storage, freed by resizing
([Note: freeing unsharded storage] at :class:`FlatStorage`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..facts import storage_aligned
from ..planner import ShardPlan
from ._comm import AllGather, ReduceScatter
from ._mesh import MeshInfo
from ._metrics import RuntimeStats
from ._offload import HostOffload
from ._param import FSDPParam, Registration

__all__ = ["DBuffer", "FlatStorage", "carve", "packed_nbytes", "storages_for", "views_of"]


def packed_nbytes(sizes: list[tuple[int, torch.dtype]]) -> int:
    """Bytes of one block holding 1-D buffers of ``(numel, dtype)`` back to back, aligned."""
    return sum(storage_aligned(numel * dtype.itemsize) for numel, dtype in sizes)


def carve(block: torch.Tensor, sizes: list[tuple[int, torch.dtype]]) -> list[torch.Tensor]:
    """The buffers of :func:`packed_nbytes`'s layout, as views of the 1-D byte tensor ``block``."""
    views, offset = [], 0
    for numel, dtype in sizes:
        views.append(block[offset : offset + numel * dtype.itemsize].view(dtype))
        offset += storage_aligned(numel * dtype.itemsize)
    return views


# [Note: freeing unsharded storage] Unsharded parameters are persistent views, because autograd
# saves them, and views of them (``weight.t()`` in a linear), for backward. Freeing must keep every
# such view valid for the re-unshard before backward, so the *storage* is resized to zero and back
# (as FSDP2 does) rather than replaced. A :class:`FlatStorage` puts several 1-D buffers in one
# storage: with ``group_level=True`` all buckets of a unit share one, so a unit's unshard is one
# allocation (and one free) however many buckets it has.
class FlatStorage:
    """Several 1-D buffers in one storage that is allocated and freed as a whole.

    The buffer tensors (``views``) are created once and stay valid objects while the storage is
    freed (resized to zero bytes); using one while freed is a bug the runtime's state machine
    rules out. It starts allocated, so views of the buffers can be taken; the owner frees it.
    """

    def __init__(self, sizes: list[tuple[int, torch.dtype]], device: torch.device) -> None:
        self.nbytes = packed_nbytes(sizes)
        self._bytes = torch.empty(self.nbytes, dtype=torch.uint8, device=device)  # 1-D bytes
        self.views = carve(self._bytes, sizes)

    @property
    def allocated(self) -> bool:
        return self._bytes.untyped_storage().nbytes() > 0

    def allocate(self) -> bool:
        """Back the buffers with memory (uninitialised); returns whether it allocated."""
        if self.allocated:
            return False
        self._bytes.untyped_storage().resize_(self.nbytes)
        return True

    def free(self) -> None:
        self._bytes.untyped_storage().resize_(0)


# What a DBuffer holds:
#
# - ``local``      ``[S]`` master dtype, persistent: the sharded parameters are views of it, so the
#   optimizer updates it in place (on the host under CPU offload, ``_offload.py``);
# - ``full``       ``[W*S]`` communication dtype, storage alive from unshard to reshard: the
#   all-gather writes straight into it and the unsharded parameters are views of it (those this rank
#   holds whole are views of ``local`` instead: nothing needs placing for them);
# - ``full_grad``  ``[W*S]`` communication dtype, bound from the unit's first gradient in a backward
#   to its reduce-scatter's completion (a block of the model's :class:`~._pool.BufferPool`):
#   autograd accumulates the unsharded gradients into views of it, and the reduce-scatter reads it
#   as is;
# - the local gradient ``[S]`` master dtype, a fresh buffer per reduce-scatter, which writes into
#   it; the sharded gradients are views of it, so it lives as long as they do.
#
# Sharded parameters and their gradients are :class:`~raggedfsdp.tensor.RaggedTensor` DTensors whose
# local tensors are these views ([Note: ragged shards as DTensors] in tensor/_ragged_tensor.py). A
# bucket of parameters on the meta device keeps ``local`` on meta too, until ``to_empty`` gives it
# memory (``FSDPParamGroup.adopt``); nothing runs on it before then.
#
# So neither collective needs a copy-in or a copy-out.
class DBuffer:
    """The buffers of one bucket and the views that make parameters and gradients out of them.

    ``full`` is a view into a :class:`FlatStorage` and ``full_grad`` into a pooled block, both
    owned by the unit's parameter group (which allocates and frees them). How the buffers are
    communicated is the bucket's own, chosen once when it is built ([Note: one strategy per
    bucket] in ``_comm.py``): ``gather`` fills ``full``, ``reduce`` reads ``full_grad``.
    """

    def __init__(
        self,
        plan: ShardPlan,
        registrations: list[Registration],
        *,
        mesh_info: MeshInfo,
        comm_dtype: torch.dtype,
        device: torch.device,
        gather: AllGather,
        reduce: ReduceScatter | None,
        offload: HostOffload | None = None,
    ) -> None:
        self.plan = plan  # named below the unit's module (FSDPParamGroup.named_plans)
        self.mesh_info = mesh_info
        self.rank = mesh_info.shard_rank
        self.world_size = plan.world_size
        self.shard_numel = plan.shard_numel
        self.device = device
        first = registrations[0].param
        self.dtype = first.dtype  # master dtype of the local shard
        self.comm_dtype = comm_dtype
        self.requires_grad = first.requires_grad
        self.gather = gather  # fills ``full`` from every rank's ``local``
        self.reduce = reduce  # reduces ``full_grad`` to this rank's shard; None when frozen
        self.local = self._new_local(registrations, offload)  # 1-D [S]
        self.full: torch.Tensor | None = None  # 1-D [W*S] comm dtype; set by bind_full
        self.full_grad: torch.Tensor | None = None  # 1-D [W*S]; bound during backward
        by_name = {r.fqn: r for r in registrations}
        #: in buffer order
        self.params = [self._shard(by_name[fqn]) for fqn in plan.entries]

    def _new_local(
        self, registrations: list[Registration], offload: HostOffload | None
    ) -> torch.Tensor:
        """The shard buffer: zeros (the padding between parameters stays deterministic in every
        collective), on the host under CPU offload; on meta while the parameters are."""
        on_meta = [r.param.device.type == "meta" for r in registrations]
        if any(on_meta):
            if not all(on_meta):
                names = [r.fqn for r, meta in zip(registrations, on_meta, strict=True) if meta]
                raise ValueError(
                    f"parameters {names} are on the meta device and others of their bucket are "
                    f"not; materialise all of a module's parameters, or none, before fully_shard"
                )
            return torch.empty(self.shard_numel, dtype=self.dtype, device="meta")
        if offload is not None:
            return offload.zeros(self.shard_numel, self.dtype)
        return torch.zeros(self.shard_numel, dtype=self.dtype, device=self.device)

    def _shard(self, registration: Registration) -> FSDPParam:
        """The record of one parameter: its sharded form, a RaggedTensor whose local tensor is
        a view of ``local`` filled with this rank's piece of the original (unless on the meta
        device), and its unsharded form, whose data :meth:`bind_full` binds."""
        plan, rank, original = self.plan, self.rank, registration.param
        entry = plan.entries[registration.fqn]
        start, end = plan.local_range(entry.name, rank)
        layout = plan.layout(entry.name)
        lo = entry.offset + start - rank * self.shard_numel
        view = self.local[lo : lo + (end - start)].view(layout.local_shape(rank))
        if original.device.type != "meta":
            view.copy_(layout.to_local(registration.local.detach().to(view.device), rank))
        sharded = nn.Parameter(
            registration.placement.sharded(view, layout, self.mesh_info),
            requires_grad=original.requires_grad,
        )
        unsharded = nn.Parameter(
            registration.placement.unsharded(self.comm_dtype, self.device),
            requires_grad=original.requires_grad,
        )
        return FSDPParam(
            registration,
            offset=entry.offset,
            local_start=lo,
            local_end=lo + end - start,
            sharded=sharded,
            unsharded=unsharded,
        )

    def relocate(
        self, local: torch.Tensor, param_dtype: torch.dtype | None, device: torch.device | None
    ) -> None:
        """``local`` (a new shard buffer, already filled) replaces the shard buffer: the bucket
        takes its dtype, its communication dtype follows (``param_dtype`` under mixed precision),
        and ``device`` becomes the compute device (``None``: unchanged, the host keeps the
        shards under offload). The parameters' views and the storages are the callers' to
        make anew."""
        self.local = local
        self.dtype = local.dtype
        floating = param_dtype is not None and local.dtype.is_floating_point
        self.comm_dtype = param_dtype if floating else local.dtype
        if device is not None:
            self.device = device

    def version(self) -> int:
        """A count that grows with every in-place update of the shard: through the sharded
        parameters (an optimizer step, a load: it bumps the RaggedTensor's own version counter,
        not its local tensor's, as the op runs below autograd) or through their local tensors
        and ``local`` itself (views of one storage, one counter)."""
        return self.local._version + sum(param.sharded._version for param in self.params)

    @property
    def full_numel(self) -> int:
        return self.world_size * self.shard_numel

    def gathered(self) -> torch.Tensor:
        """The unsharded buffer (bound at construction)."""
        assert self.full is not None
        return self.full

    def reducer(self) -> ReduceScatter:
        """The reduce-scatter of a trainable bucket (frozen buckets have none)."""
        assert self.reduce is not None
        return self.reduce

    def bind_full(self, full: torch.Tensor, param_buffer: torch.Tensor) -> None:
        """Attach the all-gather output ``full`` and make the unsharded parameters views of
        ``param_buffer``: ``full`` itself with zero copy, or a separate buffer that the
        FSDP2-style path copies into.

        When the all-gather sends the shard as it lies (``gather.whole_from_local``: zero copy,
        no cast, no offload, no compression) a parameter this rank holds whole is a view of
        ``local`` instead: its unsharded form *is* its shard, so the all-gather need not place
        it in ``full`` (see ``own_ranges``)."""
        # (not while the shard is on meta: those views would be meta too; bound again when
        # the shard gets memory)
        whole_from_local = self.gather.whole_from_local and self.local.device.type != "meta"
        self.full = full
        own_ranges = []
        for param in self.params:
            if whole_from_local and param.held_whole:
                local = self.local[param.local_start : param.local_end]
                param.bind_unsharded(local.view(param.shape))
                continue
            view = param_buffer[param.offset : param.offset + param.numel].view(param.shape)
            param.bind_unsharded(view)
            if param.local_end > param.local_start:
                own_ranges.append((param.local_start, param.local_end))
        #: the pieces of ``local`` (start, end) that unsharded views read from this rank's slot
        #: of ``full``: what an all-gather must place there (all of it without zero copy)
        self.own_ranges = own_ranges if whole_from_local else [(0, self.shard_numel)]

    def attach_unsharded_grads(self, full_grad: torch.Tensor) -> None:
        """Unsharded gradients become views of ``full_grad`` (autograd accumulates into them)."""
        self.full_grad = full_grad
        for param in self.params:
            if param.unsharded.requires_grad:
                view = self.full_grad[param.offset : param.offset + param.numel]
                param.set_unsharded_grad(view.view(param.shape))

    def detach_unsharded_grads(self) -> None:
        self.full_grad = None
        for param in self.params:
            param.set_unsharded_grad(None)

    def has_sharded_grads(self) -> bool:
        """Whether any sharded parameter still holds a gradient (not cleared by zero_grad)."""
        return any(param.sharded.grad is not None for param in self.params)

    def attach_sharded_grads(self, local_grad: torch.Tensor) -> None:
        """Sharded gradients become views of ``local_grad`` (1-D ``[S]``, the reduce-scatter's
        output), placed as their parameters."""
        for param in self.params:
            if param.sharded.requires_grad:
                view = local_grad[param.local_start : param.local_end]
                param.sharded.grad = param.placement.placed_grad(view, param.sharded)

    def take_reduced(
        self, output: torch.Tensor, offload: HostOffload | None, stats: RuntimeStats
    ) -> None:
        """The reduced gradient shard ``output`` (1-D ``[S]``) becomes the sharded gradients
        (or is added to those still held: gradients accumulate across steps, as in torch).
        Under ``offload`` it is copied to the host first, and the sharded gradients are views of
        the host copy."""
        if offload is not None:
            output = offload.to_host(output, self.dtype, stats)
            if self.has_sharded_grads():
                offload.wait()  # the host adds the copy below
        if not self.has_sharded_grads():
            if output.dtype != self.dtype:  # reduce_dtype other than the master dtype
                output = output.to(self.dtype)
                stats.add_copy(output)
            self.attach_sharded_grads(output)
            return
        for param in self.params:
            piece = output[param.local_start : param.local_end]
            if param.sharded.grad is not None:
                param.placement.flat(param.sharded.grad.to_local()).add_(piece)
            elif param.sharded.requires_grad:
                copy = piece.to(self.dtype, copy=True)
                param.sharded.grad = param.placement.placed_grad(copy, param.sharded)
                stats.add_copy(piece)

    def persistent_bytes(self) -> int:
        """Bytes this bucket holds between steps: the local shard, and its gradient while the
        sharded parameters hold one."""
        total = self.local.numel() * self.local.element_size()
        if self.has_sharded_grads():
            total += self.local.numel() * self.local.element_size()
        return total


def storages_for(
    buckets: list[DBuffer], device: torch.device, group_level: bool
) -> list[FlatStorage]:
    """Storage for the unsharded buffers of ``buckets``: one for all (``group_level``), or one
    each."""
    sizes = [(b.full_numel, b.comm_dtype) for b in buckets]
    if not sizes:
        return []
    if group_level:
        return [FlatStorage(sizes, device)]
    return [FlatStorage([size], device) for size in sizes]


def views_of(storages: list[FlatStorage]) -> list[torch.Tensor]:
    """The buffers of ``storages``, in bucket order."""
    return [view for storage in storages for view in storage.views]
