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

import hashlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, TypeVar

import torch
from torch import nn

from .layout import BlockSize, RaggedShard, ShardLayout, row_numel

__all__ = [
    "OPTIMIZER_TYPES",
    "PlanEntry",
    "ShardPlan",
    "StructAwarePlanner",
    "default_wrap_units",
    "shard_size_lower_bound",
    "split_by_bytes",
]

OptimizerType = Literal["adamw", "muon", "shampoo", "adamw8bit"]
OPTIMIZER_TYPES: tuple[str, ...] = ("adamw", "muon", "shampoo", "adamw8bit")
T = TypeVar("T")

# Exact DP while the number of type-count states is at most this; beam search beyond.
_EXACT_STATES = 4096
_BEAM_WIDTH = 128
# Candidate sizes tried one by one before the search steps geometrically (see _search).
_CONSECUTIVE_CANDIDATES = 32


@dataclass(frozen=True)
class PlanEntry:
    """One parameter in a bucket: where it starts in the global flat buffer and its unit."""

    name: str
    shape: tuple[int, ...]
    numel: int
    offset: int
    unit_numel: int


@dataclass(frozen=True)
class ShardPlan:
    """A validated plan for one bucket. Rank ``r`` owns ``[r*S, (r+1)*S)`` of the global buffer.

    Attributes:
        world_size: number of ranks ``W``.
        shard_numel: elements per rank ``S``.
        entries: ``name -> PlanEntry`` in buffer order.
        alignment: alignment in elements (offsets and ``S`` are multiples of it).
        dtype: the buffer's element type.
        lower_bound: a provable lower bound on ``S`` for these parameters (no valid plan has a
            smaller shard), so ``shard_numel / lower_bound`` bounds the planner's excess.
        name: the bucket's label (``""`` for a bucket planned alone).
    """

    world_size: int
    shard_numel: int
    entries: Mapping[str, PlanEntry]
    alignment: int = 1
    dtype: torch.dtype = torch.float32
    lower_bound: int = 0
    name: str = ""
    #: Parameter names in model order (the entries are in buffer order); defaults to buffer order.
    model_order: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", MappingProxyType(dict(self.entries)))
        if not self.model_order:
            object.__setattr__(self, "model_order", tuple(self.entries))
        if sorted(self.model_order) != sorted(self.entries):
            raise ValueError("model_order must name exactly the plan's entries")
        self._validate()

    def _validate(self) -> None:
        """Check DESIGN.md's invariants 1-3 once; the runtime then trusts the plan."""
        w, s, a = self.world_size, self.shard_numel, self.alignment
        if w < 1 or s < 0 or a < 1 or s % a:
            raise ValueError(f"invalid plan: world_size={w}, shard_numel={s}, alignment={a}")
        position = 0
        for e in sorted(self.entries.values(), key=lambda e: (e.offset, e.numel)):
            if e.offset < position or e.offset % a or e.offset + e.numel > w * s:
                raise ValueError(
                    f"invalid plan: parameter {e.name!r} at offset {e.offset} (numel {e.numel}) "
                    f"overlaps, is misaligned (alignment {a}) or exceeds W*S = {w * s}"
                )
            if s and e.numel:
                first, last = e.offset // s + 1, (e.offset + e.numel - 1) // s
                # Checking the first boundary suffices: the next ones differ by S, which must then
                # be a multiple of the unit. O(1) per parameter, whatever W is.
                bad = first <= last and (
                    (first * s - e.offset) % e.unit_numel or (last > first and s % e.unit_numel)
                )
                if bad:
                    raise ValueError(
                        f"invalid plan: a rank boundary cuts parameter {e.name!r} "
                        f"{list(e.shape)} inside a unit of {e.unit_numel} elements"
                    )
            position = e.offset + e.numel

    @property
    def total_numel(self) -> int:
        """``W * S``: elements in the global buffer."""
        return self.world_size * self.shard_numel

    @property
    def param_numel(self) -> int:
        return sum(e.numel for e in self.entries.values())

    @property
    def padding_numel(self) -> int:
        return self.total_numel - self.param_numel

    @property
    def padding_ratio(self) -> float:
        """``(W*S - sum of numels) / sum of numels``."""
        return self.padding_numel / self.param_numel if self.param_numel else 0.0

    def local_range(self, name: str, rank: int) -> tuple[int, int]:
        """Rank's piece of ``name`` in the parameter's flat index space (empty as ``(k, k)``)."""
        e = self.entries[name]
        s = self.shard_numel
        start = min(max(rank * s - e.offset, 0), e.numel)
        end = min(max((rank + 1) * s - e.offset, 0), e.numel)
        return start, end

    def layout(self, name: str) -> ShardLayout:
        e = self.entries[name]
        return ShardLayout(
            torch.Size(e.shape),
            e.unit_numel,
            tuple(self.local_range(name, r) for r in range(self.world_size)),
        )

    def digest(self) -> str:
        """A short hash of everything the runtime reads; equal plans give equal digests on every
        rank and every run (no set or hash order goes into it)."""
        h = hashlib.sha256()
        h.update(f"{self.world_size}|{self.shard_numel}|{self.alignment}|{self.dtype}".encode())
        for e in self.entries.values():
            h.update(f"|{e.name}:{e.shape}:{e.offset}:{e.unit_numel}".encode())
        return h.hexdigest()[:16]

    def renamed(self, names: Sequence[str], bucket: str) -> ShardPlan:
        """The same placement for a bucket whose parameters (in model order) have other names."""
        old = self.model_order
        if len(names) != len(old):
            raise ValueError(f"expected {len(old)} names, got {len(names)}")
        mapping = dict(zip(old, names, strict=True))
        entries = {
            mapping[n]: PlanEntry(mapping[n], e.shape, e.numel, e.offset, e.unit_numel)
            for n, e in self.entries.items()
        }
        return ShardPlan(
            self.world_size,
            self.shard_numel,
            entries,
            self.alignment,
            self.dtype,
            self.lower_bound,
            bucket,
            tuple(names),
        )


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
class _Item:
    name: str
    shape: tuple[int, ...]
    numel: int
    unit: int


