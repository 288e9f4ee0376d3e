"""The quantization block of each parameter under compressed communication.

Defined in docs/design.md ("Compressed communication") on the parameter's 2-D view ``[rows,
row_length]``: tiles laid row-major (a partial tile at the right or bottom edge a block of its own);
a 1-D parameter has runs of ``b`` (``r`` of a tuple, else 256), a 0-dim one is one block. The
planner makes every unit a multiple of :attr:`QuantBlock.unit_numel`, so a rank's piece of a
parameter is whole blocks: quantizing it locally gives the blocks, codes and scales of the whole
parameter, for any world size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..layout import BlockSize, RaggedShard, row_numel

__all__ = [
    "DEFAULT_RUN",
    "MESSAGE_ALIGNMENT",
    "WHOLE_TILE",
    "Compression",
    "MessageLayout",
    "QuantBlock",
    "quant_block",
]

#: Elements per block of the element policy and of 1-D parameters without a block size.
DEFAULT_RUN = 256
#: Tile side for the ``"whole"`` policy (the unit is the whole tensor; the blocks are tiles).
WHOLE_TILE = 128


#: Bytes to which a compressed message's codes and its whole length are padded: its fp32 scales
#: then start 16-byte aligned and every message of a buffer of them starts 16-byte aligned, as
#: vectorised device loads and NCCL's fast paths want (invariant 3 of docs/design.md).
MESSAGE_ALIGNMENT = 16


@dataclass(frozen=True)
class MessageLayout:
    """Where a bucket's message (one rank's codes and scales, ``runtime/compression/_codec.py``)
    puts things, from its shard size ``S`` and the most blocks any rank's shard holds: ``S``
    one-byte codes padded to :data:`MESSAGE_ALIGNMENT`, then the fp32 scales, the whole padded
    to it again. The runtime's codec and the capacity model both read it, so they agree."""

    shard_numel: int
    max_blocks: int

    @property
    def code_bytes(self) -> int:
        """Bytes of the codes and their padding: where the scales start."""
        return _ceil(self.shard_numel, MESSAGE_ALIGNMENT)

    @property
    def message_bytes(self) -> int:
        return _ceil(self.code_bytes + 4 * self.max_blocks, MESSAGE_ALIGNMENT)

    @property
    def scale_slots(self) -> int:
        """fp32 slots after the codes (``max_blocks``, plus the padding)."""
        return (self.message_bytes - self.code_bytes) // 4


def _ceil(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class Compression(Protocol):
    """What the planner reads of a :class:`raggedfsdp.CommCompression` (a runtime type)."""

    @property
    def all_gather(self) -> torch.dtype | None: ...

    @property
    def reduce_scatter(self) -> torch.dtype | None: ...

    @property
    def block_size(self) -> int | tuple[int, int] | None: ...

    @property
    def error_feedback(self) -> bool: ...

    @property
    def enabled(self) -> bool: ...


@dataclass(frozen=True)
class QuantBlock:
    """The blocks of one parameter: tiles of ``rows x cols`` on its 2-D view whose rows have
    ``row_len`` elements, or (``row_len == 0``) runs of ``cols`` elements of the flattened
    parameter (viewed as one row)."""

    rows: int
    cols: int
    row_len: int

    @property
    def unit_numel(self) -> int:
        """Elements of one whole band of blocks: a rank boundary on a multiple of this never
        cuts a block."""
        return self.rows * self.row_len if self.row_len else self.cols

    def view_shape(self, numel: int) -> tuple[int, int]:
        """The 2-D view ``[rows, row_len]`` of a piece of ``numel`` elements (whole rows)."""
        if not self.row_len:
            return (1, numel)
        return (numel // self.row_len, self.row_len) if numel else (0, self.row_len)

    def grid(self, numel: int) -> tuple[int, int]:
        """Tiles ``(down, across)`` of a piece of ``numel`` elements."""
        rows, cols = self.view_shape(numel)
        if not rows or not cols:
            return (0, 0)
        return (-(-rows // self.rows), -(-cols // self.cols))

    def num_blocks(self, numel: int) -> int:
        """Blocks (so scales) of a piece of ``numel`` elements."""
        down, across = self.grid(numel)
        return down * across


def quant_block(
    name: str,
    shape: Sequence[int],
    policy: RaggedShard,
    block_size: int | tuple[int, int] | None = None,
) -> QuantBlock:
    """The quantization block of parameter ``name`` of ``shape`` (module doc). An explicit
    ``block_size`` must divide the policy's tile (rows and columns), or ``ValueError``."""
    shape = tuple(int(d) for d in shape)
    policy_block = policy.block_for(name)
    if block_size is not None:
        _check_divides_tile(name, shape, block_size, policy_block)
    block: BlockSize = block_size if block_size is not None else policy_block
    if len(shape) == 0:
        return QuantBlock(1, 1, 0)
    if len(shape) == 1:
        run = block if isinstance(block, int) else block[0] if isinstance(block, tuple) else None
        return QuantBlock(1, run or DEFAULT_RUN, 0)
    if block is None:
        return QuantBlock(1, DEFAULT_RUN, 0)
    rows, cols = _tile(block)
    return QuantBlock(rows, cols, row_numel(shape))


def _tile(block: BlockSize) -> tuple[int, int]:
    if block == "whole":
        return (WHOLE_TILE, WHOLE_TILE)
    if isinstance(block, int):
        return (block, block)
    assert isinstance(block, tuple)
    return block


def _check_divides_tile(
    name: str, shape: tuple[int, ...], block_size: int | tuple[int, int], policy: BlockSize
) -> None:
    """Blocks must nest inside the policy's tiles (a block across two tiles would mix the
    structures the policy keeps apart); element and whole-tensor policies have no tiles."""
    if policy is None or policy == "whole":
        return
    if len(shape) <= 1:
        ours = block_size if isinstance(block_size, int) else block_size[0]
        theirs = policy if isinstance(policy, int) else policy[0]
        fits = theirs % ours == 0
    else:
        (rows, cols), (tile_rows, tile_cols) = _tile(block_size), _tile(policy)
        fits = tile_rows % rows == 0 and tile_cols % cols == 0
    if not fits:
        raise ValueError(
            f"parameter {name!r} of shape {list(shape)}: compression block_size "
            f"{block_size!r} does not divide the policy's tile {policy!r}; use a block that "
            f"divides it, or block_size=None to quantize by the policy's tiles"
        )
