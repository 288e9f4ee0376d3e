"""The order of a root's units that every rank follows, and where each rank is in it.

So that ranks whose graphs differ issue the same collectives: [Note: ranks whose graphs differ].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch import nn

__all__ = ["UnitSequence", "module_order"]


class Unit(Protocol):
    """What the sequence asks of a unit (its :class:`~._hooks.FSDPState`)."""

    modules: list[nn.Module]
    group: Any

    def catch_up_forward(self) -> None:
        """The unit's forward collectives on a rank that skipped it, without compute."""
        ...

    def catch_up_backward(self, *, reduce: bool) -> None:
        """The unit's pre-backward collectives (and, if ``reduce``, its reduction of zeros) on a
        rank whose backward skips it."""
        ...


def module_order(root: nn.Module, units: list[Unit]) -> list[Unit]:
    """``units`` in the order their first modules come in ``root.modules()``: the root first,
    each unit before the units inside it (the order forwards usually run them)."""
    index = {id(m): i for i, m in enumerate(root.modules())}
    return sorted(units, key=lambda unit: index[id(unit.modules[0])])


# [Note: ranks whose graphs differ]
# Collectives are matched by their order on a process group, so every rank must issue the same
# all-gathers and reduce-scatters in the same order, even where its forward skips units (a vision
# tower on a rank whose batch has no image, an expert no token reached). The ranks follow one
# order of the root's units: the modules' order at first, and from the first backward on the
# order the first forward ran them in, where every rank ran every unit in the same order (the
# agreement's digest tells). In a forward, a unit reached past others it skipped first does the
# skipped units' collectives ("catch-ups": gather and free, with the prefetches their forwards
# would have issued); the forward's end catches up the rest. A unit run again at once keeps its
# parameters (its reshard after forward waits for the next unit's forward), so running a unit
# twice costs no collective another rank lacks, and reduces once after its last backward pass
# where ranks run it a different number of times. At the start of backward one small all-reduce
# (``_usage.py``) tells each rank which units any rank's backward runs and which reduce when
# their backward ends (their inputs need gradients) rather than at the end of backward; a rank
# whose backward skips a unit does its pre-backward collectives and a reduction of zeros where
# the others do theirs: before the next unit (in reverse order) that its backward runs, else at
# the end. A unit some rank runs with no input needing a gradient reduces at the end on every
# rank. A unit run again after others (its position behind the cursor) is agreed on: the rank
# catches up the rest of the order, as a forward's end does, and sends the agreement's message
# with the unit's position, where every other rank either runs it again too (they go on, from
# that position) or is starting its backward (every rank raises the same error).
class UnitSequence:
    """The agreed order of a root's units, and where this rank's forward and backward are in
    it."""

    def __init__(self, order: list[Unit], agree_on_revisit: Callable[[Unit], None]) -> None:
        self.order = order
        #: inside a forward that runs ``unit`` again after others, once the rest of the order is
        #: caught up: agree with the other ranks that each does, or raise on every rank
        self._agree_on_revisit = agree_on_revisit
        self._check_revisits = False
        self._position = {id(unit): i for i, unit in enumerate(order)}
        self._cursor = 0  # the last position this forward reached
        #: the unit whose reshard after forward waits for the next unit's forward, and whether
        #: it reshards then
        self._deferred: tuple[Unit, bool] | None = None
        #: positions whose backward this rank skips and catches up, with whether they reduce then
        self._to_catch_up: dict[int, bool] = {}

    def adopt(self, order: list[Unit]) -> None:
        """Follow ``order`` (the same units) from now on, between steps; every rank adopts it
        at the same step."""
        assert sorted(map(id, order)) == sorted(map(id, self.order))
        self.order = order
        self._position = {id(unit): i for i, unit in enumerate(order)}

    def position(self, unit: Unit) -> int:
        return self._position[id(unit)]

    # -- forward -------------------------------------------------------------------------------

    def begin_forward(self, *, check_revisits: bool) -> None:
        """The root's forward starts (the root is first in the order); ``check_revisits``: a
        unit run again after others is agreed on (where the others may not run it again)."""
        self._cursor = 0
        self._check_revisits = check_revisits
        self._deferred = None

    def arrive(self, unit: Unit) -> None:
        """``unit``'s forward starts inside the root's: catch up the units it passed."""
        if self._deferred is not None and self._deferred[0] is unit:
            self._deferred = None  # run again at once: it keeps its parameters
            return
        self._flush()
        here = self.position(unit)
        if here <= self._cursor and self._check_revisits:
            self._catch_up_forward(len(self.order))  # every rank is then past the last unit
            self._agree_on_revisit(unit)
            self._cursor = here  # every rank runs it again: from here on, as from the start
        self._catch_up_forward(here)
        self._cursor = max(self._cursor, here)

    def defer(self, unit: Unit, reshard: bool) -> None:
        """``unit``'s forward ended: reshard it (if ``reshard``) when the next unit starts."""
        self._flush()
        self._deferred = (unit, reshard)

    def end_forward(self) -> None:
        """The root's forward ends: catch up the units after the last one reached."""
        self._flush()
        self._catch_up_forward(len(self.order))
        self._cursor = len(self.order)

    def _catch_up_forward(self, until: int) -> None:
        """The forward collectives of the units between the cursor and position ``until``."""
        for skipped in self.order[self._cursor + 1 : until]:
            skipped.catch_up_forward()
            self._flush()

    def _flush(self) -> None:
        if self._deferred is not None:
            unit, reshard = self._deferred
            self._deferred = None
            if reshard:
                unit.group.reshard_after_forward()

    # -- backward ------------------------------------------------------------------------------

    def catch_up_nothing(self) -> None:
        """This backward skips no unit another rank's runs (or is abandoned)."""
        self._to_catch_up = {}

    def plan_backward(self, skipped: list[bool], reduce_early: list[bool]) -> None:
        """Per unit in order: whether this rank's backward skips it while another's runs it, and
        whether the ranks that run it reduce when its backward ends (else at the end)."""
        self._to_catch_up = {
            i: early
            for i, (skip, early) in enumerate(zip(skipped, reduce_early, strict=True))
            if skip
        }

    def before_backward_of(self, unit: Unit, *, root: bool) -> None:
        """``unit``'s backward starts: catch up the skipped units after it in the order (none
        before the root's, which comes first)."""
        here = len(self.order) if root else self.position(unit)
        self._catch_up(lambda i: i > here)

    def end_backward(self) -> None:
        """Catch up the skipped units left, then finish each unit's backward (its reduction),
        in reverse order."""
        self._catch_up(lambda i: True)
        for unit in reversed(self.order):
            unit.group.post_backward()

    def _catch_up(self, due: Callable[[int], bool]) -> None:
        for i in sorted((i for i in self._to_catch_up if due(i)), reverse=True):
            self.order[i].catch_up_backward(reduce=self._to_catch_up.pop(i))