def _min_total(items: Sequence[_Item], alignment: int) -> int:
    """Fewest buffer elements any plan needs: every parameter but the last is followed by
    padding up to the alignment."""
    sizes = [it.numel for it in items if it.numel]
    if not sizes:
        return 0
    aligned = [_align_up(n, alignment) for n in sizes]
    return sum(aligned) - max(a - n for a, n in zip(aligned, sizes, strict=True))


def _next_valid_size(size: int, items: Sequence[_Item], alignment: int) -> int:
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
    items = [_Item(str(i), (n,), n, u) for i, (n, u) in enumerate(zip(numels, units, strict=True))]
    return _lower_bound(items, world_size, alignment)


def _lower_bound(items: Sequence[_Item], world_size: int, alignment: int) -> int:
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


def _place(order: Iterable[_Item], s: int, a: int, cap: int) -> list[int] | None:
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


def _order_at(items: Sequence[_Item], s: int, a: int, world_size: int) -> list[_Item] | None:
    """A parameter order that fits at shard size ``s``: model order if it does (ties go to model
    order), else the type-count DP's, with parameters of one type kept in model order."""
    cap = world_size * s
    if _place(items, s, a, cap) is not None:
        return list(items)
    # Cheap orders before the dynamic program: large units first (they constrain S most),
    # then large tensors first. Sorting is stable, so ties keep model order.
    for key in (lambda it: (-it.unit, -it.numel), lambda it: -it.numel):
        order = sorted(items, key=key)
        if _place(order, s, a, cap) is not None:
            return order
    types: list[tuple[int, int]] = []
    members: dict[tuple[int, int], list[_Item]] = {}
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


def _search(items: Sequence[_Item], world_size: int, a: int) -> tuple[int, list[_Item]]:
    """Smallest shard size found feasible, and the order that achieves it.

    Candidates are exactly the sizes that meet every parameter's necessary condition, tried in
    increasing order. After ``_CONSECUTIVE_CANDIDATES`` failures the step grows geometrically,
    from 2^-14 of ``S`` and doubling every 4 failures: feasibility is not monotone, so this can
    skip a feasible size, but only large awkward buckets get that far, it stays close to the
    smallest feasible region, and it bounds planning time.
    """
    nonempty = [it for it in items if it.numel]
    lower = _lower_bound(nonempty, world_size, a)
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


def _with_empty(items: Sequence[_Item], order: list[_Item]) -> list[_Item]:
    """Put zero-element parameters back (at the front: they occupy nothing)."""
    return [it for it in items if not it.numel] + order


# ---------------------------------------------------------------------------------------------
# The planner.


def default_wrap_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """FSDP units of a model, bottom-up: every element of every ``nn.ModuleList``, then the root
    (which takes every parameter not in a unit). Names are fully qualified."""
    units = [
        (f"{name}.{i}" if name else str(i), child)
        for name, sub in module.named_modules()
        if isinstance(sub, nn.ModuleList)
        for i, child in enumerate(sub)
    ]
    return [*units, ("", module)]


