"""The frozen plan of one bucket: where each parameter lies in the flat buffer, validated once.

The runtime only reads a :class:`ShardPlan`; it never re-decides a placement.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from ..layout import ShardLayout

__all__ = ["PlanEntry", "ShardPlan"]


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
        """Check invariants 1-3 (docs/design.md, "Invariants of a plan") once; then trusted."""
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
        """Elements of the bucket's parameters (without padding)."""
        return sum(e.numel for e in self.entries.values())

    @property
    def padding_numel(self) -> int:
        """Elements of padding in the global buffer: ``W*S`` minus the parameters'."""
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
        """Parameter ``name``'s :class:`ShardLayout`: its range on every rank, and its unit."""
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
