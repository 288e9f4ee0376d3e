"""Where a tensor- or expert-parallel split may cut a parameter: never inside a whole-kept block.

A 128x128 tile split across tp ranks would be quantized, or orthogonalised, as two. One rule, called
by ``fully_shard`` for a DTensor parameter and by the capacity planner for each rank's piece; the
rule and why it is the runtime's: the comment at :func:`first_cut_inside_block`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..layout import RaggedShard

__all__ = ["check_cut", "chunk_cuts", "first_cut_inside_block"]


def chunk_cuts(length: int, ways: int) -> list[int]:
    """Where ``torch.chunk`` cuts ``length`` into ``ways`` pieces (as ``Shard`` splits)."""
    chunk = -(-length // ways)
    return [k * chunk for k in range(1, ways) if k * chunk < length]


def _along_row(shape: Sequence[int], dim: int) -> bool:
    """Whether ``dim`` is the row itself (a matrix's or an expert stack's last dim)."""
    return 2 <= len(shape) <= 3 and dim == len(shape) - 1


# A split into ``ways`` cuts dim ``d`` where ``torch.chunk`` does (as ``Shard(d)`` does). What it
# must respect follows the policy's *rows* (:func:`raggedfsdp.layout.row_numel`: a matrix ``[out,
# in]`` and an expert stack ``[E, out, in]`` have rows of ``in`` elements, the stack viewed as
# ``[E*out, in]``; a convolution's row is one whole filter):
#
# - **along the row** (the last dim of a matrix or of a stack): on a multiple of the block's columns
#   (``b`` for ``b x b`` tiles, ``cols`` of ``(rows, cols)``), so each rank's piece holds whole
#   tiles; ``"whole"`` takes no cut;
# - **across rows** (any other dim): between units of the flattened tensor (``b`` rows, ``rows`` of
#   a tile, the whole tensor), and, where dims before ``d`` make slabs (the experts of a stack),
#   each slab must hold whole units too, since the split cuts every slab at its start: blocks of a
#   ``[E*out, in]`` view that straddle two experts are cut when ``out`` is.
#
# That is what the runtime does to the tensor: each rank's piece is planned with the policy's units
# over the piece's own rows, so a split that follows these lines leaves every block of the whole
# tensor inside one rank's piece and one unit of it (``tests/unit/test_facts.py`` checks the rule
# against that, element by element).
def first_cut_inside_block(
    name: str, shape: Sequence[int], dim: int, ways: int, policy: RaggedShard
) -> int | None:
    """The first index of dim ``dim`` where splitting ``name`` (of ``shape``) ``ways`` ways
    cuts a block ``policy`` keeps whole (module doc); ``None`` if none does."""
    shape = tuple(int(n) for n in shape)
    block = policy.block_for(name)
    cuts = chunk_cuts(shape[dim], ways)
    if block is None or not cuts:
        return None
    if _along_row(shape, dim):
        step = block if isinstance(block, int) else block[1] if isinstance(block, tuple) else 0
        bad = [c for c in cuts if not step or c % step]
    else:
        unit = policy.unit_numel(name, shape)
        inner = math.prod(shape[dim + 1 :])
        slabs_cut = math.prod(shape[:dim]) > 1 and (shape[dim] * inner) % unit != 0
        bad = [c for c in cuts if slabs_cut or (c * inner) % unit]
    return bad[0] if bad else None


def check_cut(
    name: str,
    shape: Sequence[int],
    dim: int,
    ways: int,
    policy: RaggedShard,
    *,
    by: str,
    error: type[ValueError] = ValueError,
) -> None:
    """Raise ``error`` naming the parameter, its split (``by``: what splits it) and its block
    if the split cuts a block (:func:`first_cut_inside_block`)."""
    bad = first_cut_inside_block(name, shape, dim, ways, policy)
    if bad is not None:
        raise error(
            f"parameter {name!r} of shape {list(shape)} is split by {by} at index {bad} of dim "
            f"{dim}, inside a block that the shard policy ({policy.block_for(name)!r}) keeps "
            f"whole; choose a block that divides the split, or another split"
        )
