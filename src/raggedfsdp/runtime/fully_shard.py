"""``fully_shard`` / ``FSDPBackend``: shard a module in place, and the methods it then has.

``fully_shard`` builds one :class:`~._param_group.FSDPParamGroup` (the unit's buckets and
buffers) and one :class:`~._state.FSDPState` (its hooks) per module, and extends the module's
class with :class:`FSDPModule`, as FSDP2 does, so ``state_dict()`` keys are unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._host import peak_rss_bytes
from ..layout import RaggedShard
from ..planner import ShardPlan, StructAwarePlanner, WrapPolicy, wrap_units
from ._mesh import device_for, mesh_info
from ._metrics import RuntimeStats
from ._param import Registration
from ._param_group import FSDPParamGroup
from ._state import FSDPState, state_of, states_under
from .api import CommCompression, DBufferConfig, MixedPrecisionPolicy

__all__ = ["FSDPBackend", "FSDPModule", "full_parameters", "fully_shard"]


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

    def unshard(self) -> None:
        """All-gather this unit's parameters now (and wait); the modules then hold the full
        parameters until :meth:`reshard` or the next forward's post-hook."""
        state = self._fsdp_state
        state.lazy_init()
        state.group.wait_for_unshard()

    def reshard(self) -> None:
        """Free this unit's unsharded parameters; the modules hold the shards again."""
        self._fsdp_state.group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Reduce gradients across ranks in the next backward (``False`` accumulates the
        unsharded gradients locally, for gradient accumulation). Applies to all units below."""
        for state in self._all_states():
            state.group.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool) -> None:
        """Free the unsharded parameters after forward (``True``) or keep them into backward
        (``False``: no second all-gather, more memory). Applies to all units below; the root
        and the unit that runs forward last keep theirs either way."""
        for state in self._all_states():
            state.reshard_after_forward = reshard_after_forward

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
        before the first forward), with this model's persistent bytes and padding."""
        state = self._fsdp_state
        states = self._all_states()
        stats = state.ctx.resources.stats if state.ctx else RuntimeStats()
        out = stats.snapshot()
        out["persistent_bytes"] = sum(s.group.persistent_bytes() for s in states)
        plans = self.shard_plans()
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
            state.ctx.resources.stats.reset()

    def shard_plans(self) -> list[ShardPlan]:
        """The :class:`~raggedfsdp.ShardPlan` of every bucket under this module, in the order
        and with the names of ``StructAwarePlanner.plan_model``."""
        return [b.plan for s in self._all_states() for b in s.group.buckets]


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
) -> StructAwarePlanner:
    if planner is None:
        return StructAwarePlanner(shard_policy=shard_policy, compression=compression)
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
    return planner


def _registrations(module: nn.Module) -> list[Registration]:
    """Parameters of ``module`` not managed by an inner unit, each with every place it is
    registered (tied parameters have several), in model order."""
    managed: set[int] = set()
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
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    shard_policy: RaggedShard | None = None,
    planner: StructAwarePlanner | None = None,
    dbuffer_config: DBufferConfig | None = None,
    compression: CommCompression | None = None,
) -> FSDPModule:
    """Shard ``module``'s parameters (those not in an inner ``fully_shard``-ed module) over the
    mesh, in place; returns the same object with its class extended by :class:`FSDPModule`.

    Apply it bottom-up: to each block, then to the root. ``reshard_after_forward`` frees the
    unsharded parameters after forward (the root never does, as in FSDP2); the unit that runs
    forward last keeps them into backward, which starts with it. ``mesh`` is 1-D (shard) or 2-D
    (replicate, shard: HSDP); ``None`` shards over the whole default group. ``compression``
    quantizes the all-gather and/or the reduce-scatter block by block (:class:`CommCompression`;
    a ``planner`` given too must carry the same one).
    """
    if state_of(module) is not None:
        raise ValueError(
            f"{type(module).__name__} is already sharded by raggedfsdp (fully_shard was "
            f"applied to it twice)"
        )
    info = mesh_info(mesh)
    planner = _resolve_planner(shard_policy, planner, compression)
    registrations = _registrations(module)
    group = FSDPParamGroup(
        registrations,
        mesh_info=info,
        planner=planner,
        config=dbuffer_config or DBufferConfig(),
        mp_policy=mp_policy,
        device=device_for([r.param for r in registrations], mesh),
        label=type(module).__name__,
        compression=planner.compression,
    )
    FSDPState(module, group, reshard_after_forward)
    # Units take their names from the outermost module sharded so far, as plan_model names them.
    for path, sub in module.named_modules():
        state = state_of(sub)
        if state is not None:
            state.group.set_path(path)
    cls = type(module)
    if not issubclass(cls, FSDPModule):
        module.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return cast(FSDPModule, module)


def FSDPBackend(
    module: nn.Module,
    *,
    shard_policy: RaggedShard | None = None,
    dbuffer_config: DBufferConfig | None = None,
    planner: StructAwarePlanner | None = None,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    wrap: WrapPolicy = None,
    compression: CommCompression | None = None,
) -> FSDPModule:
    """Shard a whole model: every block (each element of an ``nn.ModuleList``, or each module
    for which ``wrap(module)`` is true) bottom-up, then the root. Returns the same object; its
    buckets are exactly ``planner.plan_model(module, W, buffer_size=..., dtype=param_dtype,
    wrap=wrap)``; ``compression`` as in :func:`fully_shard`."""
    planner = _resolve_planner(shard_policy, planner, compression)
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
