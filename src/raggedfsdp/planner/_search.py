"""The structure-aware planner's search: one flat buffer per bucket, equal shards, no unit split.

Given a bucket's parameters (each with a numel and a unit), a world size ``W`` and an alignment
``a`` (elements), :func:`search` picks a shard size ``S`` and an offset per parameter so that
parameters do not overlap and lie in ``[0, W*S)``, every rank boundary ``k*S`` strictly inside a
parameter is one of its cut points, offsets and ``S`` are multiples of ``a``, and the result is
deterministic. Why the search is shaped as it is: the note at :func:`search`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from ._placement import (
    Item,
    ItemType,
    crossing_offset,
    fits,
    item_types,
    lower_bound_of,
    min_total,
    next_valid_size,
)
from ._residues import Residues
from ._window import NEVER, Work, window_beam

__all__ = ["search"]

# Exact DP while the number of type-count states is at most this; beam search beyond.
_EXACT_STATES = 4096
_BEAM_WIDTH = 128
# Candidate sizes tried one by one before the search steps geometrically (see search).
_CONSECUTIVE_CANDIDATES = 32
# Buckets whose DP costs at most this (states times types) get it at every size, as always;
# those up to _MEDIUM_DP get it at a few sizes, within the work budget.
_DP_BUDGET = 50_000
_MEDIUM_DP = 400_000
# The residue test stops being tried after this many consecutive sizes it did not rule out.
_RESIDUE_MISSES = 8
# Window beams (see window_beam): widths, deepened in turn; both top-up orders.
_WINDOW_WIDTHS = (1, 4, 16, 64)
_BALANCED = (False, True)
# The work budget of one search's beams, in type checks (about 0.4 us each).
_WORK_BUDGET = 300_000


def _best_type_order(
    types: Sequence[ItemType], s: int, a: int, cap: int, slack: int, work: Work | None = None
) -> list[int] | None:
    """Order of types (indices, with repeats) whose earliest placement fits, or ``None``.

    Dynamic program over how many of each type are placed; a state keeps the smallest cursor
    reachable (smaller dominates: see the module note), and states whose waste exceeds the
    slack are dropped. Exact while the state space is small; otherwise each layer keeps the
    ``_BEAM_WIDTH`` states with the smallest cursor (ties: fewer of the first types placed).
    A state is an integer, the counts in mixed radix, the first type most significant (so
    integer order is the order of the count tuples). ``work``: charged one step per transition.
    """
    counts = [t.count for t in types]
    exact = math.prod(c + 1 for c in counts) <= _EXACT_STATES
    strides = [0] * len(types)
    stride = 1
    for j in range(len(types) - 1, -1, -1):
        strides[j] = stride
        stride *= counts[j] + 1
    spec = [(j, t.numel, t.unit, t.lcm, t.size, strides[j], counts[j]) for j, t in enumerate(types)]
    # state -> (cursor, aligned sizes placed, parent state, type placed last)
    layer: dict[int, tuple[int, int, int, int]] = {0: (0, 0, -1, -1)}
    history = [layer]
    for _ in range(sum(counts)):
        nxt: dict[int, tuple[int, int, int, int]] = {}
        for state, (cursor, placed, _, _) in layer.items():
            window_end = (cursor // s + 1) * s
            for j, numel, unit, lcm, size, step, count in spec:
                if (state // step) % (count + 1) == count:
                    continue
                if cursor + numel <= window_end:
                    if cursor + numel > cap:
                        continue
                    offset = cursor
                else:
                    offset = crossing_offset(cursor, numel, unit, lcm, s, cap)
                    if offset is None:
                        continue
                new_cursor = -(-(offset + numel) // a) * a
                if new_cursor - placed - size > slack:
                    continue  # its waste already exceeds the slack
                child = state + step
                # Strict '<' keeps the first path found, which explores types in model order.
                old = nxt.get(child)
                if old is None or new_cursor < old[0]:
                    nxt[child] = (new_cursor, placed + size, state, j)
        if work is not None:
            work.left -= len(layer) * len(spec)
        if not nxt:
            return None
        if not exact and len(nxt) > _BEAM_WIDTH:
            kept = heapq.nsmallest(_BEAM_WIDTH, nxt.items(), key=lambda kv: (kv[1][0], kv[0]))
            nxt = dict(kept)
        layer = nxt
        history.append(layer)
    return _trace_back(history, stride - 1)  # the state with every count at its maximum


def _trace_back(history: Sequence[dict[int, tuple[int, int, int, int]]], state: int) -> list[int]:
    """The type order that reaches ``state`` in the DP's last layer, from its parent links."""
    order: list[int] = []
    for layer in reversed(history[1:]):
        _, _, parent, j = layer[state]
        order.append(j)
        state = parent
    return order[::-1]


