"""The structure-aware planner: one flat buffer per bucket, equal shards, no unit split.

Given a bucket's parameters (each with a numel and a unit), a world size ``W`` and an alignment
``a`` (elements), the planner picks a shard size ``S`` and an offset per parameter so that

1. parameters do not overlap and lie in ``[0, W*S)``;
2. every rank boundary ``k*S`` strictly inside a parameter is one of its cut points;
3. offsets and ``S`` are multiples of ``a``;
4. the result is deterministic.

[Note: why the search is shaped this way]

- *Fixed order is easy.* For a fixed order of parameters, placing each at its earliest valid
  offset is optimal: the earliest start gives the earliest end, and the set of valid offsets for
  the next parameter only shrinks as the cursor grows (see :func:`_earliest_offset`).
- *Per-parameter necessary conditions.* A parameter of ``n`` elements and unit ``u`` that crosses
  two boundaries forces ``S % u == 0``; one that crosses one boundary needs a cut point ``t``
  (a multiple of ``lcm(u, a)``) with ``n - S <= t <= S``. Together these say: the parameter is
  placeable iff ``S % u == 0`` or ``S >= c`` where ``c`` is its *crossing size* (see
  :func:`_crossing_size`). With ``W*S >= total`` this gives a provable lower bound on ``S``
  (:func:`shard_size_lower_bound`) and the only candidate sizes worth trying.
- *Feasibility is not monotone in S*, so sizes are tried in increasing order, not bisected.
- *Order matters*: for each candidate size, try the model order first (ties go to model order),
  then an exact dynamic program over the multiset of parameter *types* ``(numel, unit)`` — repeated
  shapes collapse, so a Llama layer has 162 states — which becomes a beam search when the state
  space is large.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Item", "lower_bound", "place", "search", "shard_size_lower_bound"]

# Exact DP while the number of type-count states is at most this; beam search beyond.
_EXACT_STATES = 4096
_BEAM_WIDTH = 128
# Candidate sizes tried one by one before the search steps geometrically (see search).
_CONSECUTIVE_CANDIDATES = 32

# ---------------------------------------------------------------------------------------------
# Pure arithmetic of placement.


def _align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def _crossing_size(numel: int, unit: int, alignment: int) -> int:
    """Smallest ``S`` at which a parameter can be placed *without* ``S`` being a multiple of its
    unit: it must then cross at most one boundary, at a cut ``t`` (a multiple of
    ``L = lcm(unit, alignment)`` so the offset stays aligned) with ``numel - S <= t <= S``.
    The best ``t`` is the multiple of ``L`` nearest ``numel / 2``."""
    lcm = math.lcm(unit, alignment)
    above = -(-numel // (2 * lcm)) * lcm  # smallest multiple of L >= numel/2 (needs S >= it)
    below = (numel // (2 * lcm)) * lcm  # largest multiple of L <= numel/2 (needs S >= n - it)
    return min(above, numel - below)


@dataclass(frozen=True)
class Item:
    """One parameter as the search sees it: its numel and unit (the name and shape ride along)."""

    name: str
    shape: tuple[int, ...]
    numel: int
    unit: int


def _min_total(items: Sequence[Item], alignment: int) -> int:
    """Fewest buffer elements any plan needs: every parameter but the last is followed by
    padding up to the alignment."""
    sizes = [it.numel for it in items if it.numel]
    if not sizes:
        return 0
    aligned = [_align_up(n, alignment) for n in sizes]
    return sum(aligned) - max(a - n for a, n in zip(aligned, sizes, strict=True))


def _next_valid_size(size: int, items: Sequence[Item], alignment: int) -> int:
    """Smallest ``S >= size`` (a multiple of the alignment) meeting every parameter's necessary
    condition ``S % unit == 0 or S >= crossing_size``. Walks the thresholds where the set of
    parameters that force divisibility shrinks; within one such interval the answer is the first
    multiple of the lcm of their units."""
    needs = [(_crossing_size(it.numel, it.unit, alignment), it.unit) for it in items if it.numel]
    s = _align_up(max(size, alignment), alignment)
    while True:
        forcing = [(c, u) for c, u in needs if c > s]
        if not forcing:
            return s
        modulus = alignment
        for _, u in forcing:
            modulus = math.lcm(modulus, u)
        candidate = _align_up(s, modulus)
        threshold = min(c for c, _ in forcing)  # the set changes here
        if candidate < threshold:
            return candidate
        s = _align_up(threshold, alignment)


def shard_size_lower_bound(
    numels: Sequence[int], units: Sequence[int], world_size: int, alignment: int = 1
) -> int:
    """A provable lower bound on the shard size ``S`` of any valid plan.

    ``S`` must hold all parameters with their alignment padding (``W*S >= min total``), and each
    parameter needs ``S % unit == 0`` or ``S >= crossing size`` (a parameter that spans two rank
    boundaries forces ``S`` to a multiple of its unit). So some shapes cannot reach low padding at
    large ``W`` whatever the planner does; this bound says so.
    """
    items = [Item(str(i), (n,), n, u) for i, (n, u) in enumerate(zip(numels, units, strict=True))]
    return lower_bound(items, world_size, alignment)


def lower_bound(items: Sequence[Item], world_size: int, alignment: int) -> int:
    total = _min_total(items, alignment)
    if total == 0:
        return 0
    return _next_valid_size(-(-total // world_size), items, alignment)


def _earliest_offset(cursor: int, numel: int, unit: int, s: int, a: int, cap: int) -> int | None:
    """Earliest valid offset ``>= cursor`` (aligned) for a parameter, or ``None``.

    Inside the current rank window it starts at the cursor if it fits. Otherwise it must cross
    the next boundary ``b`` at a cut: offset ``b - t`` with ``t`` a multiple of ``lcm(unit, a)``
    as large as the cursor allows. Crossing a second boundary is legal only when ``S % unit == 0``.
    If the next window fails too, all later ones do (each offers at least as much room), so two
    windows are all there is to check.
    """
    if numel == 0:
        return cursor if cursor <= cap else None
    window = cursor // s
    if cursor + numel <= (window + 1) * s:
        return cursor if cursor + numel <= cap else None
    lcm = math.lcm(unit, a)
    for boundary_rank in (window + 1, window + 2):
        boundary = boundary_rank * s
        lowest = cursor if boundary_rank == window + 1 else boundary - s
        offset = boundary - ((boundary - lowest) // lcm) * lcm
        if offset + numel > boundary + s and s % unit:
            continue
        return offset if offset + numel <= cap else None
    return None


def place(order: Iterable[Item], s: int, a: int, cap: int) -> list[int] | None:
    """Offsets of the earliest placement of ``order``, or ``None`` when it does not fit."""
    offsets: list[int] = []
    cursor = 0
    for it in order:
        offset = _earliest_offset(cursor, it.numel, it.unit, s, a, cap)
        if offset is None:
            return None
        offsets.append(offset)
        cursor = _align_up(offset + it.numel, a)
    return offsets


def _best_type_order(
    types: Sequence[tuple[int, int]], counts: Sequence[int], s: int, a: int, cap: int
) -> list[int] | None:
    """Order of types (indices, with repeats) whose earliest placement fits, or ``None``.

    Dynamic program over how many of each type are placed; a state keeps the smallest cursor
    reachable (smaller dominates: see the module note). Exact while the state space is small;
    otherwise each layer keeps the ``_BEAM_WIDTH`` states with the smallest cursor.
    """
    exact = math.prod(c + 1 for c in counts) <= _EXACT_STATES
    start = tuple(0 for _ in counts)
    layer: dict[tuple[int, ...], tuple[int, tuple[int, ...] | None, int]] = {start: (0, None, -1)}
    history = [layer]
    for _ in range(sum(counts)):
        nxt: dict[tuple[int, ...], tuple[int, tuple[int, ...] | None, int]] = {}
        for state, (cursor, _, _) in layer.items():
            for j, (numel, unit) in enumerate(types):
                if state[j] == counts[j]:
                    continue
                offset = _earliest_offset(cursor, numel, unit, s, a, cap)
                if offset is None:
                    continue
                new_cursor = _align_up(offset + numel, a)
                child = (*state[:j], state[j] + 1, *state[j + 1 :])
                # Strict '<' keeps the first path found, which explores types in model order.
                if child not in nxt or new_cursor < nxt[child][0]:
                    nxt[child] = (new_cursor, state, j)
        if not nxt:
            return None
        if not exact and len(nxt) > _BEAM_WIDTH:
            kept = sorted(nxt.items(), key=lambda kv: (kv[1][0], kv[0]))[:_BEAM_WIDTH]
            nxt = dict(kept)
        layer = nxt
        history.append(layer)
    order: list[int] = []
    state: tuple[int, ...] | None = tuple(counts)
    for layer in reversed(history[1:]):
        _, parent, j = layer[state]
        order.append(j)
        state = parent
    return order[::-1]


def _order_at(items: Sequence[Item], s: int, a: int, world_size: int) -> list[Item] | None:
    """A parameter order that fits at shard size ``s``: model order if it does (ties go to model
    order), else the type-count DP's, with parameters of one type kept in model order."""
    cap = world_size * s
    if place(items, s, a, cap) is not None:
        return list(items)
    # Cheap orders before the dynamic program: large units first (they constrain S most),
    # then large tensors first. Sorting is stable, so ties keep model order.
    for key in (lambda it: (-it.unit, -it.numel), lambda it: -it.numel):
        order = sorted(items, key=key)
        if place(order, s, a, cap) is not None:
            return order
    types: list[tuple[int, int]] = []
    members: dict[tuple[int, int], list[Item]] = {}
    for it in items:
        key = (it.numel, it.unit)
        if key not in members:
            types.append(key)
            members[key] = []
        members[key].append(it)
    counts = [len(members[t]) for t in types]
    type_order = _best_type_order(types, counts, s, a, cap)
    if type_order is None:
        return None
    queues = {t: iter(members[t]) for t in types}
    return [next(queues[types[j]]) for j in type_order]


