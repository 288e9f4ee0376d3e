"""``fully_shard`` / ``FSDPBackend``: shard a module in place, and the methods it then has.

``fully_shard`` builds one :class:`~._param_group.FSDPParamGroup` (the unit's buckets and
buffers) and one :class:`~._hooks.FSDPState` (its hooks) per module, and extends the module's
class with :class:`FSDPModule`, as FSDP2 does, so ``state_dict()`` keys are unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import OffloadPolicy
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from .._host import peak_rss_bytes
from ..layout import RaggedShard
from ..planner import ShardPlan, StructAwarePlanner, WrapPolicy, wrap_units
from ._hooks import FSDPState, named_states_under, state_of, states_under
from ._mesh import MeshInfo, device_for, mesh_info
from ._metrics import RuntimeStats
from ._offload import HostOffload, check_host_backend, offload_for
from ._param import Registration
from ._param_group import FSDPParamGroup
from .api import CommCompression, DBufferConfig, MixedPrecisionPolicy

__all__ = [
    "FSDPBackend",
    "FSDPModule",
    "UnshardHandle",
    "full_parameters",
    "fully_shard",
    "register_fsdp_forward_method",
]


class FSDPModule:
    """Mixed into the class of every ``fully_shard``-ed module (as FSDP2 does)."""

    if TYPE_CHECKING:  # provided by the nn.Module this class is mixed into

        def modules(self) -> Iterator[nn.Module]: ...

    @property
    def _fsdp_state(self) -> FSDPState:
        state = state_of(cast(nn.Module, self))
        assert state is not None
        return state

    def _all_states(self) -> list[FSDPState]:
        return states_under(cast(nn.Module, self))

    def _states(self, recurse: bool) -> list[FSDPState]:
        return self._all_states() if recurse else [self._fsdp_state]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters; the modules then hold the full parameters until
        :meth:`reshard` or the next forward's post-hook. ``async_op=True`` returns at once with a
        handle whose ``wait()`` waits for the all-gather (FSDP2's semantics); a forward waits by
        itself. Not recursive."""
        state = self._fsdp_state
        state.lazy_init()
        if not async_op:
            state.group.wait_for_unshard()
            return None
        state.group.unshard()
        return UnshardHandle(state.group)

    def reshard(self) -> None:
        """Free this unit's unsharded parameters; the modules hold the shards again."""
        self._fsdp_state.group.reshard()

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Reduce gradients across ranks in the next backward (``False`` accumulates the
        unsharded gradients locally, for gradient accumulation)."""
        for state in self._states(recurse):
            state.group.knobs.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(
        self, reshard_after_forward: bool | None, recurse: bool = True
    ) -> None:
        """Free the unsharded parameters after forward (``True``) or keep them into backward
        (``False``: no second all-gather, more memory); ``None`` is FSDP2's default. The unit
        that runs forward last keeps its parameters into backward either way."""
        _check_reshard_after_forward(reshard_after_forward)
        for state in self._states(recurse):
            state.reshard_after_forward = reshard_after_forward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Unshard ``modules`` (asynchronously) when this unit's forward starts, instead of the
        next unit in the recorded order."""
        self._fsdp_state.forward_prefetch = [_state_of_module(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Unshard ``modules`` (asynchronously) when this unit's backward starts, instead of
        the unit whose backward comes next in the recorded order."""
        self._fsdp_state.backward_prefetch = [_state_of_module(m) for m in modules]

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted either way: every raggedfsdp backward waits for its reductions at its end
        (FSDP2's ``True``). With ``False`` FSDP2 lets them run on into the next micro-batch,
        which changes when they finish, not the gradients."""

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Accepted, with nothing to do: the next all-gathers are issued on the current stream,
        after the optimizer step, so they wait for it already."""

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Free the unsharded parameters at the end of backward (``True``, the default) or keep
        them (``False``: between accumulation micro-batches, the next forward needs no
        all-gather; more memory). A kept copy is never used stale: once an optimizer step (or
        a load) changes the shards, the next forward gathers again."""
        for state in self._states(recurse):
            state.group.knobs.reshard_after_backward = reshard_after_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Reduce gradients to their sum over the data-parallel ranks divided by ``factor``
        (default: their number, a mean). Recursive, as FSDP2's. The collectives still average
        (in fp32 on Gloo, ``ReduceOp.AVG`` on NCCL); the reduced shard is then scaled by
        ``ranks / factor``: one multiply of the shard, skipped when the factor is the number of
        ranks."""
        if not (isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 0):
            raise ValueError(f"gradient divide factor must be a positive number, got {factor!r}")
        for state in self._states(recurse=True):
            state.group.knobs.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's older name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted: the result is the same either way (FSDP2 asks its collectives for plain
        sums and scales apart; here Gloo's are sums already, NCCL's ``AVG`` is exact)."""

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: all-reduce the reduced gradient shards over the replicas in the next backward
        (``True``), or only reduce-scatter them within the replica and keep the result, to be
        added in by the next backward that all-reduces (``False``: accumulation with less
        traffic; the sharded gradients appear then). Without replicas, nothing to do."""
        for state in self._states(recurse):
            state.group.knobs.requires_all_reduce = requires_all_reduce

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Gather this unit's parameters for its backward (``True``, the default), or not
        (``False``): for units whose backward needs no parameter values, such as an embedding
        (its weight gradient comes from its inputs and output gradient alone); their gradients
        are still reduced. Not recursive, as FSDP2's."""
        self._fsdp_state.group.knobs.unshard_in_backward = unshard_in_backward

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block; the next backward outside syncs."""
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)

    def stats(self) -> dict[str, float]:
        """Communication, copy and memory counters since the last :meth:`reset_stats` (zeros
        before the first forward), with this model's persistent bytes (``offloaded_bytes`` of
        them on the host under CPU offload) and padding."""
        state = self._fsdp_state
        states = self._all_states()
        stats = state.ctx.shared.stats if state.ctx else RuntimeStats()
        out = stats.snapshot()
        out["persistent_bytes"] = sum(s.group.persistent_bytes() for s in states)
        # under CPU offload the shards and their gradients are on the host (residuals are not)
        offloaded = [b for s in states if s.group.offload is not None for b in s.group.buckets]
        out["offloaded_bytes"] = sum(b.persistent_bytes() for b in offloaded)
        plans = [b.plan for s in states for b in s.group.buckets]  # the numbers, not the names
        out["padding_numel"] = sum(p.padding_numel for p in plans)
        out["param_numel"] = sum(p.param_numel for p in plans)
        out["process_peak_rss_bytes"] = peak_rss_bytes()
        if torch.cuda.is_available() and state.group.device.type == "cuda":
            out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        return out

    def reset_stats(self) -> None:
        """Start a new window of :meth:`stats` (typically one optimizer step); memory still
        held stays counted."""
        state = self._fsdp_state
        if state.ctx is not None:
            state.ctx.shared.stats.reset()

    def shard_plans(self) -> list[ShardPlan]:
        """The :class:`~raggedfsdp.ShardPlan` of every bucket under this module, in the order
        and with the names of ``StructAwarePlanner.plan_model`` applied to this module."""
        named = named_states_under(cast(nn.Module, self))
        return [plan for path, state in named for plan in state.group.named_plans(path)]


class UnshardHandle:
    """What :meth:`FSDPModule.unshard` returns with ``async_op=True``: ``wait()`` waits for the
    all-gather and hands the module its unsharded parameters (idempotent)."""

    def __init__(self, group: FSDPParamGroup) -> None:
        self._group: FSDPParamGroup | None = group  # released by the first wait()

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


_OWN_COLLECTIVES = (
    "raggedfsdp's collectives run in place on its DBuffers (ragged shards in its own planner's "
    "layout), so a replacement written for FSDP2's DTensor shards has nothing to act on"
)
_BUFFERS = "raggedfsdp's buffers come from its own pool (DBufferConfig), not the process group's"

#: FSDP2's FSDPModule methods that have no meaning for ragged shards, and why.
_NOT_SUPPORTED = {
    "set_custom_all_gather": _OWN_COLLECTIVES,
    "set_custom_reduce_scatter": _OWN_COLLECTIVES,
    "set_all_reduce_hook": _OWN_COLLECTIVES,
    "set_separate_reduce_scatter_group": _OWN_COLLECTIVES,
    "set_reduce_scatter_unused_params": (
        "a unit's reduce-scatter always covers all its parameters (unused ones reduce zeros)"
    ),
    "set_reduce_scatter_max_input_buffers": _BUFFERS,
    "set_allocate_memory_from_process_group_for_comm": _BUFFERS,
    "set_symm_mem_for_comm": _BUFFERS,
    "reset_iter_state": (
        "a raggedfsdp iteration leaves nothing to reset when it completes, and a forward or "
        "backward that raised leaves its units mid-step; resume from a checkpoint instead"
    ),
}


def _not_supported_method(name: str, why: str) -> Callable[..., None]:
    def method(self: FSDPModule, *args: Any, **kwargs: Any) -> None:
        _unsupported(name, why)

    method.__name__ = name
    method.__doc__ = f"Not supported (``NotImplementedError``): {why}."
    return method


for _name, _why in _NOT_SUPPORTED.items():
    setattr(FSDPModule, _name, _not_supported_method(_name, _why))


def _unsupported(what: str, why: str) -> None:
    raise NotImplementedError(f"raggedfsdp: {what} is not supported: {why}")


def _state_of_module(module: object) -> FSDPState:
    state = state_of(module) if isinstance(module, nn.Module) else None
    if state is None:
        raise ValueError(
            f"prefetch targets must be modules sharded by rf.fully_shard, got "
            f"{type(module).__name__}"
        )
    return state


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` unshard the module's parameters before it runs and reshard
    them after, as forward does (FSDP2's function; a no-op on a module not sharded by
    ``rf.fully_shard``, as FSDP2's is). torch's own ``register_fsdp_forward_method`` routes
    raggedfsdp modules here when it is looked up after ``import raggedfsdp``
    (:func:`raggedfsdp.integration.install`); a reference bound before that does nothing to
    them."""
    state = state_of(module)
    if state is None:
        return
    if not callable(getattr(module, method_name, None)):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")
    method = getattr(module, method_name)

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        hooked = state._pre_forward(module, args, kwargs)
        if hooked is not None:
            args, kwargs = hooked
        return state._post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped)