class _Bucket:
    """A bucket's parameters as the search sees them: nonempty items, their types, residues."""

    def __init__(self, items: Sequence[Item], a: int) -> None:
        self.items = list(items)
        self.a = a
        self.types, self.type_of = item_types(self.items, a)
        self.min_total = min_total(self.types)
        # Every aligned size and lcm is a multiple of this (see Residues.gcd_waste).
        self.gcd = 0
        for t in self.types:
            self.gcd = math.gcd(self.gcd, math.gcd(t.size, t.lcm))
        self._residues: Residues | None = None  # built when first needed
        # Large units first (they constrain S most), then large tensors first; sorting is
        # stable, so ties keep model order.
        by_unit = sorted(self.items, key=lambda it: (-it.unit, -it.numel))
        self.orders = [self.items, by_unit, sorted(self.items, key=lambda it: -it.numel)]
        index = {id(it): j for it, j in zip(self.items, self.type_of, strict=True)}
        # Type preferences of the window beams: first appearance in model order and in the
        # large-units-first order; each with both top-up orders. A variant is
        # ``(number, preferences, balanced)``; the one that last fitted goes first.
        prefs_list: list[list[int]] = []
        for base in (self.type_of, [index[id(it)] for it in by_unit]):
            prefs = list(dict.fromkeys(base))
            if prefs not in prefs_list:
                prefs_list.append(prefs)
        self.variants: list[tuple[int, list[int], bool]] = []
        for balanced in _BALANCED:
            for prefs in prefs_list:
                self.variants.append((len(self.variants), prefs, balanced))
        self.work = Work(_WORK_BUDGET)
        # Consecutive sizes the residue test did not rule out (it stops being tried after
        # _RESIDUE_MISSES of them: the bucket's residues prove nothing near its bound).
        self.residue_misses = 0
        states = math.prod(t.count + 1 for t in self.types)
        width = states if states <= _EXACT_STATES else _BEAM_WIDTH * len(self.items)
        dp_cost = width * len(self.types)
        #: Small enough for the type-count DP at every candidate size.
        self.small = dp_cost <= _DP_BUDGET
        #: Small enough for the DP (its beam) at a few sizes, within the work budget.
        self.medium = dp_cost <= _MEDIUM_DP

    @property
    def residues(self) -> Residues:
        if self._residues is None:
            self._residues = Residues(self.types)
        return self._residues

    def members(self) -> list[list[Item]]:
        out: list[list[Item]] = [[] for _ in self.types]
        for it, j in zip(self.items, self.type_of, strict=True):
            out[j].append(it)
        return out

    def expand(self, type_order: Sequence[int]) -> list[Item]:
        """Items for a type order, parameters of one type in model order."""
        queues = [iter(m) for m in self.members()]
        return [next(queues[j]) for j in type_order]

    def cheap_order_at(self, s: int, world_size: int) -> list[Item] | bool | None:
        """The cheap part of trying size ``s``: ``False`` when the residues prove it
        infeasible, an order when model order, large units first or large tensors first fits
        (in that order: ties go to model order), else ``None`` (unknown)."""
        a = self.a
        cap = world_size * s
        slack = cap - self.min_total
        if self.gcd and (world_size - 1) * (s % self.gcd) > slack:
            return False  # see Residues.gcd_waste
        for order in self.orders:
            if fits(order, s, a, cap, slack):
                return list(order)
        if self.residue_misses < _RESIDUE_MISSES:
            if self.residues.forced_waste(s, world_size, slack) > slack:
                self.residue_misses = 0
                return False
            self.residue_misses += 1
        return None

    def searched_order_at(
        self, s: int, world_size: int, work: Work | None = None
    ) -> list[Item] | None:
        """The type-count DP (charging ``work``, if given, for its transitions)."""
        cap = world_size * s
        type_order = _best_type_order(self.types, s, self.a, cap, cap - self.min_total, work)
        return None if type_order is None else self.expand(type_order)

    def beam_order_at(
        self, s: int, world_size: int, width: int, done: set[tuple[int, int]], first: bool = False
    ) -> list[Item] | None:
        """Window beams of ``width`` at size ``s``, one per variant (preference order and
        top-up), skipping the variants in ``done`` (``(variant, width)`` pairs already tried,
        or the variant's ``-1`` once a beam of it dropped nothing: wider ones would search the
        same states). The variant that fits is tried first from then on. ``first``: the first
        variant only."""
        cap = world_size * s
        slack = cap - self.min_total
        for variant in list(self.variants[:1] if first else self.variants):
            key, prefs, balanced = variant
            if (key, width) in done or (key, -1) in done:
                continue
            done.add((key, width))
            type_order, dropped = window_beam(
                self.types, prefs, s, self.a, cap, slack, width, self.work, balanced
            )
            if type_order is not None:
                order = self.expand(type_order)
                if fits(order, s, self.a, cap, slack):  # the beam's arithmetic, rechecked
                    self.variants.remove(variant)
                    self.variants.insert(0, variant)
                    return order
            if not dropped:
                done.add((key, -1))
            if self.work.left < 0:
                return None
        return None


