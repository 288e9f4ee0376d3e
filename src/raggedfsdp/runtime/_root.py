"""What the units under one root share: their resources, the order they run in, the phase.

The root's :class:`RootContext` begins each backward with the agreement over the data-parallel
ranks ([Note: ranks whose graphs differ] in ``_sequence.py``) and ends it.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

import torch
from torch import nn

from ._sequence import Unit as SequenceUnit
from ._sequence import UnitSequence, module_order
from ._shared import SharedResources
from ._state_machine import RootPhase, check_state
from ._usage import Seen, agree, order_digest

__all__ = ["RootContext"]


class Unit(SequenceUnit, Protocol):
    """What the root's context asks of a unit (its :class:`~._hooks.U`)."""

    module: nn.Module
    reduce_once: bool
    reduce_late: bool

    def seen(self, *, runs: bool) -> Seen:
        """Inside a backward: what it does with this unit."""
        ...

    def forget_graph(self) -> None:
        """The iteration's backward is over: let its autograd nodes go."""
        ...


U = TypeVar("U", bound=Unit)


class RootContext(Generic[U]):
    """What all units under one root share: their resources, the unit order and the phase."""

    def __init__(self, root: U, states: list[U]) -> None:
        self.root = root
        self.states = states
        self.shared = SharedResources.new(root.group.device)
        self.phase = RootPhase.FIRST_FORWARD
        #: units in the order their forwards ran in the first iteration
        self.forward_order: list[U] = []
        #: the order every rank follows ([Note: ranks whose graphs differ])
        self.sequence = UnitSequence(module_order(root.module, states), self._agree_on_revisit)
        #: the first backward's agreement is to tell whether every rank ran the units in the same
        #: order, which the sequence then follows from the next step
        self._order_agreed = False
        self._adopt = False
        #: whether the root's forward is under way (a unit's modules called outside it are
        #: each a forward of their own)
        self.in_forward = False

    @property
    def never_ran(self) -> bool:
        """No forward has started under this root (a unit unsharded by hand before the first
        forward is its own root until an outer one's first forward takes it in)."""
        return self.phase is RootPhase.FIRST_FORWARD and not self.in_forward

    @property
    def order_recorded(self) -> bool:
        return self.phase is not RootPhase.FIRST_FORWARD

    def neighbour(self, state: U, step: int) -> U | None:
        """The unit ``step`` places after ``state`` in the agreed order, once the first forward
        is over."""
        if not self.order_recorded:
            return None
        order = self.sequence.order
        i = self.sequence.position(state) + step
        return order[i] if 0 <= i < len(order) else None

    @property
    def last(self) -> U:
        """The unit the agreed order runs last (whose backward comes first after the root's)."""
        return self.sequence.order[-1]

    def start_backward(self, first: U) -> None:
        """The first gradient reached a unit (``first``): queue the end-of-backward callback and
        agree with the other ranks, once."""
        if self.phase is RootPhase.BACKWARD:
            return
        check_state(self.phase, RootPhase.READY, unit=self.root.group.label)
        self.phase = RootPhase.BACKWARD
        torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
        self._agree(first)

    def _agree(self, first: U) -> None:
        """Inside the first pre-backward: agree with the other ranks on what their backwards run
        and use, and plan this rank's catch-ups ([Note: ranks whose graphs differ])."""
        order = self.sequence.order
        for state in order:
            state.group.usage.begin_backward()
        # (the engine does not count the node of a tensor backward() was called on as one it
        # will run: the unit whose output gradient arrived runs)
        seen = [state.seen(runs=state is first) for state in order]
        if self.root.group.knobs.static_graph:  # every rank runs and uses what this one does
            self.sequence.catch_up_nothing()
            for state in order:
                state.reduce_once = state.reduce_late = False
            self._adopt = not self._order_agreed and len(self.forward_order) == len(order)
            self._order_agreed = True
            return
        digest = None
        if not self._order_agreed:
            complete = len(self.forward_order) == len(order)
            index = {id(state): i for i, state in enumerate(order)}
            positions = [index[id(state)] for state in self.forward_order] if complete else None
            digest = order_digest(positions)
        agreed = agree([state.group for state in order], seen, digest, self.shared.stats)
        if agreed.revisit:
            raise _revisit_error(None)
        skipped = [anywhere and not s.runs for anywhere, s in zip(agreed.runs, seen, strict=True)]
        self.sequence.plan_backward(skipped, agreed.reduces_early)
        for state, s, differ, early in zip(
            order, seen, agreed.passes_differ, agreed.reduces_early, strict=True
        ):
            state.reduce_once = differ
            # some rank runs it with no input needing a gradient: every rank reduces at the end
            state.reduce_late = s.routed > 0 and not early
        self.shared.stats.backward_catch_ups += sum(skipped)
        if digest is not None:
            self._order_agreed = True
            self._adopt = agreed.same_order

    def _agree_on_revisit(self, unit: U) -> None:
        """Inside the root's forward, which runs ``unit`` again after others and has caught up
        the rest of the order: every rank does too, or the step stops here on every rank
        (the others at the start of their backward), before any parameter has changed."""
        order = self.sequence.order
        nothing = [Seen(runs=False, routed=0)] * len(order)
        digest = None if self._order_agreed else b""  # the shape of the backward's message
        position = self.sequence.position(unit)
        groups = [state.group for state in order]
        if not agree(groups, nothing, digest, self.shared.stats, revisit=position).revisit_alike:
            raise _revisit_error(unit.group.label)

    def reset(self) -> None:
        """After an interrupted iteration (FSDPModule.reset_iter_state): nothing in flight,
        ready for a forward; the unit order, once recorded, is kept."""
        self.shared.reduce_queue.clear()
        self.shared.pool.clear()
        self.phase = RootPhase.READY if self.forward_order else RootPhase.FIRST_FORWARD
        self.sequence.catch_up_nothing()

    def finish_backward(self) -> None:
        """End-of-backward callback (queued on the autograd engine)."""
        self.sequence.end_backward()
        self.shared.reduce_queue.drain()
        for state in self.states:
            if state.group.reduces_now():
                state.group.usage.settle()
            state.forget_graph()
            state.group.finish_iteration()
        if self._adopt:  # every rank ran the units in one order: follow it from now on
            self.sequence.adopt(self.forward_order)
            self._adopt = False
        self.shared.pool.clear()  # nothing pooled through forward, where the memory peak is
        self.phase = RootPhase.READY
        self.shared.non_finite.end_of_backward()  # compressed gradients: one host sync


def _revisit_error(label: str | None) -> RuntimeError:
    """The same error on every rank, when some ranks' forward ran a unit again after others and
    some did not run it again there (``label``: the unit this rank ran again)."""
    here = f"this rank ran {label} again" if label else "this rank did not"
    return RuntimeError(
        f"raggedfsdp: the ranks' forwards ran their units in different orders ({here}): some "
        f"ran a unit again after other units, where others did not run it again; a rank may "
        f"skip units and run one again straight after itself, but a unit run again later must "
        f"run again at the same point on every rank (or be one unit with what it follows). "
        f"No parameter has changed"
    )
