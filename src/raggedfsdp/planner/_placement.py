"""The arithmetic of placing a bucket's parameters in one flat buffer of ``W`` shards of ``S``.

A parameter is an :class:`Item` (numel and unit); parameters of one ``(numel, unit)`` are one
:class:`ItemType` with a count. This module holds what every part of the search shares: the
crossing size, the provable lower bound on ``S``, and the earliest valid offset of a parameter
after a cursor (why these are the right quantities: the note in ``_search.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "Item",
    "ItemType",
    "align_up",
    "crossing_offset",
    "earliest_offset",
    "fits",
    "item_types",
    "lower_bound",
    "lower_bound_of",
    "min_total",
    "next_valid_size",
    "packing_bound",
    "place",
    "shard_size_lower_bound",
]


def align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def crossing_size(numel: int, unit: int, alignment: int) -> int:
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


@dataclass(frozen=True)
class ItemType:
    """Parameters of one ``(numel, unit)``: how many, their aligned size and cut lcm."""

    numel: int
    unit: int
    count: int
    size: int  # numel aligned up
    lcm: int  # lcm(unit, alignment): cuts are multiples of it from the start
    crossing: int  # crossing_size


def item_types(items: Sequence[Item], a: int) -> tuple[list[ItemType], list[int]]:
    """The bucket's types in order of first appearance, and each item's type index."""
    index: dict[tuple[int, int], int] = {}
    counts: list[int] = []
    of_item = []
    for it in items:
        key = (it.numel, it.unit)
        if key not in index:
            index[key] = len(counts)
            counts.append(0)
        counts[index[key]] += 1
        of_item.append(index[key])
    types = [
        ItemType(n, u, c, align_up(n, a), math.lcm(u, a), crossing_size(n, u, a))
        for (n, u), c in zip(index, counts, strict=True)
    ]
    return types, of_item


def min_total(types: Sequence[ItemType]) -> int:
    """Fewest buffer elements any plan needs: every parameter but the last is followed by
    padding up to the alignment."""
    live = [t for t in types if t.numel]
    if not live:
        return 0
    return sum(t.size * t.count for t in live) - max(t.size - t.numel for t in live)


def next_valid_size(size: int, types: Sequence[ItemType], alignment: int) -> int:
    """Smallest ``S >= size`` (a multiple of the alignment) meeting every parameter's necessary
    condition ``S % unit == 0 or S >= crossing_size``. Walks the thresholds where the set of
    parameters that force divisibility shrinks; within one such interval the answer is the first
    multiple of the lcm of their units."""
    needs = sorted({(t.crossing, t.unit) for t in types if t.numel})
    s = align_up(max(size, alignment), alignment)
    while True:
        forcing = [(c, u) for c, u in needs if c > s]
        if not forcing:
            return s
        modulus = alignment
        for _, u in forcing:
            modulus = math.lcm(modulus, u)
        candidate = align_up(s, modulus)
        threshold = min(c for c, _ in forcing)  # the set changes here
        if candidate < threshold:
            return candidate
        s = align_up(threshold, alignment)


def shard_size_lower_bound(
    numels: Sequence[int], units: Sequence[int], world_size: int, alignment: int = 1
) -> int:
    """A provable lower bound on the shard size ``S`` of any valid plan.

    ``S`` must hold all parameters with their alignment padding (``W*S >= min total``), each
    parameter needs ``S % unit == 0`` or ``S >= crossing size`` (a parameter that spans two rank
    boundaries forces ``S`` to a multiple of its unit), and the parameters no boundary may cut
    must pack into ``W`` ranks (:func:`packing_bound`). So some shapes cannot reach low padding
    at large ``W``, or with whole tensors at small ``W``, whatever the planner does; this bound
    says so.
    """
    items = [Item(str(i), (n,), n, u) for i, (n, u) in enumerate(zip(numels, units, strict=True))]
    return lower_bound(items, world_size, alignment)


def lower_bound(items: Sequence[Item], world_size: int, alignment: int) -> int:
    types = item_types([it for it in items if it.numel], alignment)[0]
    return lower_bound_of(types, world_size, alignment)


def lower_bound_of(types: Sequence[ItemType], world_size: int, alignment: int) -> int:
    total = min_total(types)
    if total == 0:
        return 0
    size = max(-(-total // world_size), packing_bound(types, world_size))
    return next_valid_size(size, types, alignment)


def packing_bound(types: Sequence[ItemType], world_size: int) -> int:
    """Smallest ``S`` at which the parameters that no boundary may cut (no cut point inside: a
    whole unit, a vector shorter than its block) can pack into ``W`` ranks by the bin-packing
    argument: ``k + 1`` parameters larger than ``S / (k + 1)`` overfill a rank, so a rank holds
    at most ``k`` of them, and the ``(k*W + 1)``-th largest, ``n``, needs ``S >= (k + 1) * n``.
    Every ``k`` up to the number of such parameters per rank is tried (one walk down the sizes).
    """
    uncut = sorted(((t.numel, t.count) for t in types if t.lcm >= t.numel), reverse=True)
    bound = 0
    k = 1
    seen = 0
    for numel, count in uncut:
        seen += count
        while seen > k * world_size:  # this size holds the (k*W + 1)-th largest
            bound = max(bound, (k + 1) * numel)
            k += 1
    return bound


def earliest_offset(cursor: int, numel: int, unit: int, s: int, a: int, cap: int) -> int | None:
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
    return crossing_offset(cursor, numel, unit, math.lcm(unit, a), s, cap)


def crossing_offset(cursor: int, numel: int, unit: int, lcm: int, s: int, cap: int) -> int | None:
    """:func:`earliest_offset` for a parameter that does not fit in the cursor's window."""
    boundary = (cursor // s + 1) * s
    offset = boundary - ((boundary - cursor) // lcm) * lcm
    if offset + numel > boundary + s and s % unit:
        boundary += s
        offset = boundary - (s // lcm) * lcm
        if offset + numel > boundary + s:
            return None
    return offset if offset + numel <= cap else None


def place(order: Iterable[Item], s: int, a: int, cap: int) -> list[int] | None:
    """Offsets of the earliest placement of ``order``, or ``None`` when it does not fit."""
    offsets: list[int] = []
    cursor = 0
    for it in order:
        offset = earliest_offset(cursor, it.numel, it.unit, s, a, cap)
        if offset is None:
            return None
        offsets.append(offset)
        cursor = align_up(offset + it.numel, a)
    return offsets


def fits(order: Sequence[Item], s: int, a: int, cap: int, slack: int) -> bool:
    """Whether the earliest placement of ``order`` fits (stops once its waste exceeds slack)."""
    cursor = 0
    placed = 0
    for it in order:
        offset = earliest_offset(cursor, it.numel, it.unit, s, a, cap)
        if offset is None:
            return False
        cursor = align_up(offset + it.numel, a)
        placed += align_up(it.numel, a)
        if cursor - placed > slack:
            return False
    return True
