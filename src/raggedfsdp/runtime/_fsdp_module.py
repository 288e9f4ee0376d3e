"""The methods of a ``fully_shard``-ed module: :class:`FSDPModule`, a subclass of torch's.

``fully_shard`` extends a module's class with it (``FSDP<Class>``), as FSDP2 does, so
``state_dict()`` keys are unchanged and ``isinstance(module, torch.distributed.fsdp.FSDPModule)``
holds (torchtitan turns gradient division off that way). Every method of torch's class is defined
here -- FSDP2's meaning, or a ``NotImplementedError`` saying why (:data:`_NOT_SUPPORTED`, and any
method a later torch adds) -- so none of torch's FSDP2 internals runs on a raggedfsdp module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from .._host import peak_rss_bytes
from ..planner import ShardPlan
from ._adopt import adopt
from ._hooks import FSDPState, named_states_under, state_of, states_under
from ._metrics import RuntimeStats
from ._param_group import FSDPParamGroup
from ._reshard_to import reshard_to
from ._torch_state import finalize_backward
from .residuals import unit_residuals

__all__ = [
    "FSDPModule",
    "UnshardHandle",
    "check_reshard_after_forward",
    "fsdp_class",
    "unsupported",
]


class FSDPModule(TorchFSDPModule):
    """Mixed into the class of every ``fully_shard``-ed module, as FSDP2's is: ``FSDP<Class>``
    is ``(FSDPModule, torch's FSDPModule, Class)``."""

    if TYPE_CHECKING:  # provided by the nn.Module this class is mixed into

        def modules(self) -> Iterator[nn.Module]: ...

    # torch's __new__ (indexing into a container of sharded modules builds the original class)
    # finds the original class at this index of the MRO: FSDP<Class>, this, torch's, Class.
    _orig_cls_mro_index = 3

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        original = cls.__mro__[cls._orig_cls_mro_index]
        self = original.__new__(original, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def __deepcopy__(self, memo: dict) -> Any:
        # AssertionError, with FSDP2's words: what FSDP2's callers expect
        raise AssertionError(
            f"FSDP does not support deepcopy. Please use state dict for serialization: "
            f"{type(self).__name__}'s parameters are views of buffers shared with the rest of "
            f"the model and its hooks belong to one root; copy the model before fully_shard"
        )

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Accepted: raggedfsdp's all-gathers are always issued asynchronously and waited for
        when the unit's forward starts (FSDP2's ``True``)."""

    def reset_iter_state(self) -> None:
        """After an exception interrupted a forward or backward: every unit under this module
        back to idle and sharded -- the collectives in flight waited for, the interrupted
        backward's gradients dropped -- so the next forward starts a clean iteration (FSDP2's
        method). Gradients already reduced into the sharded parameters are kept."""
        states = self._all_states()
        for state in states:
            state.reset()
        for ctx in {id(s.ctx): s.ctx for s in states if s.ctx is not None}.values():
            ctx.reset()

    def _get_fsdp_state(self) -> Any:
        unsupported(
            "FSDPModule._get_fsdp_state()",
            "it returns FSDP2's own state object; raggedfsdp's units keep theirs private",
        )

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """``nn.Module._apply`` (``to``, ``to_empty``, ``cuda``, ``half``, ...) over the unit:
        resharded first, as FSDP2 does, then every converted parameter taken back into the
        unit's buffers ([Note: adopting changed parameters])."""
        state = self._fsdp_state
        state.group.reshard()
        out = super(TorchFSDPModule, self)._apply(*args, **kwargs)  # skip torch's FSDP2 one
        # A unit of several modules is taken back once all of them are converted (a model's
        # _apply reaches them one by one); a unit's next unshard takes back whatever is left.
        state.applied += 1
        if state.applied >= len(state.modules):
            state.applied = 0
            adopt(state.group)
        return out

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
        self, reshard_after_forward: bool | int | None, recurse: bool = True
    ) -> None:
        """Free the unsharded parameters after forward (``True``) or keep them into backward
        (``False``: no second all-gather, more memory); ``None`` is FSDP2's default; an int
        ``N`` keeps them sharded over groups of ``N`` ranks, which backward all-gathers within
        (FSDP2's, ``_reshard_to.py``). The unit that runs forward last keeps its parameters
        into backward either way."""
        check_reshard_after_forward(reshard_after_forward)
        # every unit checked (and its groups made) before any changes
        settings = [
            (s, reshard_to(reshard_after_forward, s.group.mesh_info)) for s in self._states(recurse)
        ]
        for state, (value, keeper) in settings:
            group = state.group
            if group.reshard_to is not None and group.reshard_to.holding:
                group.reshard_to.drop(group.stats)
            state.reshard_after_forward, group.reshard_to = value, keeper

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

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Accepted either way (torch 2.15's pipelining turns it on around a step's
        micro-batches): with it on, the caller ends a backward spread over micro-batches with
        :meth:`finalize_backward`. Each raggedfsdp backward still ends itself, which with
        gradient sync off only accumulates, so the mode changes who reduces, not the result."""

    def finalize_backward(self, *, async_op: bool = False) -> _Finalized | None:
        """Reduce what every unit under this root accumulated since the last reduction (under
        the gradient sync and resharding now set) and end the backward: FSDP2's manual
        finalization. A no-op before the first forward. The reductions are waited for here, so
        with ``async_op`` the handle returned has nothing left to wait for."""
        state = self._fsdp_state
        if state.ctx is not None:
            if state.ctx.root is not state:
                raise RuntimeError(
                    f"finalize_backward must be called on the root module, not on "
                    f"{state.group.label!r}"
                )
            finalize_backward(state)
        return _Finalized() if async_op else None

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next all-gathers wait for ``event`` (recorded after the optimizer step) instead
        of for everything queued on the compute stream so far (FSDP2's): compute queued after
        the step is no longer a false dependency of the first all-gathers. Holds for every unit
        under this module's root ([Note: streams and events] in ``_streams.py``)."""
        state = self._fsdp_state
        if state.ctx is None:  # the streams come with the root's lazy init
            state.post_optim_event = event
        else:
            state.ctx.shared.streams.set_post_optim_event(event)

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
        (default: the number of data-parallel ranks under the root, a mean; beside expert
        parallelism more than the experts' unit has, where FSDP2 divides by the unit's own
        mesh and torchtitan sets this by hand). Recursive, as FSDP2's. The collectives still
        average (in fp32 on Gloo, ``ReduceOp.AVG`` on NCCL); the reduced shard is then scaled
        by ``ranks / factor``: one multiply of the shard, skipped when the factor is the number
        of the unit's ranks."""
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

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: Any = None
    ) -> None:
        """FSDP2's: call ``hook(reduced)`` on this unit's reduced gradient shards, in place,
        after the reduce-scatter (and, under HSDP, the all-reduce over the replicas), before
        ``set_gradient_divide_factor``'s rescaling; e.g. an all-reduce over replicas the mesh
        does not name. Once per bucket of the unit (FSDP2: once per parameter group); each is
        the bucket's ragged shard, so a hook must not assume FSDP2's even pieces. ``stream``:
        where it runs (not under HSDP, FSDP2's ``ValueError``). Not recursive, as FSDP2's."""
        group = self._fsdp_state.group
        if stream is not None and group.mesh_info.replicate_group is not None:
            raise ValueError("stream cannot be set when using native HSDP")  # FSDP2's words
        group.knobs.all_reduce_hook = hook
        group.knobs.all_reduce_hook_stream = stream

    def set_static_graph(self, static_graph: bool = True) -> None:
        """Declare (``True``) that every data-parallel rank runs the same units and uses the same
        parameters in every step, as DDP's ``static_graph``: the start of each backward then
        skips its agreement with the other ranks (one small all-reduce; docs/runtime.md, "Ranks
        whose graphs differ"). Wrong where ranks' graphs differ: collectives mismatch (hang or
        abort). Set on the root (recursive)."""
        for state in self._states(recurse=True):
            state.group.knobs.static_graph = static_graph

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
        residuals = [r for s in states for r in unit_residuals(s.group).values()]
        out["persistent_bytes"] = sum(r.numel() * r.element_size() for r in residuals) + sum(
            s.group.persistent_bytes() for s in states
        )
        # under CPU offload the shards and their gradients are on the host (residuals are not)
        offloaded = [s.group for s in states if s.group.offload is not None]
        out["offloaded_bytes"] = sum(group.persistent_bytes() for group in offloaded)
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
        return [plan for paths, state in named for plan in state.group.named_plans(paths)]