def full_parameters(model: nn.Module) -> dict[int, torch.Tensor]:
    """``id(sharded parameter) -> full parameter on CPU`` for every unit under ``model``; a
    collective (every rank calls it, between steps)."""
    full: dict[int, torch.Tensor] = {}
    for state in states_under(model):
        full.update(state.group.full_parameters())
    return full


def _resolve_planner(
    shard_policy: RaggedShard | None,
    planner: StructAwarePlanner | None,
    compression: CommCompression | None = None,
    mp_policy: MixedPrecisionPolicy | TorchMixedPrecisionPolicy | None = None,
) -> StructAwarePlanner:
    """The planner to shard with, checked against the other arguments (before any collective)."""
    if planner is None:
        planner = StructAwarePlanner(shard_policy=shard_policy, compression=compression)
    if shard_policy is not None and shard_policy != planner.shard_policy:
        raise ValueError(
            f"shard_policy={shard_policy!r} differs from the planner's policy "
            f"{planner.shard_policy!r}; pass one of them"
        )
    if compression is not None and compression.enabled and compression != planner.compression:
        # The planner's units must keep this compression's blocks whole.
        raise ValueError(
            f"compression={compression!r} differs from the planner's "
            f"({planner.compression!r}); pass StructAwarePlanner(..., compression=...) too"
        )
    _check_reduce_dtype(mp_policy, planner.compression)
    return planner


