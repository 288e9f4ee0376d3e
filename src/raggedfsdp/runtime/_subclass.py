"""Parameters whose local tensor is a tensor subclass: FSDP2's all-gather extension protocol.

A subclass (torchao's float8 weight, NF4, a test's ``TwoTensor``) joins FSDP2 through two methods
on its local tensor: ``fsdp_pre_all_gather`` (this rank's shard -> the tensors to all-gather, and
metadata) and ``fsdp_post_all_gather`` (every rank's tensors, concatenated along dim 0 -> the
unsharded parameter, or refill ``out=`` in place). raggedfsdp cannot put such a parameter in a
bucket's flat buffer as it puts a plain one (its data is not one tensor of its dtype), so it has
to follow the protocol, or refuse the parameter: never train its inner data in its place.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from ..layout import RaggedShard, ShardLayout
from ..planner import block_layout, block_numel_of
from ..tensor import placed_like
from ._collectives import all_gather, all_reduce, reduce_scatter
from ._mesh import MeshInfo
from ._metrics import RuntimeStats
from ._offload import HostOffload
from ._param import Registration, named_in
from ._param_group import FSDPParamGroup
from ._param_placement import ParamPlacement, Plain, SubMesh
from ._state_machine import ShardedState, TrainingState
from ._streams import wait_all
from .api import CommCompression, MixedPrecisionPolicy

__all__ = [
    "SubclassGroup",
    "SubclassParam",
    "SubclassParams",
    "check_subclasses",
    "is_subclass",
    "speaks_protocol",
    "split_protocol",
    "unit_group",
]

_HOST = torch.device("cpu")

# [Note: subclass parameters beside TP, offloaded]
# Beside tensor parallelism (a DTensor over ``mesh["tp"]`` whose local tensor is the subclass,
# sharded over ``mesh["dp"]``) the protocol sees the local tensor, as FSDP2's does: its local
# shape, the dp mesh; what ``fsdp_post_all_gather`` builds becomes the DTensor over tp again, with
# the parameter's placements, and its gradient is reduced over dp as its local tensor.
# Under CPU offload (as FSDP2's ``FSDPParam`` does) a protocol parameter's shard, inner tensors and
# all, lives on the host: it is moved to the compute device (the subclass's own ``.to``) for
# ``fsdp_pre_all_gather``, and its reduced gradient shard is copied back to the host, where the
# optimizer steps. The host shard is pageable, its copies blocking: pinning it would need every
# subclass to keep its class through ``aten._pin_memory``.

# Packed tensors start on this many bytes, so each is read back as a view of its own dtype.
_ALIGN = 16


def is_subclass(tensor: object) -> bool:
    """Whether ``tensor`` (a parameter's local tensor) is a tensor subclass, not a plain tensor
    or a plain ``nn.Parameter``."""
    return isinstance(tensor, torch.Tensor) and type(tensor) not in (torch.Tensor, nn.Parameter)


def speaks_protocol(tensor: object) -> bool:
    """Whether ``tensor`` has both methods of FSDP2's all-gather extension protocol (a subclass,
    or a plain tensor given them as instance methods, as FSDP2 allows)."""
    return all(
        callable(getattr(tensor, name, None))
        for name in ("fsdp_pre_all_gather", "fsdp_post_all_gather")
    )


def _class_name(tensor: object) -> str:
    cls = type(tensor)
    return f"{cls.__module__}.{cls.__qualname__}"


def check_subclasses(
    registrations: list[Registration], compression: CommCompression | None
) -> None:
    """One clear error at ``fully_shard``, before any collective, for a parameter whose local
    tensor is a subclass raggedfsdp cannot shard: without FSDP2's protocol its inner data would
    be gathered and trained in its place; with it, where the protocol's path does not reach
    (beside tensor parallelism, under compressed communication)."""
    for registration in registrations:
        # the parameter's own local tensor, before a placement transforms it (DimShard's
        # movedim computes a plain tensor of a subclass: its inner data, silently)
        param, fqn = registration.param, registration.fqn
        local = param.to_local() if isinstance(param, DTensor) else param
        if speaks_protocol(local):
            if not isinstance(registration.placement, (Plain, SubMesh)):
                raise NotImplementedError(
                    f"parameter {fqn!r} is a DTensor whose local tensor is a "
                    f"{_class_name(local)} with FSDP2's all-gather extension protocol: "
                    f"raggedfsdp follows the protocol for parameters on the data-parallel mesh "
                    f"or beside it on a sibling mesh (mesh['dp'] beside mesh['tp']), not on the "
                    f"full SPMD mesh nor with shard_placement_fn's Shard(dim > 0) yet"
                )
            if compression is not None and compression.enabled:
                raise ValueError(
                    f"parameter {fqn!r} is a {_class_name(local)}, whose all-gather its own "
                    f"fsdp_pre_all_gather decides: rf.CommCompression cannot quantize it too; "
                    f"shard it in a unit without compression, or drop the compression"
                )
            continue
        if not is_subclass(local):
            continue
        raise TypeError(
            f"parameter {fqn!r} is a {_class_name(local)}, a tensor subclass without FSDP2's "
            f"all-gather extension protocol (fsdp_pre_all_gather / fsdp_post_all_gather): "
            f"raggedfsdp would gather and train the data inside it in its place; give the class "
            f"the protocol, keep the parameter out of the unit (ignored_params), or make it a "
            f"plain tensor"
        )


def split_protocol(
    registrations: list[Registration],
) -> tuple[list[Registration], list[Registration]]:
    """``registrations`` as (those the buckets' flat buffers hold, those that follow the
    protocol), each in model order."""
    plain = [r for r in registrations if not speaks_protocol(r.local)]
    return plain, [r for r in registrations if speaks_protocol(r.local)]


class SubclassParam:
    """One parameter of a unit that follows the protocol: its sharded form (a RaggedTensor
    whose local tensor is the subclass's shard, cut by :func:`~raggedfsdp.planner.block_layout`)
    and its unsharded form (what ``fsdp_post_all_gather`` built, kept across steps and refilled
    through ``out=``)."""

    def __init__(
        self,
        registration: Registration,
        layout: ShardLayout,
        mesh_info: MeshInfo,
        device: torch.device,
    ) -> None:
        """``device``: where the shard lives (the host under CPU offload)."""
        self.fqn = registration.fqn
        self.owners = registration.owners
        self.layout = layout
        #: plain, or a DTensor over a sibling mesh (``_param_placement.py``)
        self.placement: ParamPlacement = registration.placement
        self.shape = registration.local.shape  # what is sharded: a DTensor's local shape
        self.stride = registration.local.stride()
        self.requires_grad = registration.param.requires_grad
        start, end = layout.ranges[mesh_info.shard_rank]
        dim_0_slice = math.prod(self.shape[1:]) or 1  # elements per index of dim 0
        rows = slice(start // dim_0_slice, end // dim_0_slice)
        with torch.no_grad():  # the subclass's own slice keeps its class (FSDP2: its chunk)
            piece = registration.local.detach()[rows].clone().to(device)
        self.sharded = nn.Parameter(
            self.placement.sharded(piece, layout, mesh_info), requires_grad=self.requires_grad
        )
        self.unsharded: nn.Parameter | None = None
        #: the all-gather outputs, the same tensors every time (``None`` until the first)
        self.outputs: list[torch.Tensor] | None = None
        #: what is freed when resharded (the outputs, and what post_all_gather said may go),
        #: with their sizes in bytes
        self._storages: list[tuple[torch.Tensor, int]] = []
        #: per rank, the (shape, dtype) of each tensor it all-gathers (learned once)
        self.inputs: list[list[tuple[torch.Size, torch.dtype]]] | None = None

    @property
    def local(self) -> torch.Tensor:
        """This rank's shard: the subclass itself."""
        return self.sharded.to_local()

    def module(self) -> nn.Module:
        """The module that registers it (first of them): FSDP2's ``fsdp_pre_all_gather`` takes
        it."""
        return self.owners[0][0]

    def hold(self, *, unsharded: bool) -> None:
        """Every module that registers the parameter holds its unsharded (or sharded) form."""
        param = self.unsharded if unsharded else self.sharded
        assert param is not None
        for module, attr in self.owners:
            module._parameters[attr] = param
        if not unsharded:
            self.free()

    def named_in(self, paths: dict[int, str], prefix: str) -> list[tuple[str, nn.Parameter]]:
        return named_in(self.owners, paths, prefix)

    def persistent_bytes(self) -> int:
        """Bytes this shard holds between steps: its inner tensors, and its gradient while it
        has one."""
        local = self.local
        flatten = getattr(local, "__tensor_flatten__", None)  # a plain tensor has no inner ones
        inner = [getattr(local, name) for name in flatten()[0]] if flatten else [local]
        total = sum(_nbytes(tensor) for tensor in inner)
        grad = self.sharded.grad
        return total + (_nbytes(grad.to_local()) if grad is not None else 0)

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The unsharded gradient's tensor to reduce over dp: itself, or beside tensor
        parallelism its local tensor, placed as the parameter over tp first (as FSDP2's
        ``_get_grad_inner_tensor``)."""
        split = self.placement.split
        if split is None:
            return grad
        assert isinstance(grad, DTensor), type(grad)
        if grad.placements != split.placements:
            grad = grad.redistribute(placements=split.placements)
        return grad.to_local()

    def free(self) -> None:
        """Give back the memory of the all-gather outputs and of what post_all_gather said may
        go, resized to zero as FSDP2 does: the tensors stay valid objects, to be refilled."""
        for tensor, _ in self._storages:
            tensor.untyped_storage().resize_(0)

    def refill(
        self, gathered: list[list[torch.Tensor]], metadata: Any, param_dtype: torch.dtype
    ) -> None:
        """The unsharded parameter from every rank's pieces of each all-gathered tensor. As in
        FSDP2, the all-gather outputs are the same tensors every time (a subclass may keep them
        inside its unsharded form, as torchao's float8 weight does) and the parameter is built
        once, then refilled in place (``out=``), so what autograd saved of it stays valid."""
        if self.outputs is None:
            self.outputs = [torch.cat(pieces) for pieces in gathered]
        else:
            for tensor, nbytes in self._storages:
                tensor.untyped_storage().resize_(nbytes)
            for output, pieces in zip(self.outputs, gathered, strict=True):
                torch.cat(pieces, out=output)
        post = self.local.fsdp_post_all_gather
        if self.unsharded is not None:
            post(tuple(self.outputs), metadata, param_dtype, out=self.unsharded)
        else:
            tensor, to_free = post(tuple(self.outputs), metadata, param_dtype)
            # beside tensor parallelism: the DTensor over tp again (FSDP2 refills it through
            # ``out=`` as it is, so a subclass finds its own tensor at ``out._local_tensor``)
            unsharded = self.placement.around(tensor)
            self.unsharded = nn.Parameter(unsharded, requires_grad=self.requires_grad)
            everything = (*self.outputs, *to_free)
            self._storages = [(t, t.untyped_storage().nbytes()) for t in everything]
        if _releases_outputs(self.local):  # not kept inside the unsharded form: free them now
            for output in self.outputs:
                output.untyped_storage().resize_(0)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _releases_outputs(local: torch.Tensor) -> bool:
    """Whether the subclass says its all-gather outputs may go as soon as
    ``fsdp_post_all_gather`` has built the unsharded parameter (its unsharded form keeps none of
    them): FSDP2's ``fsdp_should_release_all_gather_outputs_after_post_all_gather`` (pytorch
    #194114, after torch 2.15), honoured here whatever the torch."""
    says = getattr(local, "fsdp_should_release_all_gather_outputs_after_post_all_gather", None)
    return bool(says()) if callable(says) else False


class SubclassParams:
    """The protocol parameters of one unit: gathered in one all-gather of bytes (so fp8 inner
    tensors travel over Gloo, which has no float8 dtypes), their gradients reduced in one
    reduce-scatter, both on the unit's shard group."""

    def __init__(
        self,
        registrations: list[Registration],
        *,
        mesh_info: MeshInfo,
        mp_policy: MixedPrecisionPolicy,
        policy: RaggedShard,
        device: torch.device,
        offload: HostOffload | None = None,
    ) -> None:
        self.mesh_info = mesh_info
        self.mp_policy = mp_policy
        self.device = device  # the compute device: all-gather, reduce-scatter
        #: CPU offload: the shards and their gradients on the host
        self.offload = offload
        home = _HOST if offload is not None else device
        world = mesh_info.shard_size
        self.params = [
            SubclassParam(
                r,
                block_layout(r.fqn, r.local.shape, world, block_numel_of(r.local), policy),
                mesh_info,
                home,
            )
            for r in registrations
        ]
        #: bytes this rank received by the all-gathers, by the dtype of the tensor they belong to
        #: (padding under ``None``)
        self.gathered_bytes: dict[torch.dtype | None, int] = {}
        self._gathered_versions: list[int] = []
        for param in self.params:
            param.hold(unsharded=False)

    def persistent_bytes(self) -> int:
        """Bytes the shards and their gradients hold between steps (on the host under
        offload)."""
        return sum(param.persistent_bytes() for param in self.params)

    def versions(self) -> list[int]:
        """How often each shard was updated in place (an optimizer step, a load)."""
        return [param.sharded._version for param in self.params]

    def stale(self) -> bool:
        """Whether a shard changed in place since it was last gathered."""
        return self.versions() != self._gathered_versions

    def _pre_all_gather(self, param: SubclassParam) -> tuple[tuple[torch.Tensor, ...], Any]:
        """The tensors this rank sends for ``param``, through whichever of FSDP2's two
        signatures its class defines, on the compute device (the host shard moved there under
        offload, as FSDP2's ``all_gather_inputs``)."""
        local = param.local
        if self.offload is not None:
            local = local.to(self.device)
        method = local.fsdp_pre_all_gather
        if len(inspect.signature(method).parameters) == 1:  # (mesh)
            return method(self.mesh_info.mesh)
        mp = self.mp_policy
        torch_mp = TorchMixedPrecisionPolicy(
            param_dtype=mp.param_dtype,
            reduce_dtype=mp.reduce_dtype,
            output_dtype=mp.output_dtype,
            cast_forward_inputs=mp.cast_forward_inputs,
        )
        return method(self.mesh_info.mesh, param.shape, param.stride, param.module(), torch_mp)

    @torch.no_grad()  # as FSDP2's: the unsharded parameter is a leaf, refilled in place
    def gather(self, stats: RuntimeStats) -> None:
        """All-gather every parameter's tensors and build (or refill) the unsharded parameters."""
        self._gathered_versions = self.versions()
        sent, metadata = [], []
        for param in self.params:
            inputs, meta = self._pre_all_gather(param)
            sent.append([t.contiguous() for t in inputs])
            metadata.append(meta)
        self._learn_inputs(sent)
        world = self.mesh_info.shard_size
        slots = [_offsets([s for p in self.params for s in p.inputs[r]]) for r in range(world)]
        slot = max(end for _, end in slots)
        flat = [t for tensors in sent for t in tensors]
        send = torch.zeros(slot, dtype=torch.uint8, device=self.device)
        for tensor, offset in zip(flat, slots[self.mesh_info.shard_rank][0], strict=True):
            nbytes = tensor.numel() * tensor.element_size()
            send[offset : offset + nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
        received = torch.empty(world * slot, dtype=torch.uint8, device=self.device)
        wait_all([all_gather(received, send, self.mesh_info.shard_group, stats, async_op=False)])
        pieces = [
            _unpacked(received[r * slot : (r + 1) * slot], self._specs(r), slots[r][0])
            for r in range(world)
        ]
        self._count(slot * world)
        index = 0
        for param, meta in zip(self.params, metadata, strict=True):
            count = len(param.inputs[0])
            gathered = [[pieces[r][index + i] for r in range(world)] for i in range(count)]
            index += count
            param.refill(gathered, meta, self._param_dtype(param.local))

    def _param_dtype(self, local: torch.Tensor) -> torch.dtype:
        """The ``param_dtype`` ``fsdp_post_all_gather`` takes, as FSDP2 gives it (torch 2.13,
        ``FSDPParam.init_dtype_attrs``): mixed precision's, unless the parameter is not floating
        point; else the parameter's own."""
        wanted = self.mp_policy.param_dtype
        return wanted if wanted is not None and local.dtype.is_floating_point else local.dtype

    def _specs(self, rank: int) -> list[tuple[torch.Size, torch.dtype]]:
        """``rank``'s (shape, dtype) of every tensor it sends, in packing order."""
        return [spec for param in self.params for spec in param.inputs[rank]]

    def _count(self, total: int) -> None:
        """Add one all-gather of ``total`` bytes to :attr:`gathered_bytes`, by inner dtype."""
        world = self.mesh_info.shard_size
        useful = 0
        for rank in range(world):
            for shape, dtype in self._specs(rank):
                nbytes = shape.numel() * dtype.itemsize
                self.gathered_bytes[dtype] = self.gathered_bytes.get(dtype, 0) + nbytes
                useful += nbytes
        self.gathered_bytes[None] = self.gathered_bytes.get(None, 0) + total - useful

    def _learn_inputs(self, sent: list[list[torch.Tensor]]) -> None:
        """Every rank's (shape, dtype) of each tensor it sends, exchanged once: ragged shards
        differ in rows, and the receiver must know where each rank's tensors lie."""
        mine = [[(t.shape, t.dtype) for t in tensors] for tensors in sent]
        if self.params[0].inputs is not None:
            for param, specs in zip(self.params, mine, strict=True):
                if specs != param.inputs[self.mesh_info.shard_rank]:
                    raise ValueError(
                        f"parameter {param.fqn!r}: fsdp_pre_all_gather returned tensors of "
                        f"{specs} after {param.inputs[self.mesh_info.shard_rank]} before; "
                        f"raggedfsdp needs the same shapes and dtypes every step"
                    )
            return
        everyone: list[Any] = [None] * self.mesh_info.shard_size
        dist.all_gather_object(everyone, mine, group=self.mesh_info.shard_group)
        for index, param in enumerate(self.params):
            param.inputs = [ranks[index] for ranks in everyone]

    def reduce(self, stats: RuntimeStats, divided: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Reduce-scatter the unsharded gradients into the sharded ones (added to those still
        held), averaged over the replicas too under HSDP; ``divided`` rescales the mean as the
        unit's plain gradients are. A parameter no rank used keeps its sharded gradient as it
        was (``None`` where none was held), as in one process: each rank's slot ends with one
        element per parameter, 1 where this rank has its gradient, which the reduce-scatter's
        mean leaves above 0 where any rank used it, with no collective of its own."""
        trainable = [p for p in self.params if p.requires_grad and p.unsharded is not None]
        if not trainable:
            return
        info, world = self.mesh_info, self.mesh_info.shard_size
        rank = info.shard_rank
        mp = self.mp_policy
        dtype = mp.reduce_dtype or mp.param_dtype or trainable[0].sharded.dtype
        sizes = [max(p.layout.local_numel(r) for r in range(world)) for p in trainable]
        used_at = sum(sizes)  # where the used flags start in each slot
        slot = used_at + len(trainable)
        full = torch.zeros(world * slot, dtype=dtype, device=self.device)
        offset = 0
        for index, (param, size) in enumerate(zip(trainable, sizes, strict=True)):
            grad = param.unsharded.grad
            if grad is not None:
                full.view(world, slot)[:, used_at + index] = 1
                grad = param.local_grad(grad)
                if is_subclass(grad):
                    raise TypeError(
                        f"parameter {param.fqn!r}: its gradient is a {_class_name(grad)}; "
                        f"raggedfsdp reduces plain gradients only"
                    )
                flat = grad.detach().reshape(-1)
                for r, (start, end) in enumerate(param.layout.ranges):
                    at = r * slot + offset
                    full[at : at + end - start].copy_(flat[start:end])
            param.unsharded.grad = None
            offset += size
        out = torch.empty(slot, dtype=dtype, device=self.device)
        group = info.shard_group
        wait_all([reduce_scatter(out, full, group, stats, async_op=False)])
        if info.replicate_group is not None:
            wait_all([all_reduce(out, info.replicate_group, stats, async_op=False)])
        used = (out[used_at:] > 0).tolist()
        out = divided(out[:used_at])
        offset = 0
        for param, size, any_rank in zip(trainable, sizes, used, strict=True):
            piece = out[offset : offset + param.layout.local_numel(rank)]
            offset += size
            if not any_rank:
                continue
            sharded = param.sharded
            piece = piece.to(sharded.dtype)
            if self.offload is not None:  # the host, where the optimizer steps
                piece = piece.to(_HOST)
            if sharded.grad is not None:
                sharded.grad.to_local().view(-1).add_(piece)
            else:
                sharded.grad = placed_like(piece.clone(), sharded)


def _offsets(specs: list[tuple[torch.Size, torch.dtype]]) -> tuple[list[int], int]:
    """Byte offsets of tensors of ``specs`` packed back to back, each aligned for any dtype,
    and the bytes they take."""
    offsets, end = [], 0
    for shape, dtype in specs:
        offsets.append(end)
        end += -(-shape.numel() * dtype.itemsize // _ALIGN) * _ALIGN
    return offsets, end


def _unpacked(
    slot: torch.Tensor, specs: list[tuple[torch.Size, torch.dtype]], offsets: list[int]
) -> list[torch.Tensor]:
    """The tensors of ``specs`` read back from one rank's slot of bytes (views)."""
    return [
        slot[offset : offset + shape.numel() * dtype.itemsize].view(dtype).view(shape)
        for (shape, dtype), offset in zip(specs, offsets, strict=True)
    ]


class SubclassGroup(FSDPParamGroup):
    """A unit with protocol parameters: its buckets' parameters as any unit's, and beside them
    :class:`SubclassParams`, gathered when the buckets are (at once, with the protocol's
    pre- and post-all-gather), held and freed with them, reduced when their gradients are."""

    def __init__(
        self, registrations: list[Registration], *, subclass: SubclassParams, **kwargs: Any
    ):
        self.subclass = subclass
        super().__init__(registrations, **kwargs)

    def unshard(self) -> None:
        issues = self.sharded_state is ShardedState.SHARDED or self._stale()
        super().unshard()
        if issues and self.sharded_state is ShardedState.UNSHARDING:
            self.subclass.gather(self.stats)

    def _stale(self) -> bool:
        return super()._stale() or self.subclass.stale()

    def _hold(self, *, unsharded: bool) -> None:
        super()._hold(unsharded=unsharded)
        for param in self.subclass.params:
            param.hold(unsharded=unsharded)

    def post_backward(self) -> None:
        reduces = self.training_state is TrainingState.PRE_BACKWARD
        super().post_backward()
        if reduces and self.knobs.requires_gradient_sync:
            self.subclass.reduce(self.stats, self._divided)

    def sharded_parameters(self) -> list[nn.Parameter]:
        return super().sharded_parameters() + [p.sharded for p in self.subclass.params]

    def persistent_bytes(self) -> int:
        return super().persistent_bytes() + self.subclass.persistent_bytes()

    def named_parameters_in(self, root: nn.Module, prefix: str) -> list[tuple[str, nn.Parameter]]:
        paths = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
        named = [item for p in self.subclass.params for item in p.named_in(paths, prefix)]
        return super().named_parameters_in(root, prefix) + named


def unit_group(
    registrations: list[Registration],
    *,
    offload: HostOffload | None,
    **kwargs: Any,
) -> FSDPParamGroup:
    """The unit's parameter group: an :class:`FSDPParamGroup`, or a :class:`SubclassGroup`
    when some of ``registrations`` follow the protocol (``kwargs``: the group's); a subclass
    it cannot shard is an error here, before the group's collectives."""
    check_subclasses(registrations, kwargs.get("compression"))
    in_buckets, protocol = split_protocol(registrations)
    if not protocol:
        return FSDPParamGroup(registrations, offload=offload, **kwargs)
    subclass = SubclassParams(
        protocol,
        mesh_info=kwargs["mesh_info"],
        mp_policy=kwargs["mp_policy"],
        policy=kwargs["planner"].shard_policy,
        device=kwargs["device"],
        offload=offload,
    )
    return SubclassGroup(in_buckets, subclass=subclass, offload=offload, **kwargs)