class UnshardHandle:
    """What :meth:`FSDPModule.unshard` returns with ``async_op=True``: ``wait()`` waits for the
    all-gather and hands the module its unsharded parameters (idempotent)."""

    def __init__(self, group: FSDPParamGroup) -> None:
        self._group: FSDPParamGroup | None = group  # released by the first wait()

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class _Finalized:
    """What :meth:`FSDPModule.finalize_backward` returns with ``async_op``: done already."""

    def wait(self) -> None:
        """Nothing left to wait for."""


_OWN_COLLECTIVES = (
    "raggedfsdp's collectives run in place on its DBuffers (ragged shards in its own planner's "
    "layout), so a replacement written for FSDP2's DTensor shards has nothing to act on"
)
_BUFFERS = "raggedfsdp's buffers come from its own pool (DBufferConfig), not the process group's"

#: FSDP2's FSDPModule methods that have no meaning for ragged shards, and why.
_NOT_SUPPORTED = {
    "set_custom_all_gather": _OWN_COLLECTIVES,
    "set_custom_reduce_scatter": _OWN_COLLECTIVES,
    "set_separate_reduce_scatter_group": _OWN_COLLECTIVES,
    "set_reduce_scatter_unused_params": (
        "a unit's reduce-scatter always covers all its parameters (unused ones reduce zeros)"
    ),
    "set_reduce_scatter_max_input_buffers": _BUFFERS,
    "set_allocate_memory_from_process_group_for_comm": _BUFFERS,
    "set_symm_mem_for_comm": _BUFFERS,
}


