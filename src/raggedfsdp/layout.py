"""RaggedShard: how each parameter may be cut, and where each rank's piece of it lies.

:class:`RaggedShard` is the user's policy (a parameter's *unit*, the run of elements never split:
cut points are multiples of it and the parameter's end, so a partial last unit is legal);
:class:`ShardLayout` is one parameter's placement over the ranks and the geometry between the full
tensor and a rank's piece. The sharded tensor that carries a layout is :mod:`raggedfsdp.tensor`'s.
Pure Python over shapes; no process group (the planner and the ``plan`` command use it alone).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias, Union

import torch

__all__ = ["BlockSize", "RaggedShard", "ShardLayout", "parse_block_size", "row_numel"]

#: A block request: ``None`` (element), ``b`` rows, ``(rows, cols)`` tiles, or ``"whole"``.
BlockSize: TypeAlias = Union[int, tuple[int, int], Literal["whole"], None]  # noqa: UP007

Shape: TypeAlias = tuple[int, ...]


def _as_shape(shape: Sequence[int] | torch.Size) -> Shape:
    return tuple(int(d) for d in shape)


def row_numel(shape: Sequence[int]) -> int:
    """Elements in one *row* of a parameter, as docs/design.md ("Vocabulary") defines a row.

    A Linear ``[out, in]`` and an expert stack ``[E, out, in]`` have rows of ``in`` elements (the
    stack is viewed as ``[E*out, in]``); a convolution ``[out, in, kh, kw]`` (ndim >= 4) has one
    output filter, ``in*kh*kw`` elements, per row. 0-D and 1-D parameters have rows of one element.
    """
    shape = _as_shape(shape)
    if len(shape) <= 1:
        return 1
    if len(shape) <= 3:
        return shape[-1]
    return math.prod(shape[1:])


def _check_block(block: object, where: str) -> None:
    """Raise ``ValueError`` unless ``block`` is a valid :data:`BlockSize`."""
    if block is None or block == "whole":
        return
    if isinstance(block, bool):
        raise ValueError(
            f"{where}: block size must be an int, (rows, cols) or 'whole', got {block!r}"
        )
    if isinstance(block, int):
        if block <= 0:
            raise ValueError(f"{where}: block size must be a positive integer, got {block!r}")
        return
    if isinstance(block, tuple) and len(block) == 2:
        if all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
            return
        raise ValueError(f"{where}: (rows, cols) block needs two positive integers, got {block!r}")
    raise ValueError(
        f"{where}: block size must be None, a positive int, (rows, cols) or 'whole', got {block!r}"
    )


@dataclass(frozen=True)
class RaggedShard:
    """The user's shard policy: which cuts each parameter allows.

    Args:
        block_size: ``None`` cuts anywhere (element granularity), but between the filters of a
            convolution (one output channel, :func:`row_numel`); an int ``b`` keeps ``b`` rows
            together (so ``b x b`` tiles stay whole; for a 1-D parameter, ``b`` elements);
            ``(rows, cols)`` keeps ``rows`` rows together and checks that ``cols`` divides the row
            length; ``"whole"`` keeps the parameter on exactly one rank.
        padding_strategy: ``"pad"`` lets a shape that is not a multiple of the block keep its
            partial last block whole; ``"error"`` raises ``ValueError`` for such a shape.
        overrides: per-parameter block sizes keyed by fully-qualified-name glob
            (``fnmatch``); the first matching pattern wins.
    """

    block_size: BlockSize = None
    padding_strategy: Literal["pad", "error"] = "pad"
    # Stored as an ordered tuple of (pattern, block) so the policy is hashable and comparable.
    overrides: Mapping[str, BlockSize] | tuple[tuple[str, BlockSize], ...] | None = field(
        default=None
    )

    def __post_init__(self) -> None:
        if isinstance(self.block_size, list):
            object.__setattr__(self, "block_size", tuple(self.block_size))
        _check_block(self.block_size, "RaggedShard.block_size")
        if self.padding_strategy not in ("pad", "error"):
            raise ValueError(
                f"RaggedShard.padding_strategy must be 'pad' or 'error', "
                f"got {self.padding_strategy!r}"
            )
        items = self.overrides.items() if isinstance(self.overrides, Mapping) else self.overrides
        normalized: list[tuple[str, BlockSize]] = []
        for pattern, block in items or ():
            if isinstance(block, list):
                block = tuple(block)
            _check_block(block, f"RaggedShard.overrides[{pattern!r}]")
            normalized.append((str(pattern), block))
        object.__setattr__(self, "overrides", tuple(normalized))

    def block_for(self, name: str) -> BlockSize:
        """The block that applies to parameter ``name``: the first matching override, else the
        policy's ``block_size``."""
        for pattern, block in self.overrides:  # type: ignore[union-attr]
            if fnmatch.fnmatchcase(name, pattern):
                return block
        return self.block_size

    def unit_numel(self, name: str, shape: Sequence[int] | torch.Size) -> int:
        """Elements in one unit of ``name``; never more than the parameter's numel (a unit that
        would be larger is the whole parameter), and at least 1."""
        shape = _as_shape(shape)
        numel = math.prod(shape)
        return min(max(numel, 1), _block_unit(name, shape, self.block_for(name), self))

    def block_rows(self, name: str, shape: Sequence[int] | torch.Size) -> int | None:
        """Rows per block for ``name`` (``None`` for element or whole-tensor policies)."""
        block = self.block_for(name)
        if isinstance(block, int):
            return block
        if isinstance(block, tuple):
            return block[0]
        return None