def _check_fsdp2_arguments(
    module: object, reshard_after_forward: object, offload_policy: object
) -> None:
    """FSDP2's arguments that have no meaning here: a clear error, before any collective."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"rf.fully_shard takes one nn.Module, got {type(module).__name__} (FSDP2's list of "
            f"modules sharing one group is not supported: shard their parent, or each)"
        )
    _check_reshard_after_forward(reshard_after_forward)
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"offload_policy must be a torch.distributed.fsdp OffloadPolicy, got "
            f"{type(offload_policy).__name__}"
        )


def _offload(
    offload_policy: OffloadPolicy | None,
    device: torch.device,
    config: DBufferConfig,
    compression: CommCompression | None,
    info: MeshInfo,
) -> HostOffload | None:
    """What a ``CPUOffloadPolicy`` asks on ``device`` (``_offload.py``: nothing more on CPU
    unless ``config.host_copies_on_cpu``); refused with a compressed all-gather, which quantizes
    the shard where it lies, and over groups that cannot reduce host tensors."""
    offload = offload_for(offload_policy, device, host_copies_on_cpu=config.host_copies_on_cpu)
    if offload is None:
        return None
    check_host_backend([g for g in (info.shard_group, info.replicate_group) if g])
    if compression is not None and compression.all_gather is not None:
        _unsupported(
            f"offload_policy=CPUOffloadPolicy() with CommCompression(all_gather="
            f"{compression.all_gather})",
            "the quantized all-gather encodes the shard where it lives, which offload puts on "
            "the host; keep compression for the reduce-scatter only (all_gather=None), or drop "
            "the offload",
        )
    return offload


def _check_reduce_dtype(
    mp_policy: MixedPrecisionPolicy | TorchMixedPrecisionPolicy | None,
    compression: CommCompression | None,
) -> None:
    """A compressed reduce-scatter sums the dequantized codes in fp32 and yields an fp32 shard
    (DESIGN.md): an explicit ``reduce_dtype`` other than fp32 would be ignored, so it is refused
    (``None`` and fp32 say what happens anyway)."""
    if compression is None or compression.reduce_scatter is None:
        return
    mp = MixedPrecisionPolicy.of(mp_policy)
    if mp.reduce_dtype is None or mp.reduce_dtype == torch.float32:
        return
    raise ValueError(
        f"mp_policy.reduce_dtype={mp.reduce_dtype} conflicts with "
        f"CommCompression(reduce_scatter={compression.reduce_scatter}): a compressed "
        f"reduce-scatter moves {compression.reduce_scatter} codes and sums them in fp32, so "
        f"there is no {mp.reduce_dtype} reduction; set reduce_dtype=None or torch.float32, or "
        f"reduce_scatter=None to reduce in {mp.reduce_dtype}"
    )


def _check_reshard_after_forward(value: object) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(
            f"reshard_after_forward={value!r}: raggedfsdp takes True, False or None; FSDP2's "
            f"int (reshard to a smaller world) has no equivalent, since a ragged plan is made "
            f"for one world size; use a 2-D mesh (HSDP) to keep all-gathers within a node"
        )


def _check_placements(
    registrations: list[Registration],
    placement_fn: Callable[[nn.Parameter], Placement | None] | None,
) -> None:
    """``shard_placement_fn`` may only ask for what ragged shards are: dim 0, row-major."""
    if placement_fn is None:
        return
    for registration in registrations:
        placement = placement_fn(registration.param)
        if placement is not None and not (isinstance(placement, Shard) and placement.dim == 0):
            raise ValueError(
                f"shard_placement_fn asked {placement!r} for parameter {registration.fqn!r} "
                f"of shape {list(registration.param.shape)}: raggedfsdp shards every parameter "
                f"as runs of whole units in row-major order (Shard(0)); choose the units with "
                f"shard_policy=rf.RaggedShard(block_size=...) instead"
            )


# Set on an original parameter once a unit has sharded it: another unit that still finds it (a
# parameter tied across units) would shard a second, independent copy of the freed original.
_SHARDED_BY = "_raggedfsdp_sharded_by"


# One sharded class per module class, as FSDP2 keeps: compiled code is guarded on the class of
# ``self``, so blocks of one class must share it (a class per module would make torch.compile
# compile every block anew and, past its recompile limit, silently run the rest eager).
_FSDP_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    """``FSDP<cls>``: ``cls`` with :class:`FSDPModule`'s methods, made once per class."""
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _FSDP_CLASSES[cls]