def search(items: Sequence[Item], world_size: int, a: int) -> tuple[int, list[Item]]:
    """Smallest shard size found feasible, and the order that achieves it.

    Candidates are exactly the sizes that meet every parameter's necessary condition, tried in
    increasing order. After ``_CONSECUTIVE_CANDIDATES`` failures the step grows geometrically,
    from 2^-14 of ``S`` and doubling every 4 failures: feasibility is not monotone, so this can
    skip a feasible size, but only large awkward buckets get that far, it stays close to the
    smallest feasible region, and it bounds planning time.
    """
    nonempty = [it for it in items if it.numel]
    lower = lower_bound(nonempty, world_size, a)
    if lower == 0:
        return 0, list(items)
    s = lower
    tried = 0
    while True:
        order = _order_at(nonempty, s, a, world_size)
        if order is not None:
            return s, _with_empty(items, order)
        tried += 1
        step = a
        if tried >= _CONSECUTIVE_CANDIDATES:
            doublings = (tried - _CONSECUTIVE_CANDIDATES) // 4
            step = max(a, (s >> 14) << doublings)
        s = _next_valid_size(s + step, nonempty, a)


def _with_empty(items: Sequence[Item], order: list[Item]) -> list[Item]:
    """Put zero-element parameters back (at the front: they occupy nothing)."""
    return [it for it in items if not it.numel] + order