def _not_supported_method(name: str, why: str) -> Callable[..., None]:
    def method(self: FSDPModule, *args: Any, **kwargs: Any) -> None:
        unsupported(name, why)

    method.__name__ = name
    method.__doc__ = f"Not supported (``NotImplementedError``): {why}."
    return method


for _name, _why in _NOT_SUPPORTED.items():
    setattr(FSDPModule, _name, _not_supported_method(_name, _why))
# Whatever else torch's FSDPModule offers (a later release may add methods) is refused too, so
# that no FSDP2 internal runs on a raggedfsdp module.
for _name in dir(TorchFSDPModule):
    _torch_method = getattr(TorchFSDPModule, _name)
    if not _name.startswith("__") and _name not in vars(FSDPModule) and callable(_torch_method):
        setattr(
            FSDPModule,
            _name,
            _not_supported_method(_name, "raggedfsdp does not provide this FSDP2 method"),
        )


def unsupported(what: str, why: str) -> None:
    raise NotImplementedError(f"raggedfsdp: {what} is not supported: {why}")


def check_reshard_after_forward(value: object) -> None:
    """``reshard_after_forward`` must be a bool, an int or ``None`` (FSDP2's ``ValueError``); an
    int's range is checked against the unit's mesh (``_reshard_to.reshard_to``)."""
    if value is not None and not isinstance(value, int):
        raise ValueError(
            f"reshard_after_forward should be a bool or an int representing the group size to "
            f"reshard to, not {value!r}"
        )


# One sharded class per module class, as FSDP2 keeps: compiled code is guarded on the class of
# ``self``, so blocks of one class must share it (a class per module would make torch.compile
# compile every block anew and, past its recompile limit, silently run the rest eager).
_FSDP_CLASSES: dict[type, type] = {}


def fsdp_class(cls: type) -> type:
    """``FSDP<cls>``: ``cls`` with :class:`FSDPModule`'s methods, made once per class."""
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _FSDP_CLASSES[cls]


def _state_of_module(module: object) -> FSDPState:
    state = state_of(module) if isinstance(module, nn.Module) else None
    if state is None:
        raise ValueError(
            f"prefetch targets must be modules sharded by rf.fully_shard, got "
            f"{type(module).__name__}"
        )
    return state