class StructAwarePlanner:
    """Plans buckets so that every rank holds equal shards and no unit is split.

    Args:
        optimizer_type: the optimizer the shards must serve. ``None``/``"adamw"``: the policy's
            unit alone; ``"muon"``: whole rows of matrices; ``"shampoo"``: blocks of
            ``max_preconditioner_dim`` rows (default 1024); ``"adamw8bit"``: its quantization block
            (``block_numel`` elements of the flattened tensor, default 256, or the policy's tile
            rows when the policy gives a block).
        shard_policy: the :class:`RaggedShard` policy (default: element granularity).
        alignment_bytes: every offset and the shard size are multiples of this many bytes.
        **optimizer_options: ``max_preconditioner_dim`` (shampoo), ``block_numel`` (adamw8bit).
    """

    def __init__(
        self,
        optimizer_type: OptimizerType | None = None,
        shard_policy: RaggedShard | None = None,
        alignment_bytes: int = 16,
        **optimizer_options: int,
    ) -> None:
        if optimizer_type is not None and optimizer_type not in OPTIMIZER_TYPES:
            raise ValueError(
                f"unknown optimizer_type {optimizer_type!r}; expected one of "
                f"{(None, *OPTIMIZER_TYPES)}"
            )
        allowed = {"shampoo": {"max_preconditioner_dim"}, "adamw8bit": {"block_numel"}}
        unknown = set(optimizer_options) - allowed.get(optimizer_type or "", set())
        if unknown:
            raise ValueError(
                f"unknown option(s) {sorted(unknown)} for optimizer_type {optimizer_type!r}"
            )
        for key, value in optimizer_options.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if isinstance(alignment_bytes, bool) or not isinstance(alignment_bytes, int):
            raise ValueError(f"alignment_bytes must be a positive integer, got {alignment_bytes!r}")
        if alignment_bytes < 1:
            raise ValueError(f"alignment_bytes must be a positive integer, got {alignment_bytes!r}")
        self.optimizer_type = optimizer_type
        self.shard_policy = shard_policy if shard_policy is not None else RaggedShard()
        self.alignment_bytes = alignment_bytes
        self.max_preconditioner_dim = optimizer_options.get("max_preconditioner_dim", 1024)
        self.block_numel = optimizer_options.get("block_numel", 256)
        self._cache: dict[tuple, ShardPlan] = {}

    def __repr__(self) -> str:
        return (
            f"StructAwarePlanner(optimizer_type={self.optimizer_type!r}, "
            f"shard_policy={self.shard_policy!r}, alignment_bytes={self.alignment_bytes})"
        )

    def _optimizer_unit(self, name: str, shape: tuple[int, ...]) -> tuple[int, BlockSize]:
        """Elements the optimizer needs kept together, and how to describe it in errors."""
        ndim = len(shape)
        if self.optimizer_type == "muon" and ndim >= 2:
            return row_numel(shape), "1 row"
        if self.optimizer_type == "shampoo" and ndim >= 2:
            b = self.max_preconditioner_dim
            return b * row_numel(shape), f"{b} rows (max_preconditioner_dim)"
        if self.optimizer_type == "adamw8bit":
            if ndim >= 2 and self.shard_policy.block_rows(name, shape) is not None:
                return 1, "the policy's tiles"  # tiles are the quantization blocks
            return self.block_numel, f"{self.block_numel} elements (block_numel)"
        return 1, None

    def unit_numel(self, name: str, shape: Sequence[int] | torch.Size) -> int:
        """The unit of ``name``: the lcm of what the policy asks and what the optimizer needs."""
        shape = tuple(int(d) for d in shape)
        numel = math.prod(shape)
        policy_unit = self.shard_policy.unit_numel(name, shape)
        optimizer_unit, described = self._optimizer_unit(name, shape)
        unit = math.lcm(policy_unit, optimizer_unit)
        if self.shard_policy.padding_strategy == "error" and numel and numel % unit:
            raise ValueError(
                f"parameter {name!r} of shape {list(shape)}: policy block "
                f"{self.shard_policy.block_for(name)!r} and optimizer block {described} need "
                f"units of {unit} elements, which do not divide its {numel} elements "
                f"(padding_strategy='error')"
            )
        return min(unit, max(numel, 1))

    def plan(
        self,
        params: Mapping[str, torch.Tensor | torch.Size | tuple[int, ...]],
        world_size: int,
        dtype: torch.dtype | None = None,
        *,
        name: str = "",
    ) -> ShardPlan:
        """Plan ONE bucket. ``params`` is ordered (model order); tensors may be on meta."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        if not params:
            raise ValueError("cannot plan an empty bucket: params has no entries")
        dtype = dtype or _bucket_dtype(params)
        alignment = max(1, self.alignment_bytes // dtype.itemsize)
        items = []
        for pname, value in params.items():
            shape = tuple(int(d) for d in (value.shape if torch.is_tensor(value) else value))
            if any(d < 0 for d in shape):
                raise ValueError(f"parameter {pname!r} has a negative dimension: {list(shape)}")
            items.append(_Item(pname, shape, math.prod(shape), self.unit_numel(pname, shape)))
        key = (tuple((it.numel, it.unit, it.shape) for it in items), world_size, alignment, dtype)
        cached = self._cache.get(key)
        if cached is not None:
            return cached.renamed([it.name for it in items], name)
        shard, order = _search(items, world_size, alignment)
        offsets = _place(order, shard, alignment, world_size * shard) if shard else None
        entries = {
            it.name: PlanEntry(it.name, it.shape, it.numel, offsets[i] if offsets else 0, it.unit)
            for i, it in enumerate(order)
        }
        plan = ShardPlan(
            world_size,
            shard,
            entries,
            alignment,
            dtype,
            _lower_bound([it for it in items if it.numel], world_size, alignment),
            name,
            tuple(it.name for it in items),
        )
        self._cache[key] = plan
        return plan

    def plan_model(
        self,
        module: nn.Module,
        world_size: int,
        *,
        buffer_size: int | None = None,
        dtype: torch.dtype | None = None,
        wrap: Callable[[nn.Module], list[tuple[str, nn.Module]]] = default_wrap_units,
    ) -> list[ShardPlan]:
        """Plan every bucket of a model: one per FSDP unit and dtype, split in model order at
        ``buffer_size`` bytes (a single larger parameter gets its own bucket). Identical buckets
        (repeated layers) are planned once."""
        return [
            self.plan(params, world_size, dtype, name=label)
            for label, params in bucket_params(module, buffer_size=buffer_size, wrap=wrap)
        ]


def _bucket_dtype(params: Mapping[str, object]) -> torch.dtype:
    dtypes = {v.dtype for v in params.values() if torch.is_tensor(v)}
    if len(dtypes) > 1:
        raise ValueError(
            f"a bucket needs one dtype, got {sorted(map(str, dtypes))}; pass dtype= (the "
            f"communication dtype) or split the bucket"
        )
    return dtypes.pop() if dtypes else torch.float32


def bucket_params(
    module: nn.Module,
    *,
    buffer_size: int | None = None,
    wrap: Callable[[nn.Module], list[tuple[str, nn.Module]]] = default_wrap_units,
) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """The buckets of a model in model order: ``(label, {name: param})``.

    Each FSDP unit (from ``wrap``) takes its parameters not already taken by an inner unit (tied
    parameters go to the first unit that sees them, under their first name); they are grouped by
    dtype and split at ``buffer_size`` bytes.
    """
    if buffer_size is not None and buffer_size < 1:
        raise ValueError(f"buffer_size must be positive bytes or None, got {buffer_size!r}")
    taken: set[int] = set()
    for prefix, unit in wrap(module):
        by_dtype: dict[torch.dtype, dict[str, torch.Tensor]] = {}
        for pname, p in unit.named_parameters(prefix=prefix):
            if id(p) in taken:
                continue
            taken.add(id(p))
            by_dtype.setdefault(p.dtype, {})[pname] = p
        for dt, group in by_dtype.items():
            chunks = split_by_bytes(
                list(group.items()), lambda kv, dt=dt: kv[1].numel() * dt.itemsize, buffer_size
            )
            for i, chunk in enumerate(chunks):
                yield f"{prefix or '<root>'}/{str(dt).removeprefix('torch.')}/{i}", dict(chunk)


def split_by_bytes(
    items: Sequence[T], nbytes: Callable[[T], int], buffer_size: int | None
) -> list[list[T]]:
    """Model-order chunks of at most ``buffer_size`` bytes (``None``: one chunk); a single item
    larger than that stands alone."""
    if buffer_size is None:
        return [list(items)]
    chunks: list[list[T]] = [[]]
    used = 0
    for item in items:
        size = nbytes(item)
        if chunks[-1] and used + size > buffer_size:
            chunks.append([])
            used = 0
        chunks[-1].append(item)
        used += size
    return chunks
