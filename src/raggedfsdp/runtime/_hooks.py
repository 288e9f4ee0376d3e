"""The hooks of a ``fully_shard``-ed module.

Hooks are bound methods of :class:`FSDPState`, registered once, that decide *when*; the unit's
:class:`~._param_group.FSDPParamGroup` does the work. When each runs, forward to the end of
backward: [Note: the life of a step] at :class:`FSDPState`.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from ..planner import ShardPlan, post_order
from ._adopt import adopt, meta_parameters
from ._collectives import all_gather
from ._data_parallel import data_parallel_ranks
from ._metrics import RuntimeStats
from ._param_group import FSDPParamGroup
from ._root import RootContext
from ._state_dict import state_dict_post_hook
from ._state_machine import RootPhase, TrainingState
from ._usage import Seen, will_run

__all__ = ["FSDPState", "named_states_under", "state_of", "states_under"]

# The attribute of a sharded module that holds its FSDPState; read only through state_of().
_STATE_ATTR = "_raggedfsdp_state"


def state_of(module: nn.Module) -> FSDPState | None:
    """The :class:`FSDPState` of a ``fully_shard``-ed module, or ``None``. Read from the
    module's own attributes: a wrapper that forwards unknown attributes to what it wraps
    (``checkpoint_wrapper``) is not the module it wraps."""
    return vars(module).get(_STATE_ATTR)


def named_states_under(module: nn.Module) -> list[tuple[list[str], FSDPState]]:
    """``(paths below module, state)`` of ``module`` and of every sharded module below it,
    inner units first and the root last: the order of ``plan_model``'s buckets. A unit of
    several modules (``fully_shard([a, b])``) comes once, at its first module, with the path of
    each of its modules in its own order."""
    units = post_order(module, lambda m: state_of(m) is not None)
    paths = {id(m): path for path, m in units}
    seen: dict[int, tuple[list[str], FSDPState]] = {}
    for _, m in units:
        state = state_of(m)
        if state is not None and id(state) not in seen:
            seen[id(state)] = ([paths.get(id(u), "") for u in state.modules], state)
    return list(seen.values())


def states_under(module: nn.Module) -> list[FSDPState]:
    """The states of :func:`named_states_under`, in its order."""
    return [state for _, state in named_states_under(module)]


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward marks the end of the unit's backward."""

    @staticmethod
    def forward(ctx: Any, state: FSDPState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.state.routed_backward_done()
        return (None, *grads)


# [Note: the life of a step]
# - Forward pre-hook of a unit: the root lazily initialises on its first forward (each unit's name,
#   the data-parallel ranks gradients are averaged over, shared stats, reduce queue and scratch
#   pool, plan check across ranks). The unit catches up the units this rank skipped before it,
#   issues its all-gather if not prefetched, prefetches the next unit's (in the agreed order,
#   [Note: ranks whose graphs differ] in ``_sequence.py``), then waits for its own.
# - Forward post-hook: reshard when the next unit starts (unless ``reshard_after_forward=False``,
#   the root, or the unit that ran forward last when gradients are on: its backward comes first),
#   and hook the outputs so that the first gradient flowing into them unshards the unit again
#   (pre-backward; the root's prefetches the unit whose backward follows its own). Inputs that
#   require grad are routed through :class:`_PostBackward`, whose backward runs when the unit's
#   whole backward is done (post-backward: reduce-scatter, reshard). A unit's gradient block is
#   taken from the pool when its first gradient arrives.
# - The first pre-backward agrees with the other ranks on what their backwards run and use, and
#   queues an end-of-backward callback: it finishes units whose inputs had no gradient (the root),
#   waits for every reduce-scatter and leaves all units sharded and idle.
# - Under activation checkpointing a unit may run forward again *during* backward; the hooks then
#   only unshard.
class FSDPState:
    """The hooks of one ``fully_shard``-ed unit -- a module, or several sharing one parameter
    group (FSDP2's ``fully_shard([a, b])``) -- which delegate to its parameter group. A unit of
    several modules runs its pre-forward when the first of them starts its forward and its
    post-forward when all have run (FSDP2's group hooks)."""

    def __init__(
        self,
        modules: list[nn.Module],
        group: FSDPParamGroup,
        reshard_after_forward: bool | None,
    ):
        self.modules = modules
        self.module = modules[0]  # the unit's first module: it names the unit
        self.group = group
        #: True / False, or None: FSDP2's default (True, but False for the root)
        self.reshard_after_forward = reshard_after_forward
        #: units to unshard when this one's forward (backward) starts, set by the user through
        #: set_modules_to_forward_prefetch (_backward_prefetch); None: the recorded neighbour
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        self.ctx: RootContext[FSDPState] | None = None  # set by the root's lazy init
        #: ids of the unit's modules yet to run in the forward under way (empty between them)
        self._to_run: set[int] = set()
        #: outputs requiring grad of the unit's modules in that forward (their gradients start
        #: its backward), until its post-forward hooks them
        self._outputs: list[torch.Tensor] = []
        #: how many of its modules nn.Module._apply has converted since the unit last took
        #: its parameters back (FSDPModule._apply)
        self.applied = 0
        #: FSDPModule.set_post_optim_event's event, set before the root's lazy init made the
        #: streams that wait for it
        self.post_optim_event: Any = None
        #: autograd nodes of this iteration's forwards: of the unit's outputs (their gradients
        #: start its backward) and of its routed inputs (their backward ends it), to tell at the
        #: start of backward what it runs ([Note: ranks whose graphs differ])
        self._output_nodes: list[Any] = []
        self._routed_nodes: list[Any] = []
        self._routed_left = 0  # routed inputs whose backward is still to run in this backward
        #: whether this backward reduces the unit once, after its last pass, rather than after
        #: each (FSDP2's way, kept where every rank runs it as often)
        self.reduce_once = True
        #: whether it reduces at the end of backward though its inputs had gradients (some
        #: rank's had none)
        self.reduce_late = False
        for module in modules:
            self._hook(module)

    def _hook(self, module: nn.Module) -> None:
        setattr(module, _STATE_ATTR, self)
        module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._post_forward, prepend=False)
        # torch marks state-dict hooks with an attribute, which a bound method cannot take.
        module.register_state_dict_pre_hook(functools.partial(FSDPState._hold_sharded, self))
        module.register_state_dict_post_hook(
            functools.partial(FSDPState._state_dict_post_hook, self)
        )
        module.register_load_state_dict_pre_hook(functools.partial(FSDPState._hold_sharded, self))
        module.register_load_state_dict_post_hook(self._load_state_dict_post_hook)

    def reset(self) -> None:
        """The unit back to idle and sharded after an interrupted iteration."""
        self._to_run.clear()
        self._outputs.clear()
        self.forget_graph()
        self.group.reset()

    def forget_graph(self) -> None:
        """The iteration's backward is over: let its autograd nodes go."""
        self._output_nodes.clear()
        self._routed_nodes.clear()
        self._routed_left = 0

    @property
    def is_root(self) -> bool:
        return self.ctx is not None and self.ctx.root is self

    # -- lazy init -----------------------------------------------------------------------------

    def lazy_init(self) -> RootContext[FSDPState]:
        """The first unit to run forward (or to be unsharded by hand) is the root: it takes
        every unit below it, names each by its path (once, as FSDP2's ``_init_fqns``), shares
        its resources with them and checks, before the first all-gather, that every parameter's
        gradient reaches all the data-parallel ranks ([Note: units on different meshes]) and
        that every rank planned the same buckets. Idempotent."""
        if self.ctx is not None:
            return self.ctx
        named = named_states_under(self.module)
        for _, state in named:
            if state.ctx is not None and not state.ctx.never_ran:
                raise RuntimeError(
                    f"raggedfsdp: {state.group.label} already ran under another root; run "
                    f"forward through the outermost fully_shard-ed module"
                )
        taken_in = set()
        for _, state in named:
            if state.ctx is not None:  # unsharded by hand before this root's first forward
                state.group.reshard()  # (FSDP2's unshard() makes no root): joins this one
                state.ctx = None
                taken_in.add(id(state))
            adopt(state.group)  # parameters converted below an inner module, say, taken back
        on_meta = [name for paths, state in named for name in meta_parameters(state.group, paths)]
        if on_meta:
            raise RuntimeError(
                f"raggedfsdp: parameters {on_meta} are still on the meta device; give them memory "
                f"and values first (model.to_empty(device=...) then their initialisation, e.g. "
                f"reset_parameters(), or rf.init_sharded_)"
            )
        data_ranks = data_parallel_ranks([(paths, state.group) for paths, state in named])
        ctx = RootContext(self, [state for _, state in named])
        for paths, state in named:
            state.ctx = ctx
            state.group.bind(ctx.shared, paths, replace=id(state) in taken_in)
            state.group.data_ranks = data_ranks
            if state.post_optim_event is not None:
                ctx.shared.streams.set_post_optim_event(state.post_optim_event)
                state.post_optim_event = None
        plans = [plan for paths, state in named for plan in state.group.named_plans(paths)]
        # over each unit's shard group (several beside expert parallelism), in unit order
        groups = {id(s.group.mesh_info.shard_group): s.group for _, s in named}
        for group in groups.values():
            _check_plans_agree(plans, group)
        return ctx

    # -- forward -------------------------------------------------------------------------------

    def _pre_forward(
        self, module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict] | None:
        if not dist.is_initialized():
            raise RuntimeError(
                "raggedfsdp: forward called but the torch.distributed process group does not "
                "exist (was it destroyed?)"
            )
        ctx = self.lazy_init()
        if ctx.phase is RootPhase.BACKWARD:
            if torch._C._current_graph_task_id() == -1:  # not inside the autograd engine
                raise RuntimeError(
                    f"raggedfsdp: {self.group.label} runs forward while the previous backward "
                    f"never finished (it raised?); call model.reset_iter_state() first, as with "
                    f"FSDP2, or its gradients would not be reduced"
                )
            self.group.wait_for_unshard()  # recomputation under activation checkpointing
            return None
        if self._to_run and id(module) in self._to_run:  # a later module of this unit
            return self._cast_inputs(args, kwargs)
        if self._to_run:  # one of its modules runs again: the unit's last forward is over
            self._to_run.clear()
            self._end_forward(ctx)
        if self.is_root:
            ctx.in_forward = True
            static = self.group.knobs.static_graph
            ctx.sequence.begin_forward(check_revisits=torch.is_grad_enabled() and not static)
            # The optimizer may have written the shards: the next all-gathers wait for compute
            # (or for FSDPModule.set_post_optim_event's event).
            ctx.shared.streams.compute_moved()
        # Inside the root's forward the unit's forward spans all its modules; outside it (a
        # module of the unit called on its own, as chunked losses call the output layer once
        # per chunk) one call is a whole forward of the unit.
        self._to_run = {id(m) for m in (self.modules if ctx.in_forward else [module])}
        if ctx.in_forward and not self.is_root:
            ctx.sequence.arrive(self)  # the units this rank skipped first: their collectives
        if not ctx.order_recorded:
            ctx.forward_order.append(self)
        self._gather_for_forward(ctx)
        args, kwargs = self._cast_inputs(args, kwargs)
        if torch.is_grad_enabled():
            args, kwargs = self._route_inputs(args, kwargs)
        return args, kwargs

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        policy = self.group.mp_policy
        if policy.param_dtype is not None and policy.cast_forward_inputs:
            args, kwargs = _cast_floating((args, kwargs), policy.param_dtype)
        return args, kwargs

    def _route_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Pass tensor inputs that require grad through :class:`_PostBackward`."""
        flat, spec = tree_flatten((args, kwargs))
        index = [i for i, x in enumerate(flat) if torch.is_tensor(x) and x.requires_grad]
        if not index:
            return args, kwargs
        routed = _PostBackward.apply(self, *(flat[i] for i in index))
        self._routed_nodes.append(routed[0].grad_fn)
        for i, x in zip(index, routed, strict=True):
            flat[i] = x
        return tree_unflatten(flat, spec)

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        ctx = self.ctx
        assert ctx is not None
        if ctx.phase is RootPhase.BACKWARD:
            return output
        if self.group.mp_policy.output_dtype is not None:
            output = _cast_floating(output, self.group.mp_policy.output_dtype)
        if torch.is_grad_enabled():
            self._outputs += [
                t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad
            ]
        self._to_run.discard(id(module))
        if self._to_run:  # more of the unit's modules to run
            return output
        if self.is_root:
            for state in ctx.states:  # a unit some of whose modules did not run: ended here
                if state._to_run:
                    state._to_run.clear()
                    state._end_forward(ctx)
            ctx.sequence.end_forward()  # the units this rank skipped last: their collectives
            ctx.in_forward = False
            ctx.phase = RootPhase.READY  # the first forward has recorded the unit order
        self._end_forward(ctx)
        if self.is_root:
            ctx.shared.non_finite.end_of_forward()  # compressed gathers: one host sync
        return output

    def _end_forward(self, ctx: RootContext[FSDPState]) -> None:
        """The unit's forward is done: reshard, and arm its pre-backward on its outputs."""
        grad_enabled = torch.is_grad_enabled()
        reshard = self._reshards_after_forward(ctx, grad_enabled)
        if ctx.in_forward and not self.is_root:  # until the next unit's forward starts
            self.group.post_forward(reshard=False)
            ctx.sequence.defer(self, reshard)
        else:
            self.group.post_forward(reshard=reshard)
        outputs, self._outputs = self._outputs, []
        if grad_enabled and outputs:
            self._output_nodes += [get_gradient_edge(t).node for t in outputs]
            torch.autograd.graph.register_multi_grad_hook(outputs, self._pre_backward, mode="any")

    def _gather_for_forward(self, ctx: RootContext[FSDPState]) -> None:
        """Issue the unit's all-gather (unless prefetched), prefetch the next unit's (overlapping
        it with this compute), and wait for its own."""
        self.group.unshard()
        _unshard(self.forward_prefetch, ctx.neighbour(self, +1))
        self.group.pre_forward()

    def catch_up_forward(self) -> None:
        """This rank's forward skipped the unit: the collectives of its forward (and of the
        prefetch it issues), without compute ([Note: ranks whose graphs differ])."""
        ctx = self.ctx
        assert ctx is not None
        self._gather_for_forward(ctx)
        self.group.post_forward(reshard=False)
        ctx.sequence.defer(self, self._reshards_after_forward(ctx, torch.is_grad_enabled()))
        ctx.shared.stats.forward_catch_ups += 1

    def _reshards_after_forward(self, ctx: RootContext[FSDPState], grad_enabled: bool) -> bool:
        if self.is_root:
            # Kept into backward, as FSDP2's None does; but freed after a forward without
            # gradients, whose unsharded copy an optimizer step would otherwise leave stale.
            return not grad_enabled
        # The unit that runs forward last is the first to run backward: freeing it would only
        # make backward gather it straight back (torchtitan sets this by hand).
        last = ctx.order_recorded and ctx.last is self
        return self.reshard_after_forward is not False and not (last and grad_enabled)

    # -- backward ------------------------------------------------------------------------------

    def _pre_backward(self, grad: torch.Tensor) -> None:
        ctx = self.ctx
        assert ctx is not None
        ctx.start_backward(self)
        ctx.sequence.before_backward_of(self, root=self.is_root)
        self.group.pre_backward()
        # The root's backward (the loss and whatever it computes after its last child) comes
        # first; the unit that ran forward last is next, so its all-gather overlaps the root's.
        if self.is_root and ctx.order_recorded and ctx.last is not self:
            prev: FSDPState | None = ctx.last
        else:
            prev = ctx.neighbour(self, -1)
        # prefetch the units whose backward comes next
        _unshard(self.backward_prefetch, prev, backward=True)

    def seen(self, *, runs: bool) -> Seen:
        """Inside a backward: whether it runs this unit's backward (known to, if ``runs``), and
        whether that ends with its routed inputs' backward (how many of them are left to run)."""
        routed = [node for node in self._routed_nodes if will_run(node)]
        self._routed_left = len(routed)
        self.reduce_once = True  # unless the agreement says every rank runs it as often
        self.reduce_late = False
        runs = runs or any(will_run(node) for node in self._output_nodes)
        return Seen(runs=runs, routed=len(routed))

    def routed_backward_done(self) -> None:
        """A forward's routed inputs got their gradients: a pass of the unit's backward is done.
        It reduces after each pass, as FSDP2, where every rank runs it as often; else once, when
        every pass is done (a unit run twice on one rank and once on another)."""
        self._routed_left -= 1
        if self.reduce_late:
            return
        if self._routed_left <= 0 or not self.reduce_once:
            self.group.post_backward()

    def catch_up_backward(self, *, reduce: bool) -> None:
        """This rank's backward skips the unit that another's runs: the collectives of its
        pre-backward (and prefetch), and, if ``reduce``, its reduction of zeros (else at the end
        of backward)."""
        ctx = self.ctx
        assert ctx is not None
        self.group.pre_backward()
        _unshard(self.backward_prefetch, ctx.neighbour(self, -1), backward=True)
        if reduce:
            self.group.post_backward()

    # -- state dict ----------------------------------------------------------------------------

    def _state_dict_post_hook(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        state_dict_post_hook(self.group.named_parameters_in(module, prefix), state_dict)

    def _hold_sharded(self, *args: Any) -> None:
        """Before a state dict is made or loaded: free an unsharded copy kept from a forward
        (as FSDP2 does), so that the state dict holds the shards, never a copy an optimizer
        step has left stale, and a load writes into the shards."""
        if self.group.training_state is TrainingState.IDLE:
            self.group.reshard()

    def _load_state_dict_post_hook(self, module: nn.Module, incompatible_keys: Any) -> None:
        """After a load: parameters assigned in place of the unit's (``assign=True``) are
        taken back ([Note: adopting changed parameters]); loads into the parameters themselves
        (``copy_``) need nothing."""
        adopt(self.group)


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors of ``tree`` cast to ``dtype``."""
    return tree_map(
        lambda x: x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x, tree
    )


def _unshard(
    chosen: list[FSDPState] | None, neighbour: FSDPState | None, *, backward: bool = False
) -> None:
    """Issue the all-gathers of the units the user chose to prefetch, else of the recorded
    neighbour; only units idle between forward and backward (not one mid-backward), and in
    ``backward`` only units whose backward needs their parameters."""
    for state in chosen if chosen is not None else [neighbour]:
        if state is None or state.group.training_state is not TrainingState.IDLE:
            continue
        if not backward or state.group.knobs.unshard_in_backward:
            state.group.unshard()


def _check_plans_agree(plans: list[ShardPlan], group: FSDPParamGroup) -> None:
    """Before the first all-gather, check every rank planned the same buckets (``plans``, as
    the root names them); a rank that disagrees would otherwise hang or corrupt the
    collectives. One all-gather of a digest over ``group``'s shard group (each unit's, once per
    group); only when they differ are the plans themselves gathered, to name the first
    difference."""
    h = hashlib.sha256()
    for plan in plans:
        h.update(plan.digest().encode())
    local = int.from_bytes(h.digest()[:7], "little")
    mesh = group.mesh_info
    gathered = torch.zeros(mesh.shard_size, dtype=torch.int64, device=group.device)
    mine = torch.tensor([local], dtype=torch.int64, device=group.device)
    all_gather(gathered, mine, mesh.shard_group, RuntimeStats(), async_op=False)
    if len(set(gathered.tolist())) == 1:
        return
    described: list[Any] = [None] * mesh.shard_size
    dist.all_gather_object(described, [_describe(p) for p in plans], group=mesh.shard_group)
    raise RuntimeError(
        f"raggedfsdp: ranks planned different buckets: {_first_difference(described)}; every "
        f"rank must wrap the same model with the same policy"
    )


def _describe(plan: ShardPlan) -> dict[str, Any]:
    """What the runtime reads of a plan, as plain values (to send to other ranks)."""
    return {
        "name": plan.name,
        "world_size": plan.world_size,
        "shard_numel": plan.shard_numel,
        "alignment": plan.alignment,
        "dtype": str(plan.dtype),
        "entries": [(e.name, e.shape, e.offset, e.unit_numel) for e in plan.entries.values()],
    }


def _first_difference(per_rank: list[list[dict[str, Any]]]) -> str:
    """The first bucket and field in which some rank's plans differ from rank 0's."""
    reference = per_rank[0]
    for rank, plans in enumerate(per_rank[1:], start=1):
        if len(plans) != len(reference):
            return f"rank 0 has {len(reference)} buckets, rank {rank} has {len(plans)}"
        for ours, theirs in zip(reference, plans, strict=True):
            for key in ours:
                if ours[key] == theirs[key]:
                    continue
                if key == "entries":
                    for a, b in zip(ours[key], theirs[key], strict=False):
                        if a != b:
                            return (
                                f"bucket {ours['name']!r}: parameter (name, shape, offset, "
                                f"unit) is {a} on rank 0 and {b} on rank {rank}"
                            )
                    counts = len(ours[key]), len(theirs[key])
                    return (
                        f"bucket {ours['name']!r}: {counts[0]} parameters on rank 0, "
                        f"{counts[1]} on rank {rank}"
                    )
                return (
                    f"bucket {ours['name']!r}: {key} is {ours[key]!r} on rank 0 and "
                    f"{theirs[key]!r} on rank {rank}"
                )
    return "the plans' digests differ"
