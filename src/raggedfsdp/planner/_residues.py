"""A proof that a candidate shard size has no valid plan in any order.

Residues of the sums of aligned sizes modulo each type's cut lcm; see the note in ``_search.py``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from ._placement import ItemType

__all__ = ["Residues"]

# Sets larger than this are not kept (the type then proves nothing); the test walks at most this
# many boundaries and this much work (a prefix of the boundaries is still a proof), and merges
# its states beyond _MAX_RESIDUE_STATES.
_MAX_RESIDUES = 4096
_MAX_RESIDUE_BOUNDARIES = 4096
_RESIDUE_WORK = 6_000
_MAX_RESIDUE_STATES = 64


class Residues:
    """Which residues modulo each type's lcm the sums of aligned sizes can take.

    For type ``j`` with lcm ``L``, ``sums[j]`` is the sorted set of ``(sum of c_i * size_i) mod L``
    over all counts ``0 <= c_i <= count_i`` (``None`` when that set would exceed
    ``_MAX_RESIDUES``, which proves nothing). A parameter of type ``j`` that contains boundary
    ``k*S`` (or the parameter that starts first at or after it, whatever its type) starts at
    ``P + w``, ``P`` the aligned sizes before it and ``w`` the waste so far, and then
    ``(k*S - w) mod L`` is a residue of ``P``'s type ``j`` set (for a parameter starting at or
    after the boundary, ``w >= k*S - P`` and the same holds for every type's set). The waste is
    non-decreasing along the buffer, so the smallest waste each boundary allows, boundary after
    boundary, is a lower bound on the final waste.
    """

    def __init__(self, types: Sequence[ItemType]) -> None:
        self.types = list(types)
        self.sums: list[list[int] | None] = []
        self.steps: list[int] = []  # when the set is a whole subgroup: its generator (else 0)
        for t in types:
            sums = self._sums(t.lcm)
            self.sums.append(sums)
            step = 0
            if sums is not None:
                g = t.lcm
                for r in sums:
                    g = math.gcd(g, r)
                if len(sums) == t.lcm // g:
                    step = g
            self.steps.append(step)
        # One gcd that every aligned size and every lcm is a multiple of.
        g = 0
        for t in types:
            g = math.gcd(g, math.gcd(t.size, t.lcm))
        self.gcd = g

    def _sums(self, modulus: int) -> list[int] | None:
        reach = {0}
        for t in self.types:
            d = t.size % modulus
            if not d:
                continue
            period = modulus // math.gcd(d, modulus)
            multiples = {(c * d) % modulus for c in range(min(t.count, period - 1) + 1)}
            if len(reach) * len(multiples) > 4 * _MAX_RESIDUES:
                return None
            reach = {(r + x) % modulus for r in reach for x in multiples}
            if len(reach) > _MAX_RESIDUES:
                return None
        return sorted(reach)

    def gcd_waste(self, s: int, world_size: int) -> int:
        """Waste any placement at shard size ``s`` has: every aligned size and lcm is a multiple
        of ``gcd``, so boundary ``k`` needs waste congruent to ``k*S`` modulo it, and the waste
        only grows: ``(W - 1) * (S mod gcd)`` at least."""
        return (world_size - 1) * (s % self.gcd) if self.gcd else 0

    def forced_waste(self, s: int, world_size: int, slack: int) -> int:
        """A lower bound on the waste of any placement at shard size ``s``; returns as soon as
        it exceeds ``slack``.

        Boundary by boundary, the waste so far ``w`` must make ``(k*S - w) mod L_j`` a residue
        for the type ``j`` of the parameter that contains the boundary, or for every type when a
        parameter starts at or after it. A parameter of ``n`` elements contains at most
        ``(n - 1) // S + 1`` boundaries, so a type with few parameters (a norm, a router) can
        take only that many: states count how many boundaries each such *rare* type took.
        """
        boundaries = min(world_size - 1, _MAX_RESIDUE_BOUNDARIES)
        types = self.types
        caps = [t.count * ((t.numel - 1) // s + 1) for t in types]
        common = [j for j in range(len(types)) if caps[j] >= boundaries]
        rare = [j for j in range(len(types)) if caps[j] < boundaries]
        if any(self.sums[j] is None or self.steps[j] == 1 for j in common):
            return 0  # a type that can cross any boundary at no cost, any number of times
        # (lcm, sorted residues or None, subgroup step) per type
        spec = [(t.lcm, self.sums[j], self.steps[j]) for j, t in enumerate(types)]

        def extras(target: int) -> list[int]:
            out = []
            for lcm, sums, step in spec:
                if sums is None:
                    out.append(0)
                    continue
                t = target % lcm
                out.append(t % step if step else t - sums[bisect.bisect_right(sums, t) - 1])
            return out

        # usage of the rare types -> least waste so far
        states: dict[tuple[int, ...], int] = {tuple(0 for _ in rare): 0}
        work = 0
        for k in range(1, boundaries + 1):
            work += len(states) * len(types)
            if work > _RESIDUE_WORK:
                break  # the boundaries walked so far are a proof on their own
            nxt: dict[tuple[int, ...], int] = {}
            for usage, w in states.items():
                ex = extras(k * s - w)
                # Without common types some parameter starts at or after the boundary, and then
                # every congruence holds.
                least = min(ex[j] for j in common) if common else max(ex)
                options = [(usage, w + least)]
                for i, j in enumerate(rare):
                    if usage[i] < caps[j] and ex[j] < least:
                        options.append(((*usage[:i], usage[i] + 1, *usage[i + 1 :]), w + ex[j]))
                for key, value in options:
                    if value <= slack and (key not in nxt or value < nxt[key]):
                        nxt[key] = value
            if not nxt:
                return slack + 1
            if len(nxt) > _MAX_RESIDUE_STATES:
                nxt = _merge_states(nxt, _MAX_RESIDUE_STATES)
            states = nxt
        return min(states.values())


def _merge_states(states: dict[tuple[int, ...], int], keep: int) -> dict[tuple[int, ...], int]:
    """Keep the ``keep - 1`` states of least waste and merge the rest into one that is at least
    as good as each (componentwise least usage, least waste): a relaxation, so still a proof."""
    ranked = sorted(states.items(), key=lambda kv: (kv[1], kv[0]))
    kept = dict(ranked[: keep - 1])
    rest = ranked[keep - 1 :]
    usage = tuple(min(col) for col in zip(*(u for u, _ in rest), strict=True))
    waste = min(w for _, w in rest)
    if usage not in kept or waste < kept[usage]:
        kept[usage] = waste
    return kept