def _block_unit(name: str, shape: Shape, block: BlockSize, policy: RaggedShard) -> int:
    numel = math.prod(shape)
    if block is None:
        # A Conv2d/Conv3d weight keeps whole output channels even so: a rank's piece is then
        # whole filters (N-D, a convolution's own weight), and a cut inside a filter would
        # split the one kernel that every output pixel of that channel uses. A 3-D weight is an
        # expert stack's as well as a Conv1d's; its rows stay cuttable.
        return row_numel(shape) if len(shape) >= 4 else 1
    if block == "whole":
        return max(numel, 1)
    row_len = row_numel(shape)
    rows = numel // row_len if row_len else 0
    if isinstance(block, tuple):
        block_rows, block_cols = block
        if len(shape) >= 2 and row_len % block_cols != 0:
            raise ValueError(
                f"parameter {name!r} of shape {list(shape)}: block {block} has {block_cols} "
                f"columns, which do not divide its row length {row_len}"
            )
    else:
        block_rows = block
    if policy.padding_strategy == "error" and rows % block_rows != 0:
        raise ValueError(
            f"parameter {name!r} of shape {list(shape)} has {rows} rows, not a multiple of the "
            f"block {block!r} (padding_strategy='error'); use padding_strategy='pad' to keep the "
            f"partial last block whole, or an override for this parameter"
        )
    return block_rows * row_len