# [Note: why the search is shaped this way]
#
# - *Fixed order is easy.* For a fixed order of parameters, placing each at its earliest valid
#   offset is optimal: the earliest start gives the earliest end, and the set of valid offsets for
#   the next parameter only shrinks as the cursor grows (see :func:`earliest_offset`).
# - *Per-parameter necessary conditions.* A parameter of ``n`` elements and unit ``u`` that crosses
#   two boundaries forces ``S % u == 0``; one that crosses one boundary needs a cut point ``t`` (a
#   multiple of ``lcm(u, a)``) with ``n - S <= t <= S``. Together these say: the parameter is
#   placeable iff ``S % u == 0`` or ``S >= c`` where ``c`` is its *crossing size* (see
#   :func:`crossing_size`). With ``W*S >= total`` and a bin-packing bound for the parameters no
#   boundary may cut (whole units: a rank holds at most ``k`` of those larger than ``S / (k + 1)``,
#   :func:`packing_bound`) this gives a provable lower bound on ``S``
#   (:func:`shard_size_lower_bound`) and the only candidate sizes worth trying.
# - *Feasibility is not monotone in S*, so sizes are tried in increasing order, not bisected.
# - *Parameters of one shape are one type with a count.* Everything below works on the types
#   ``(numel, unit)`` of a bucket, not on its tensors: a layer of 256 separate experts has a dozen
#   types, and within a type parameters keep model order.
# - *Waste.* A placement's cursor is the aligned sizes placed so far plus the padding it left (its
#   *waste*). A plan fits iff its final waste is at most the *slack* ``W*S - min total``, so a
#   partial placement whose waste already exceeds the slack is dead; every search prunes on it.
# - *Residues prove sizes infeasible, cheaply.* Each rank boundary ``k*S`` falls between parameters
#   or inside one at a cut point, so the parameter there starts at ``k*S`` minus a multiple of its
#   ``lcm(unit, a)``, and its start is a sum of aligned sizes plus the waste so far. Modulo each
#   type's lcm those sums form a small set, so the waste each boundary forces can be accumulated
#   boundary by boundary with no order at all (:class:`Residues`). Near the bound, where the slack
#   is a few elements and the units are thousands, that rules out most candidate sizes before any
#   placement is tried. A size this proof rules out has no valid plan in any order, so skipping it
#   changes no result.
# - *Order matters.* Each size first gets the cheap orders: model order (ties go to model order),
#   large units first, large tensors first. For a small bucket (a dense layer) the exact dynamic
#   program over type counts follows -- how many of each type are placed, the smallest cursor per
#   state -- which becomes a beam search when the state space is large.
# - *Large buckets are searched rank by rank.* Placing tensors one at a time costs the DP a layer
#   per tensor, which would make a layer of hundreds of experts take seconds. Inside one rank the
#   order of the tensors that fit does not matter, only which ones and which tensor crosses the
#   rank's end; so :func:`window_beam` extends a beam of partial placements one rank at a time: a
#   few rare tensors (norms, a router, attention) chosen depth-first, the common ones (the experts)
#   topped up in closed form, then every type that could cross the boundary, the states of least
#   waste kept. All beams of one search share a deterministic work budget, spent by iterative
#   deepening on the undecided sizes below the first size that fits.
def search(items: Sequence[Item], world_size: int, a: int) -> tuple[int, list[Item]]:
    """Smallest shard size found feasible, and the order that achieves it.

    Candidates are exactly the sizes that meet every parameter's necessary condition, tried in
    increasing order. After ``_CONSECUTIVE_CANDIDATES`` failures the step grows geometrically,
    from 2^-14 of ``S`` and doubling every 4 failures: feasibility is not monotone, so this can
    skip a feasible size, but only large awkward buckets get that far, it stays close to the
    smallest feasible region, and it bounds planning time.

    Each size first gets the cheap tries (:meth:`_Bucket.cheap_order_at`: the residue proofs
    and the cheap orders). Small buckets then get the type-count DP, and the first size that
    fits is the answer, exactly as before. Large buckets share one work budget among their
    window beams: on the way up each size gets one narrow beam (while half the budget lasts)
    until one fits or a cheap order does; the sizes below that which nothing proved infeasible
    (*undecided*) then get iterative deepening -- every variant at each beam width in turn (and
    for medium buckets the DP after width 4), sizes from the bottom up, so the first that fits
    is the best at that width -- while the budget lasts. The budget counts steps, not time, so
    the plan is deterministic.
    """
    bucket = _Bucket([it for it in items if it.numel], a)
    lower = lower_bound_of(bucket.types, world_size, a)
    if lower == 0:
        return 0, list(items)
    best, unknown = _first_fit(bucket, world_size, lower)
    shard, order = _deepen(bucket, world_size, best, unknown)
    return shard, _with_empty(items, order)