def _mark_sharded(registrations: list[Registration], module: nn.Module) -> None:
    for registration in registrations:
        unit = f"{type(module).__name__} (as {registration.fqn!r})"
        setattr(registration.param, _SHARDED_BY, unit)


def _registrations(module: nn.Module, ignored: set[nn.Parameter]) -> list[Registration]:
    """Parameters of ``module`` not managed by an inner unit nor ignored, each with every place
    it is registered (tied parameters have several), in model order."""
    managed: set[int] = {id(p) for p in ignored}
    for sub in module.modules():
        state = state_of(sub)
        if sub is not module and state is not None:
            managed.update(id(p) for p in state.group.sharded_parameters())
    found: dict[int, tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    for mname, sub in module.named_modules(remove_duplicate=False):
        for pname, param in sub._parameters.items():
            if param is None or id(param) in managed:
                continue
            fqn = f"{mname}.{pname}" if mname else pname
            owners = found.setdefault(id(param), (fqn, param, []))[2]
            if (sub, pname) not in owners:
                owners.append((sub, pname))
    for fqn, param, _ in found.values():
        sharded_by = getattr(param, _SHARDED_BY, None)
        if sharded_by is not None:
            raise ValueError(
                f"parameter {fqn!r} of {type(module).__name__} was sharded already by the "
                f"unit {sharded_by}: it is tied across units (registered in both); shard a "
                f"module that holds every place it is registered, such as their common parent"
            )
        if not param.is_contiguous():
            raise ValueError(
                f"parameter {fqn!r} of shape {list(param.shape)} is not contiguous; "
                f"make it contiguous before fully_shard"
            )
    return [Registration(fqn, param, tuple(owners)) for fqn, param, owners in found.values()]


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Placement | None] | None = None,
    mp_policy: MixedPrecisionPolicy | TorchMixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    shard_policy: RaggedShard | None = None,
    planner: StructAwarePlanner | None = None,
    dbuffer_config: DBufferConfig | None = None,
    compression: CommCompression | None = None,
) -> FSDPModule:
    """Shard ``module``'s parameters (those not in an inner ``fully_shard``-ed module) over the
    mesh, in place; returns the same object with its class extended by :class:`FSDPModule`.

    Apply it bottom-up: to each block, then to the root. FSDP2's arguments keep FSDP2's meanings
    (docs/migrating-from-fsdp2.md): ``reshard_after_forward`` frees the unsharded parameters after
    forward (``None``: yes, but not the root's); the unit that runs forward last keeps them into
    backward, which starts with it. ``mesh`` is 1-D (shard) or 2-D (replicate, shard: HSDP);
    ``None`` shards over the whole default group. ``shard_placement_fn`` may only ask for
    ``Shard(0)`` (or ``None``): ragged shards are runs of whole units in row-major order; choose the
    units with ``shard_policy``. ``offload_policy``: a ``CPUOffloadPolicy`` is met as is on CPU
    devices (unless ``DBufferConfig.host_copies_on_cpu``); on an accelerator the shards,
    gradients and optimizer state live on the host and only the unsharded parameters on the
    device (not with a compressed all-gather). ``ignored_params`` stay unsharded and unmanaged
    (their gradients are not reduced), as in FSDP2. ``compression`` quantizes the all-gather
    and/or the reduce-scatter by blocks (:class:`CommCompression`; a ``planner`` given too must
    carry the same one, and ``mp_policy.reduce_dtype`` be None or fp32 under a compressed
    reduce-scatter)."""
    _check_fsdp2_arguments(module, reshard_after_forward, offload_policy)
    if state_of(module) is not None:
        raise ValueError(
            f"{type(module).__name__} is already sharded by raggedfsdp (fully_shard was "
            f"applied to it twice)"
        )
    info = mesh_info(mesh)
    planner = _resolve_planner(shard_policy, planner, compression, mp_policy)
    registrations = _registrations(module, ignored_params or set())
    _check_placements(registrations, shard_placement_fn)
    device = device_for([r.param for r in registrations], mesh)
    config = dbuffer_config or DBufferConfig()
    offload = _offload(offload_policy, device, config, planner.compression, info)
    group = FSDPParamGroup(
        registrations,
        mesh_info=info,
        planner=planner,
        config=config,
        mp_policy=MixedPrecisionPolicy.of(mp_policy),
        device=device,
        module_name=type(module).__name__,
        compression=planner.compression,
        offload=offload,
    )
    FSDPState(module, group, reshard_after_forward)
    _mark_sharded(registrations, module)
    if not isinstance(module, FSDPModule):
        module.__class__ = _fsdp_class(type(module))
    return cast(FSDPModule, module)


def FSDPBackend(
    module: nn.Module,
    *,
    shard_policy: RaggedShard | None = None,
    dbuffer_config: DBufferConfig | None = None,
    planner: StructAwarePlanner | None = None,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy | TorchMixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | None = True,
    wrap: WrapPolicy = None,
    compression: CommCompression | None = None,
) -> FSDPModule:
    """Shard a whole model: every block (each element of an ``nn.ModuleList``, or each module
    for which ``wrap(module)`` is true) bottom-up, then the root. Returns the same object; its
    buckets are exactly ``planner.plan_model(module, W, buffer_size=..., dtype=param_dtype,
    wrap=wrap)``; ``compression`` as in :func:`fully_shard`."""
    planner = _resolve_planner(shard_policy, planner, compression, mp_policy)
    kwargs = {
        "mesh": mesh,
        "mp_policy": mp_policy,
        "planner": planner,
        "dbuffer_config": dbuffer_config,
    }
    # Bottom-up, in the one order plan_model uses: inner blocks before the modules containing them.
    for _, block in wrap_units(module, wrap)[:-1]:
        if state_of(block) is None:
            fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    return fully_shard(module, reshard_after_forward=reshard_after_forward, **kwargs)
