"""What torch's ``fully_shard.state(module)`` returns for a raggedfsdp module.

torch's pipelining reduces a stage's gradients through FSDP2's state; :class:`TorchFacingState`
answers the names it reads and nothing else of FSDP2's ([Note: torch's pipelining]). It is an
instance of FSDP2's ``FSDPState`` class, registered where torch's ``_get_module_state`` looks, so
torch's own traversals (``_get_managed_modules``, which a torch ``fully_shard`` or ``replicate``
of a parent runs) take a raggedfsdp unit's modules as managed by a nested ``fully_shard``, as
they take FSDP2's.
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable.contract import STATE_KEY
from torch.distributed._composable_state import _insert_module_state
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState as TorchFSDPState

from ._hooks import FSDPState
from ._param_group import FSDPParamGroup
from ._root import RootContext
from ._state_machine import TrainingState, check_state

__all__ = ["TorchFacingState", "expose_to_torch", "finalize_backward", "torch_facing_state"]

# [Note: torch's pipelining]
# torch's pipelining takes any torch ``FSDPModule`` for FSDP2's. Each micro-batch's backward runs
# with gradient sync and resharding after backward off (``backward_maybe_with_nosync``), so every
# unit holds the sum of its micro-batches' unsharded gradients; once all have run
# (``PipelineStage.perform_reduce_grad``, torch 2.13 and 2.14.1) it sets
# ``set_is_last_backward(True)``, ``set_reshard_after_backward(True)`` and
# ``set_requires_gradient_sync(True)`` on the stage's module, calls ``post_backward()`` on each
# ``_fsdp_param_groups`` entry of each state in ``fully_shard.state(module)._state_ctx.all_states``,
# then ``_root_post_backward_final_callback()``. Here a unit's ``post_backward()`` issues the
# reduce-scatter of what it accumulated -- every unit of the stage, once per step: the ranks of a
# stage hold the same units, so they issue the same collectives in the same order -- and the final
# callback is the end of a raggedfsdp backward (reductions waited for, the usage agreement, every
# unit idle and sharded). ``fully_shard`` registers it on each module of a unit under torch's own
# key (:func:`expose_to_torch`), so torch's ``fully_shard.state`` finds it with torch unchanged;
# ``rf.fully_shard.state`` is the same lookup. torch 2.15's pipelining asks the same through
# FSDP2's public ``set_manual_backward_finalization`` and ``finalize_backward``:
# :func:`finalize_backward` is those steps.

# The function torch's ``contract`` keys a module's composable states by: FSDP2's undecorated
# ``fully_shard`` (``contract`` wraps it with functools.wraps).
_TORCH_KEY = torch_fully_shard.__wrapped__  # type: ignore[attr-defined]


class TorchFacingState(TorchFSDPState):
    """One raggedfsdp unit as torch's pipelining reads an FSDP2 state.

    A subclass of FSDP2's ``FSDPState`` only so that torch's ``isinstance`` checks
    (``_get_module_fsdp_state``) find it; FSDP2's ``__init__`` is not run and none of its
    methods is meant to be called on it: the names below are all it answers."""

    def __init__(self, state: FSDPState) -> None:  # FSDP2's __init__ is not run
        self._state = state

    @property
    def _state_ctx(self) -> _RootFacingContext:
        """The states of every unit under this unit's root (this unit the root when no forward
        has run yet, as FSDP2's lazy init makes it)."""
        return _RootFacingContext(self._state.ctx or self._state.lazy_init())

    @property
    def _fsdp_param_groups(self) -> list[_GroupFacingPostBackward]:
        return [_GroupFacingPostBackward(self._state.group)]

    def _root_post_backward_final_callback(self) -> None:
        """The end of the step's backward: every reduction finished and attached as the
        sharded gradients, parameters no rank used left without one, every unit idle."""
        self._state_ctx.ctx.finish_backward()


class _RootFacingContext:
    def __init__(self, ctx: RootContext[FSDPState]) -> None:
        self.ctx = ctx

    @property
    def all_states(self) -> list[TorchFacingState]:
        """Every unit under the root, in the root's order (the same on every rank)."""
        return [TorchFacingState(state) for state in self.ctx.states]


class _GroupFacingPostBackward:
    def __init__(self, group: FSDPParamGroup) -> None:
        self._group = group

    def post_backward(self) -> None:
        """The unit's backward, spread over the step's micro-batches, is over: reduce what they
        accumulated, as the post-backward of a backward with sync does (called between
        backwards, when the unit is idle)."""
        group = self._group
        check_state(group.training_state, TrainingState.IDLE, unit=group.label)
        group.training_state = TrainingState.PRE_BACKWARD
        group.post_backward()


def finalize_backward(root: FSDPState) -> None:
    """End a backward spread over micro-batches under ``root`` (a root unit): each unit reduces
    what it accumulated (under the sync and resharding now set), then the root's end of
    backward ([Note: torch's pipelining])."""
    ctx = root.ctx
    assert ctx is not None and ctx.root is root, "finalize_backward needs a root after forward"
    for state in ctx.states:
        _GroupFacingPostBackward(state.group).post_backward()
    ctx.finish_backward()


def expose_to_torch(state: FSDPState) -> None:
    """Make torch's ``fully_shard.state(module)`` return one :class:`TorchFacingState` of
    ``state`` for each of the unit's modules (one object per unit, as FSDP2 has one state per
    ``fully_shard`` call), and torch's ``_get_module_state`` find it too. The module's state
    registry holds it; torch's ``_get_module_state`` holds a weak reference."""
    facing = TorchFacingState(state)
    for module in state.modules:
        vars(module).setdefault(STATE_KEY, {})[_TORCH_KEY] = facing
        _insert_module_state(module, facing)


def torch_facing_state(module: nn.Module) -> TorchFacingState | None:
    """``fully_shard.state(module)``: what torch's own lookup finds for ``module`` (``None``
    for a module ``rf.fully_shard`` did not shard)."""
    found = vars(module).get(STATE_KEY, {}).get(_TORCH_KEY)
    return found if isinstance(found, TorchFacingState) else None