_Undecided = list[tuple[int, set[tuple[int, int]]]]  # sizes, each with its beams already tried


def _first_fit(
    bucket: _Bucket, world_size: int, lower: int
) -> tuple[tuple[int, list[Item]], _Undecided]:
    """The way up from ``lower``: the first size the cheap tries, the DP (small buckets) or one
    narrow beam (large ones, while half the budget lasts) find feasible, and the sizes below it
    that nothing decided."""
    a = bucket.a
    s = lower
    tried = 0
    unknown: _Undecided = []
    skip = _Skip(world_size, bucket.min_total)
    while True:
        found = bucket.cheap_order_at(s, world_size)
        if found is None and bucket.small:
            found = bucket.searched_order_at(s, world_size)
        elif found is None:
            done: set[tuple[int, int]] = set()
            if bucket.work.left > _WORK_BUDGET // 2 and not skip.skips(s):
                found = skip.after(bucket, bucket.beam_order_at(s, world_size, 1, done, True))
            if found is None:
                unknown.append((s, done))
        if isinstance(found, list):
            return (s, found), unknown
        tried += 1
        step = a
        if tried >= _CONSECUTIVE_CANDIDATES:
            doublings = (tried - _CONSECUTIVE_CANDIDATES) // 4
            step = max(a, (s >> 14) << doublings)
        s = _next_candidate(s, step, bucket)


def _next_candidate(s: int, step: int, bucket: _Bucket) -> int:
    """The next size after ``s``: ``s + step``, or a multiple of a type's cut lcm before that.
    At a multiple of its lcm a parameter may span two boundaries, so feasible sizes cluster
    there (five 11-unit matrices on 8 ranks fit at 7 units and nowhere near the bound); a step
    that grew geometrically must not jump over them."""
    types, a = bucket.types, bucket.a
    nxt = next_valid_size(s + step, types, a)
    for t in types:
        if t.lcm > step:  # a denser lcm is no rarer than the step itself
            multiple = (s // t.lcm + 1) * t.lcm
            if multiple < nxt:
                nxt = min(nxt, next_valid_size(multiple, types, a))
    return nxt


def _deepen(
    bucket: _Bucket, world_size: int, best: tuple[int, list[Item]], unknown: _Undecided
) -> tuple[int, list[Item]]:
    """Iterative deepening over the undecided sizes below the best: every variant at each width
    in turn, sizes from the bottom up (the first that fits is the best at that width). Medium
    buckets get the type-count DP's beam after the narrow window beams."""
    levels: list[int] = list(_WINDOW_WIDTHS)
    if bucket.medium:
        levels.insert(_WINDOW_WIDTHS.index(4) + 1, 0)
    for width in levels:
        skip = _Skip(world_size, bucket.min_total)
        for size, done in unknown:
            if size >= best[0] or bucket.work.left < 0:
                break
            if width == 0:
                order = bucket.searched_order_at(size, world_size, bucket.work)
            elif skip.skips(size):
                continue
            else:
                order = skip.after(bucket, bucket.beam_order_at(size, world_size, width, done))
            if order is not None:
                best = (size, order)
                break
    return best


class _Skip:
    """Beams at sizes close together see nearly the same choices: after a beam failed because
    it had to drop states wasting ``needed`` (over its slack), sizes whose slack is still below
    that are skipped (they stay undecided)."""

    def __init__(self, world_size: int, min_total: int) -> None:
        self.world_size = world_size
        self.min_total = min_total
        self.needed = 0

    def skips(self, s: int) -> bool:
        return s * self.world_size - self.min_total < self.needed

    def after(self, bucket: _Bucket, order: list[Item] | None) -> list[Item] | None:
        self.needed = 0 if order is not None or bucket.work.needed == NEVER else bucket.work.needed
        bucket.work.needed = NEVER
        return order


def _with_empty(items: Sequence[Item], order: list[Item]) -> list[Item]:
    """Put zero-element parameters back (at the front: they occupy nothing)."""
    return [it for it in items if not it.numel] + order
