"""``fully_shard`` / ``FSDPBackend``: module hooks that drive the parameter groups.

[Note: the life of a step]
- Forward pre-hook of a unit: the root lazily initialises on its first forward (shared stats,
  reduce queue and scratch pool, plan check across ranks). The unit issues its all-gather if not
  prefetched, prefetches the next unit's (order recorded in the first iteration), then waits for
  its own.
- Forward post-hook: reshard (unless ``reshard_after_forward=False``, the root, or the unit that
  ran forward last when gradients are on: its backward comes first), and hook the outputs so
  that the first gradient flowing into them unshards the unit again (pre-backward; the root's
  prefetches the unit whose backward follows its own). Inputs that require grad are routed
  through :class:`_PostBackward`, whose backward runs when the unit's whole backward is done
  (post-backward: reduce-scatter, reshard). A unit's gradient block is taken from the pool when
  its first gradient arrives.
- The first pre-backward queues an end-of-backward callback: it finishes units whose inputs had no
  gradient (the root), waits for every reduce-scatter and leaves all units sharded and idle.
- Under activation checkpointing a unit may run forward again *during* backward; the hooks then
  only unshard.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_map

from .checkpoint import register_state_dict_hooks
from .collectives import all_gather
from .dbuffer import DBufferConfig
from .layout import RaggedShard
from .metrics import RuntimeStats, process_peak_rss_bytes
from .param_group import (
    FSDPParamGroup,
    MeshInfo,
    MixedPrecisionPolicy,
    ReduceQueue,
    Registration,
    TrainingState,
)
from .planner import StructAwarePlanner
from .pool import BufferPool

__all__ = ["FSDPBackend", "FSDPModule", "MixedPrecisionPolicy", "fully_shard"]

_STATE_ATTR = "_raggedfsdp_state"


class _RootContext:
    """What all units under one root share: stats, the reduce queue and the unit order."""

    def __init__(self, root: FSDPState, states: list[FSDPState]) -> None:
        self.root = root
        self.states = states
        self.stats = RuntimeStats()
        self.reduce_queue = ReduceQueue()
        self.pool = BufferPool(self.stats)
        self.forward_order: list[FSDPState] = []
        self.order_recorded = False
        self.in_backward = False
        self.callback_queued = False

    def neighbour(self, state: FSDPState, step: int) -> FSDPState | None:
        """The unit ``step`` places after ``state`` in the recorded forward order."""
        if not self.order_recorded or state not in self.forward_order:
            return None
        i = self.forward_order.index(state) + step
        return self.forward_order[i] if 0 <= i < len(self.forward_order) else None

    def finish_backward(self) -> None:
        """End-of-backward callback (queued on the autograd engine)."""
        for state in reversed(self.forward_order or self.states):
            state.group.post_backward()
        self.reduce_queue.drain()
        for state in self.states:
            state.group.finish_iteration()
        self.pool.clear()  # nothing pooled through forward, where the memory peak is
        self.in_backward = False
        self.callback_queued = False


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward marks the end of the unit's backward."""

    @staticmethod
    def forward(ctx: Any, state: FSDPState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.state.group.post_backward()
        return (None, *grads)


class FSDPState:
    """The hooks of one ``fully_shard``-ed module; they delegate to its parameter group."""

    def __init__(self, module: nn.Module, group: FSDPParamGroup, reshard_after_forward: bool):
        self.module = module
        self.group = group
        self.reshard_after_forward = reshard_after_forward
        self.ctx: _RootContext | None = None
        self.is_root = False
        module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._post_forward, prepend=False)

    # -- lazy init -----------------------------------------------------------------------------

    def _lazy_init(self) -> None:
        """The first unit to run forward is the root: it gathers every unit below it."""
        states = []
        for name, module in self.module.named_modules():
            state = getattr(module, _STATE_ATTR, None)
            if state is not None:
                state.group.label = name or "<root>"  # profiler labels by module path
                states.append(state)
        ctx = _RootContext(self, states)
        for state in states:
            state.ctx = ctx
            state.is_root = state is self
            state.group.use_shared(ctx.stats, ctx.reduce_queue, ctx.pool)
        _check_plans_agree(states, self.group.mesh_info)

    # -- forward -------------------------------------------------------------------------------

    def _pre_forward(
        self, module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict] | None:
        if not dist.is_initialized():
            raise RuntimeError(
                "raggedfsdp: forward called but the torch.distributed process group does not "
                "exist (was it destroyed?)"
            )
        if self.ctx is None:
            self._lazy_init()
        ctx = self.ctx
        assert ctx is not None
        if ctx.in_backward:  # recomputation under activation checkpointing
            self.group.wait_for_unshard()
            return None
        self.group.training_state = TrainingState.FORWARD
        self.group.unshard()
        if not ctx.order_recorded:
            ctx.forward_order.append(self)
        else:
            nxt = ctx.neighbour(self, +1)
            if nxt is not None:
                nxt.group.unshard()  # prefetch: overlaps the next all-gather with this compute
        self.group.wait_for_unshard()
        param_dtype = self.group.mp_policy.param_dtype
        if param_dtype is not None:
            args, kwargs = tree_map(lambda x: _cast_floating(x, param_dtype), (args, kwargs))
        if torch.is_grad_enabled():
            args, kwargs = self._route_inputs(args, kwargs)
        return args, kwargs

    def _route_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Pass tensor inputs that require grad through :class:`_PostBackward`."""
        flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
        index = [i for i, x in enumerate(flat) if torch.is_tensor(x) and x.requires_grad]
        if not index:
            return args, kwargs
        routed = _PostBackward.apply(self, *(flat[i] for i in index))
        for i, x in zip(index, routed, strict=True):
            flat[i] = x
        return torch.utils._pytree.tree_unflatten(flat, spec)

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        ctx = self.ctx
        assert ctx is not None
        if ctx.in_backward:
            return output
        if self.is_root:
            ctx.order_recorded = True
        grad_enabled = torch.is_grad_enabled()
        if self.is_root:
            reshard = not grad_enabled
        else:
            # The unit that runs forward last is the first to run backward: freeing it would
            # only make backward gather it straight back (torchtitan sets this by hand).
            last = ctx.order_recorded and ctx.forward_order[-1] is self
            reshard = self.reshard_after_forward and not (last and grad_enabled)
        if reshard:
            self.group.reshard()
        self.group.training_state = TrainingState.IDLE
        if grad_enabled:
            tensors = [
                t
                for t in torch.utils._pytree.tree_leaves(output)
                if torch.is_tensor(t) and t.requires_grad
            ]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, self._pre_backward, mode="any"
                )
        return output

    # -- backward ------------------------------------------------------------------------------

    def _pre_backward(self, grad: torch.Tensor) -> None:
        ctx = self.ctx
        assert ctx is not None
        if not ctx.callback_queued:
            ctx.callback_queued = True
            ctx.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(ctx.finish_backward)
        self.group.pre_backward()
        # The root's backward (the loss and whatever it computes after its last child) comes
        # first; the unit that ran forward last is next, so its all-gather overlaps the root's.
        if self.is_root and ctx.order_recorded and ctx.forward_order[-1] is not self:
            prev = ctx.forward_order[-1]
        else:
            prev = ctx.neighbour(self, -1)
        if prev is not None and prev.group.training_state is TrainingState.IDLE:
            prev.group.unshard()  # prefetch the unit whose backward comes next


def _cast_floating(x: Any, dtype: torch.dtype) -> Any:
    return x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x


def _check_plans_agree(states: list[FSDPState], mesh_info: MeshInfo) -> None:
    """Before the first all-gather, check every rank planned the same buckets; a rank that
    disagrees would otherwise hang or corrupt the collectives."""
    h = hashlib.sha256()
    for state in states:
        for bucket in state.group.buckets:
            h.update(bucket.plan.digest().encode())
    local = int.from_bytes(h.digest()[:7], "little")
    device = states[0].group.device
    gathered = torch.zeros(mesh_info.shard_size, dtype=torch.int64, device=device)
    mine = torch.tensor([local], dtype=torch.int64, device=device)
    all_gather(gathered, mine, mesh_info.shard_group, RuntimeStats(), async_op=False)
    if len(set(gathered.tolist())) != 1:
        raise RuntimeError(
            f"raggedfsdp: ranks planned different buckets (plan digests per rank: "
            f"{gathered.tolist()}); every rank must wrap the same model with the same policy"
        )


class FSDPModule:
    """Mixed into the class of every ``fully_shard``-ed module (as FSDP2 does)."""

    @property
    def _fsdp_state(self) -> FSDPState:
        return getattr(self, _STATE_ATTR)

    def _all_states(self) -> list[FSDPState]:
        return [getattr(m, _STATE_ATTR) for m in self.modules() if hasattr(m, _STATE_ATTR)]  # type: ignore[attr-defined]

    def unshard(self) -> None:
        """All-gather this unit's parameters now (and wait)."""
        self._fsdp_state.group.wait_for_unshard()

    def reshard(self) -> None:
        """Free this unit's unsharded parameters."""
        self._fsdp_state.group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Reduce gradients across ranks in the next backward (``False`` accumulates the
        unsharded gradients locally, for gradient accumulation). Applies to all units below."""
        for state in self._all_states():
            state.group.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool) -> None:
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
        """Communication, copy and memory counters since the last :meth:`reset_stats`."""
        state = self._fsdp_state
        states = self._all_states()
        out = (state.ctx.stats if state.ctx else state.group.stats).snapshot()
        out["persistent_bytes"] = sum(s.group.persistent_bytes() for s in states)
        out["padding_numel"] = sum(b.plan.padding_numel for s in states for b in s.group.buckets)
        out["param_numel"] = sum(b.plan.param_numel for s in states for b in s.group.buckets)
        out["process_peak_rss_bytes"] = process_peak_rss_bytes()
        if torch.cuda.is_available() and state.group.device.type == "cuda":
            out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        return out

    def reset_stats(self) -> None:
        state = self._fsdp_state
        (state.ctx.stats if state.ctx else state.group.stats).reset()

    def shard_plans(self) -> list:
        """The ShardPlan of every bucket under this module, in unit order."""
        return [b.plan for s in self._all_states() for b in s.group.buckets]


def _mesh_info(mesh: DeviceMesh | None) -> MeshInfo:
    if not dist.is_initialized():
        raise RuntimeError(
            "raggedfsdp: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group() (also for a single process) before "
            "fully_shard"
        )
    world = dist.get_world_size()
    if mesh is None:
        group = dist.group.WORLD
        assert group is not None
        return MeshInfo(group, dist.get_rank(), world)
    if mesh.size() != world:
        raise ValueError(
            f"mesh of shape {tuple(mesh.shape)} has {mesh.size()} ranks but the process group "
            f"has {world}; the mesh must cover every rank"
        )
    if mesh.ndim == 1:
        return MeshInfo(mesh.get_group(0), mesh.get_local_rank(0), mesh.size(0))
    if mesh.ndim == 2:  # HSDP: (replicate, shard)
        return MeshInfo(
            mesh.get_group(1),
            mesh.get_local_rank(1),
            mesh.size(1),
            replicate_group=mesh.get_group(0),
            replicate_size=mesh.size(0),
        )
    raise ValueError(f"mesh must be 1-D (shard) or 2-D (replicate, shard), got {mesh.ndim}-D")


def _device_for(params: list[nn.Parameter], mesh: DeviceMesh | None) -> torch.device:
    real = [p.device for p in params if p.device.type != "meta"]
    if real:
        return real[0]
    if mesh is not None and mesh.device_type != "cpu":
        return torch.device(mesh.device_type, torch.cuda.current_device())
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _resolve_planner(
    shard_policy: RaggedShard | None, planner: StructAwarePlanner | None
) -> StructAwarePlanner:
    if planner is None:
        return StructAwarePlanner(shard_policy=shard_policy)
    if shard_policy is not None and shard_policy != planner.shard_policy:
        raise ValueError(
            f"shard_policy={shard_policy!r} differs from the planner's policy "
            f"{planner.shard_policy!r}; pass one of them"
        )
    return planner


def _registrations(module: nn.Module, prefix: str) -> list[Registration]:
    """Parameters of ``module`` not managed by an inner unit, each with every place it is
    registered (tied parameters have several), in model order."""
    managed: set[int] = set()
    for sub in module.modules():
        if sub is not module and hasattr(sub, _STATE_ATTR):
            managed.update(id(p) for p in getattr(sub, _STATE_ATTR).group.sharded_parameters())
    regs: dict[int, Registration] = {}
    for mname, sub in module.named_modules(remove_duplicate=False):
        for pname, param in sub._parameters.items():
            if param is None or id(param) in managed:
                continue
            fqn = ".".join(x for x in (prefix, mname, pname) if x)
            reg = regs.setdefault(id(param), Registration(fqn, param))
            if (sub, pname) not in reg.owners:
                reg.owners.append((sub, pname))
    for reg in regs.values():
        if not reg.param.is_contiguous():
            raise ValueError(
                f"parameter {reg.fqn!r} of shape {list(reg.param.shape)} is not contiguous; "
                f"make it contiguous before fully_shard"
            )
    return list(regs.values())


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    shard_policy: RaggedShard | None = None,
    planner: StructAwarePlanner | None = None,
    dbuffer_config: DBufferConfig | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters (those not in an inner ``fully_shard``-ed module) over the
    mesh, in place; returns the same object with its class extended by :class:`FSDPModule`.

    Apply it bottom-up: to each block, then to the root. ``reshard_after_forward`` frees the
    unsharded parameters after forward (the root never does, as in FSDP2); the unit that runs
    forward last keeps them into backward, which starts with it.
    """
    if hasattr(module, _STATE_ATTR):
        raise ValueError(
            f"{type(module).__name__} is already sharded by raggedfsdp (fully_shard was "
            f"applied to it twice)"
        )
    mesh_info = _mesh_info(mesh)
    planner = _resolve_planner(shard_policy, planner)
    config = dbuffer_config or DBufferConfig()
    label = _unit_label(module)
    regs = _registrations(module, prefix="")
    group = FSDPParamGroup(
        regs,
        mesh_info=mesh_info,
        planner=planner,
        config=config,
        mp_policy=mp_policy,
        device=_device_for([r.param for r in regs], mesh),
        label=label,
    )
    setattr(module, _STATE_ATTR, FSDPState(module, group, reshard_after_forward))
    register_state_dict_hooks(module)
    cls = type(module)
    if not issubclass(cls, FSDPModule):
        module.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return module


def _unit_label(module: nn.Module) -> str:
    return type(module).__name__


def FSDPBackend(
    module: nn.Module,
    *,
    shard_policy: RaggedShard | None = None,
    dbuffer_config: DBufferConfig | None = None,
    planner: StructAwarePlanner | None = None,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    wrap: Callable[[nn.Module], bool] | None = None,
) -> nn.Module:
    """Shard a whole model: every block (each element of an ``nn.ModuleList``, or each module
    for which ``wrap(module)`` is true) bottom-up, then the root. Returns the same object."""
    planner = _resolve_planner(shard_policy, planner)
    if wrap is None:
        blocks = [
            child for sub in module.modules() if isinstance(sub, nn.ModuleList) for child in sub
        ]
    else:
        blocks = [m for m in module.modules() if m is not module and wrap(m)]
    kwargs = {
        "mesh": mesh,
        "mp_policy": mp_policy,
        "planner": planner,
        "dbuffer_config": dbuffer_config,
    }
    for block in reversed(blocks):  # bottom-up: inner blocks before the modules containing them
        if not hasattr(block, _STATE_ATTR):
            fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    return fully_shard(module, reshard_after_forward=reshard_after_forward, **kwargs)
