"""Window beams: a type order for a large bucket found one rank at a time.

See the note in ``_search.py``, "Large buckets are searched rank by rank".
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from ._placement import ItemType, align_up, crossing_offset

__all__ = ["NEVER", "Work", "window_beam"]

# A type with at least _COMMON_COUNT parameters tops up a rank in closed form; rare fills tried
# per rank (at least _FILL_BUDGET, more when there are few ranks: _WINDOW_WORK spread over them);
# top-ups tried with up to _FILL_VARIANTS - 1 of their parameters given back. What one beam state
# costs besides its type checks (its bookkeeping), in the work budget's steps.
_COMMON_COUNT = 8
_FILL_BUDGET = 24
_WINDOW_WORK = 30_000
_FILL_VARIANTS = 3
_STATE_WORK = 30
NEVER = 1 << 62


class Work:
    """A deterministic budget of elementary steps shared by one search (not wall time, so the
    same inputs always give the same plan)."""

    def __init__(self, budget: int) -> None:
        self.left = budget
        #: The least waste over the slack that beams gave up on (reset by the caller).
        self.needed = NEVER

    def spend(self, steps: int) -> bool:
        self.left -= steps
        return self.left >= 0


class _Beam:
    """What every state of one window beam shares: the sizes, the type classes and budgets.

    ``prefs``: the types in order of preference (common ones top up in that order, rare ones are
    tried in it); ``balanced``: the common type with most left tops up first, so that every common
    type stays available to cross later boundaries."""

    def __init__(
        self,
        types: Sequence[ItemType],
        prefs: Sequence[int],
        s: int,
        a: int,
        cap: int,
        width: int,
        work: Work,
        balanced: bool,
    ) -> None:
        self.types, self.s, self.a, self.cap, self.work, self.balanced = (
            types,
            s,
            a,
            cap,
            work,
            balanced,
        )
        self.numels = [t.numel for t in types]
        self.sizes = [t.size for t in types]
        self.common = [j for j in prefs if types[j].count >= _COMMON_COUNT]
        self.rare = [j for j in prefs if types[j].count < _COMMON_COUNT]
        # Few ranks afford many fills per rank (W=2 is a subset-sum problem); many ranks few.
        steps = _FILL_VARIANTS * len(types)
        self.fill_budget = max(_FILL_BUDGET, _WINDOW_WORK // (steps * width * max(1, cap // s - 1)))
        self.keep = 2 * width
        # States that differ only in how many of each same-sized common type they have left are
        # merged (the first found stays): they place the same sizes, and the beam should spend
        # its width on different fills, not on splits of interchangeable parameters.
        classes: dict[int, list[int]] = {}
        for j in self.common:
            classes.setdefault(types[j].size, []).append(j)
        self.groups = [g for g in classes.values() if len(g) > 1]

    def merged(self, rem: tuple[int, ...]) -> tuple[int, ...]:
        """``rem`` with the counts of each class of same-sized common types summed into its
        first type (the key under which states are merged)."""
        if not self.groups:
            return rem
        key = list(rem)
        for g in self.groups:
            key[g[0]] = sum(rem[j] for j in g)
            for j in g[1:]:
                key[j] = 0
        return tuple(key)

    def options(
        self, remaining: tuple[int, ...], cursor: int, placed: int
    ) -> tuple[list[tuple[int, int, tuple[int, ...], tuple]], bool]:
        """The ``keep`` best ways to fill the rest of the cursor's rank and cross (or meet) its
        end boundary, and whether there were more (see :class:`_RankFills`). ``placed``: aligned
        sizes placed so far. Options are ``(waste, cursor, remaining, segment)``, best first; a
        single option places everything when the rest fits in the rank."""
        window_end = min((cursor // self.s + 1) * self.s, self.cap)
        if cursor >= self.cap:
            return [], False
        total = sum(size * c for size, c in zip(self.sizes, remaining, strict=True))
        # Both sides are multiples of the alignment, so this also holds when the last parameter
        # is not (its padding is less than one alignment step).
        if cursor + total <= window_end:
            runs = tuple((j, c) for j, c in enumerate(remaining) if c)
            return [
                (cursor - placed, cursor + total, tuple(0 for _ in remaining), ((), runs, -1))
            ], False
        if window_end == self.cap:
            return [], False  # the last rank, and the rest does not fit in it
        fills = _RankFills(self, remaining, cursor, placed, window_end)
        fills.rare_dfs(cursor, 0)
        return fills.best()


class _RankFills:
    """The fills of one rank, enumerated, and the best options they give.

    A fill is a multiset of rare types (enumerated depth-first over distinct cursors,
    ``fill_budget`` at most) topped up with common types as far as they fit (closed form), minus
    up to ``_FILL_VARIANTS - 1`` of those; then each type that does not fit in what is left may
    cross the boundary. Options rank by least waste, then most placed, then first found; a
    segment is ``(rare types, ((type, count), ...) common runs, crossing type or -1)``."""

    def __init__(
        self, beam: _Beam, remaining: tuple[int, ...], cursor: int, placed: int, window_end: int
    ) -> None:
        self.beam, self.cursor, self.placed, self.window_end = beam, cursor, placed, window_end
        self.left = list(remaining)
        # The kept options as a heap whose top is the worst: (-waste, cursor, -sequence, payload).
        self.kept: list[tuple[int, int, int, tuple]] = []
        self.found = 0
        self.rare_fill: list[int] = []
        self.top_up_order = (
            sorted(beam.common, key=lambda j: -remaining[j]) if beam.balanced else beam.common
        )
        self.nodes = beam.fill_budget
        self.sums = {cursor}

    def best(self) -> tuple[list[tuple[int, int, tuple[int, ...], tuple]], bool]:
        self.kept.sort(reverse=True)
        options = [(-w, end, *payload) for w, end, _, payload in self.kept]
        return options, self.found > self.beam.keep

    def offer(self, waste: int, end: int, runs: list[list[int]], crossing: int) -> None:
        self.found += 1
        self.beam.work.left -= 1
        key = (-waste, end, -self.found)
        kept = self.kept
        if len(kept) >= self.beam.keep and key <= kept[0][:3]:
            return
        left = self.left
        if crossing >= 0:
            left[crossing] -= 1
        fill = (tuple(self.rare_fill), tuple((j, k) for j, k in runs if k), crossing)
        payload = (tuple(left), fill)
        if crossing >= 0:
            left[crossing] += 1
        if len(kept) >= self.beam.keep:
            heapq.heapreplace(kept, (*key, payload))
        else:
            heapq.heappush(kept, (*key, payload))

    def top_up(self, cur: int) -> tuple[list[list[int]], int]:
        """Common types after ``cur`` as far as they fit in the rank: runs ``[type, count]`` (taken
        from ``left``) and the cursor after them."""
        runs: list[list[int]] = []
        c = cur
        left, numels, sizes = self.left, self.beam.numels, self.beam.sizes
        for j in self.top_up_order:
            if left[j] and c + numels[j] <= self.window_end:
                k = min(left[j], (self.window_end - c - numels[j]) // sizes[j] + 1)
                runs.append([j, k])
                left[j] -= k
                c += k * sizes[j]
        return runs, c

    def evaluate(self, cur: int) -> None:
        """Offer the fill that ends at ``cur`` topped up, and with its last common parameters
        given back, each meeting the boundary or followed by every type that may cross it."""
        beam, left = self.beam, self.left
        runs, c = self.top_up(cur)
        base = self.placed + c - self.cursor  # placed sizes after the fill (no waste in a rank)
        for v in range(_FILL_VARIANTS):
            if v:  # give back the last common parameter of the top-up
                while runs and not runs[-1][1]:
                    runs.pop()
                if not runs:
                    break
                j = runs[-1][0]
                runs[-1][1] -= 1
                left[j] += 1
                c -= beam.sizes[j]
                base -= beam.sizes[j]
            if c == self.window_end:
                self.offer(c - base, c, runs, -1)
                continue
            beam.work.left -= len(beam.types)
            for j, t in enumerate(beam.types):
                if not left[j] or c + t.numel <= self.window_end:
                    continue
                offset = crossing_offset(c, t.numel, t.unit, t.lcm, beam.s, beam.cap)
                if offset is not None:
                    end = align_up(offset + t.numel, beam.a)
                    self.offer(end - base - t.size, end, runs, j)
        for j, k in runs:
            left[j] += k

    def rare_dfs(self, cur: int, start: int) -> None:
        self.evaluate(cur)
        beam, left = self.beam, self.left
        for i in range(start, len(beam.rare)):
            j = beam.rare[i]
            nxt = cur + beam.sizes[j]
            if not left[j] or cur + beam.numels[j] > self.window_end or nxt in self.sums:
                continue
            if self.nodes <= 0:
                return
            self.nodes -= 1
            self.sums.add(nxt)
            left[j] -= 1
            self.rare_fill.append(j)
            self.rare_dfs(nxt, i)
            self.rare_fill.pop()
            left[j] += 1


def window_beam(
    types: Sequence[ItemType],
    prefs: Sequence[int],
    s: int,
    a: int,
    cap: int,
    slack: int,
    width: int,
    work: Work,
    balanced: bool,
) -> tuple[list[int] | None, bool]:
    """A type order that fits, found rank by rank, and whether the beam ever dropped a state.

    A beam of ``width`` partial placements, each extended by :meth:`_Beam.options` across its
    rank's end boundary; the states of least waste (then most placed) go on, and states with
    the same parameters left keep the smaller cursor (see :class:`_Beam` for ``prefs`` and
    ``balanced``)."""
    beam = _Beam(types, prefs, s, a, cap, width, work, balanced)
    counts = tuple(t.count for t in types)
    # window -> merged remaining -> (waste, cursor, placed, parent entry, segment, remaining)
    pools: dict[int, dict[tuple[int, ...], tuple]] = {
        0: {beam.merged(counts): (0, 0, 0, None, None, counts)}
    }
    dropped = False
    while pools:
        pool = pools.pop(min(pools))
        states = sorted(pool.items(), key=lambda kv: (kv[1][0], -kv[1][2]))
        if len(states) > width:
            states, dropped = states[:width], True
        for _, value in states:
            if not work.spend(_STATE_WORK):
                return None, dropped
            _, cursor, placed, _, _, rem = value
            options, more = beam.options(rem, cursor, placed)
            dropped = dropped or more
            for waste, new_cursor, new_rem, segment in options:
                if waste > slack:
                    work.needed = min(work.needed, waste)
                    continue
                entry = (waste, new_cursor, new_cursor - waste, value, segment, new_rem)
                if not any(new_rem):
                    return _segments_order(entry), dropped
                target = pools.setdefault(new_cursor // s, {})
                key = beam.merged(new_rem)
                if key not in target or new_cursor < target[key][1]:
                    target[key] = entry
            if work.left < 0:
                return None, dropped
    return None, dropped


def _segments_order(entry: tuple) -> list[int]:
    """The type order along a beam entry's chain of segments."""
    segments = []
    while entry[4] is not None:
        segments.append(entry[4])
        entry = entry[3]
    order: list[int] = []
    for rare_fill, runs, crossing in reversed(segments):
        order += rare_fill
        for j, k in runs:
            order += [j] * k
        if crossing >= 0:
            order.append(crossing)
    return order