@dataclass(frozen=True)
class ShardLayout:
    """One parameter's placement: a contiguous range of its flattened elements per rank.

    ``ranges[r] = (start, end)`` is rank ``r``'s piece (empty as ``(k, k)``); the ranges tile
    ``[0, numel)`` in rank order, and every interior boundary is an allowed cut point (a multiple
    of ``unit_numel``).
    """

    global_shape: torch.Size
    unit_numel: int
    ranges: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", torch.Size(self.global_shape))
        object.__setattr__(self, "ranges", tuple((int(s), int(e)) for s, e in self.ranges))
        numel = self.numel
        if self.unit_numel < 1:
            raise ValueError(f"unit_numel must be >= 1, got {self.unit_numel}")
        position = 0
        for rank, (start, end) in enumerate(self.ranges):
            if start != position or end < start:
                raise ValueError(
                    f"ranges {self.ranges} do not tile [0, {numel}) in rank order (rank {rank})"
                )
            if 0 < end < numel and end % self.unit_numel != 0:
                raise ValueError(
                    f"rank {rank} ends at element {end}, inside a unit of {self.unit_numel} "
                    f"elements of a parameter of shape {list(self.global_shape)}"
                )
            position = end
        if position != numel:
            raise ValueError(f"ranges {self.ranges} do not cover all {numel} elements")

    @property
    def numel(self) -> int:
        """Elements of the whole parameter."""
        return math.prod(self.global_shape)

    @property
    def world_size(self) -> int:
        """Ranks the parameter is laid over (one range each)."""
        return len(self.ranges)

    @property
    def ndim(self) -> int:
        """Dimensions of the whole parameter (a rank's piece may be 1-D)."""
        return len(self.global_shape)

    def local_numel(self, rank: int) -> int:
        """Elements of rank's piece (0 when it holds none)."""
        start, end = self.ranges[rank]
        return end - start

    def is_row_aligned(self, rank: int) -> bool:
        """Whether rank's range is whole slices along dim 0 (so its piece is N-D)."""
        if self.ndim < 2:
            return True
        inner = math.prod(self.global_shape[1:])
        start, end = self.ranges[rank]
        return inner > 0 and start % inner == 0 and end % inner == 0

    def local_shape(self, rank: int) -> torch.Size:
        """Shape of rank's piece: N-D ``(rows, *shape[1:])`` when the range is whole rows along
        dim 0, else 1-D. A 0-D parameter's holder gets shape ``()``; other ranks ``(0,)``."""
        start, end = self.ranges[rank]
        if self.ndim == 0:
            return torch.Size(()) if end > start else torch.Size((0,))
        if self.ndim >= 2 and self.is_row_aligned(rank):
            inner = math.prod(self.global_shape[1:])
            return torch.Size(((end - start) // inner, *self.global_shape[1:]))
        return torch.Size((end - start,))

    def boxes(self, rank: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Rectangular N-D chunks ``(offsets, sizes)`` that exactly cover rank's flat range, in
        row-major order; at most ``2*ndim - 1`` of them (``[]`` for an empty range)."""
        start, end = self.ranges[rank]
        return _boxes(start, end, tuple(self.global_shape))

    def to_local(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank's piece of ``full`` (a view when ``full`` is contiguous), in ``local_shape``."""
        if full.shape != self.global_shape:
            raise ValueError(
                f"expected a tensor of shape {list(self.global_shape)}, got {list(full.shape)}"
            )
        start, end = self.ranges[rank]
        return full.reshape(-1)[start:end].view(self.local_shape(rank))

    def from_locals(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's piece (rank order)."""
        if len(pieces) != self.world_size:
            raise ValueError(f"expected {self.world_size} pieces, got {len(pieces)}")
        for rank, piece in enumerate(pieces):
            if piece.numel() != self.local_numel(rank):
                raise ValueError(
                    f"piece of rank {rank} has {piece.numel()} elements, "
                    f"expected {self.local_numel(rank)}"
                )
        return torch.cat([p.reshape(-1) for p in pieces]).view(self.global_shape)


def _boxes(start: int, end: int, shape: Shape) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Decompose the flat range ``[start, end)`` of a row-major ``shape`` into boxes: a head that
    finishes the first partial slice of dim 0, a middle of whole slices, a tail that starts the
    last partial slice. Recursing into the partial slices gives at most ``2*ndim - 1`` boxes."""
    if end <= start:
        return []
    if not shape:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (end - start,))]
    inner = math.prod(shape[1:])
    first, first_rem = divmod(start, inner)
    last, last_rem = divmod(end, inner)
    rest = shape[1:]
    if first == last:
        return [((first, *o), (1, *s)) for o, s in _boxes(first_rem, last_rem, rest)]
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if first_rem:
        out += [((first, *o), (1, *s)) for o, s in _boxes(first_rem, inner, rest)]
        first += 1
    if last > first:
        out.append(((first, *(0,) * len(rest)), (last - first, *rest)))
    if last_rem:
        out += [((last, *o), (1, *s)) for o, s in _boxes(0, last_rem, rest)]
    return out


def parse_block_size(text: str) -> BlockSize:
    """``"none"`` (element), ``"32"`` (rows), ``"128x128"`` (tiles) or ``"whole"``."""
    value = text.strip().lower()
    block: BlockSize
    if value == "none":
        block = None
    elif value == "whole":
        block = "whole"
    elif value.isdigit():
        block = int(value)
    elif value.count("x") == 1 and all(p.isdigit() for p in value.split("x")):
        rows, cols = value.split("x")
        block = (int(rows), int(cols))
    else:
        block = "invalid"  # type: ignore[assignment]
    try:
        RaggedShard(block_size=block)  # positive sizes only
    except ValueError:
        raise ValueError(
            f"invalid block size {text!r}: expected none, whole, ROWS (e.g. 32) or ROWSxCOLS "
            f"(e.g. 128x128) with positive integers"
        ) from None
    return block
