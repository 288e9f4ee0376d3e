"""The optimizer state one rank keeps, from the plans.

The state tensors each optimizer makes on the parameters' local pieces (AdamW's two moments;
AdamW8bit's codes, scales and lookup tables; Muon's momentum plus AdamW for the rest; Shampoo's
grafting moments and its factors and inverse roots per block), exactly as ``raggedfsdp.optim`` and
``torch.optim`` allocate them. Re-exported by :mod:`.cost`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..planner import ShardPlan

__all__ = ["OPTIMIZERS", "SHAMPOO_DIM", "optimizer_state_bytes"]

#: Optimizers whose state the cost model knows (``raggedfsdp train --optimizer``).
OPTIMIZERS = ("adamw", "adamw8bit", "muon", "shampoo")

_STEP_BYTES = 4  # the fp32 ``step`` scalar tensor each optimizer keeps per parameter
_ADAMW8BIT_BLOCK = 256  # AdamW8bit's default block_numel
_ADAMW8BIT_MIN_NUMEL = 4096  # AdamW8bit's default min_8bit_numel
SHAMPOO_DIM = 1024  # Shampoo's default max_preconditioner_dim
#: AdamW8bit's nearest-code lookup tables, made once per process and device for each of its two
#: code maps: 2^16 int32 cell starts and 255 fp32 midpoints (``optim/adamw8bit.py``).
_ADAMW8BIT_TABLES = 2 * ((1 << 16) * 4 + 255 * 4)


def _shampoo_factor_numel(rows: int, cols: int, row_start: int, dim: int) -> int:
    """Elements of ``L``, ``R`` and their inverse roots over the blocks (at most ``dim`` a
    side) of rows ``[row_start, row_start + rows)`` of a ``[*, cols]`` matrix (whole row
    blocks: the planner keeps them so)."""
    col_sides = [min(dim, cols - c) for c in range(0, cols, dim)]
    total = 0
    for r in range(row_start, row_start + rows, dim):
        side = min(dim, row_start + rows - r)
        total += sum(2 * (side * side + c * c) for c in col_sides)
    return total


def _param_state(
    optimizer: str,
    name: str,
    shape: tuple[int, ...],
    local: int,
    row_start: int,
    itemsize: int,
    shampoo_dim: int,
) -> int:
    """Optimizer state tensor bytes of one parameter whose local piece has ``local`` elements
    starting at row ``row_start`` of its ``[rows, cols]`` view (the ``step`` scalar aside)."""
    matrix = len(shape) >= 2
    if optimizer == "adamw8bit" and math.prod(shape) >= _ADAMW8BIT_MIN_NUMEL:
        return 2 * local + 2 * 4 * -(-local // _ADAMW8BIT_BLOCK)  # uint8 codes, fp32 scales
    if optimizer == "muon" and matrix and _in_block(name):
        return local * itemsize  # the momentum buffer
    moments = 2 * local * itemsize
    if optimizer == "shampoo" and matrix and local:
        cols = math.prod(shape[1:])
        moments += 4 * _shampoo_factor_numel(local // cols, cols, row_start, shampoo_dim)
    return moments


def _in_block(name: str) -> bool:
    """Muon takes the matrices inside the blocks (a path with a layer index); embeddings and
    the head go to its auxiliary AdamW."""
    return any(part.isdigit() for part in name.split("."))


def optimizer_state_bytes(
    plans: Sequence[ShardPlan],
    optimizer: str,
    *,
    rank: int | None = None,
    itemsize: int = 4,
    shampoo_dim: int = SHAMPOO_DIM,
    tables: bool = True,
) -> int:
    """Optimizer state on one rank: exactly rank ``rank``'s, or (``None``) the average rank's
    (each parameter's state over ``W``; a real rank differs by its share of the padding). Every
    parameter also has a 4-byte ``step`` (Muon's momentum-only matrices aside). ``itemsize``:
    the master dtype's; ``shampoo_dim``: Shampoo's ``max_preconditioner_dim``; ``tables``:
    count AdamW8bit's per-process lookup tables (not in its ``state``)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZERS)}")
    total = 0.0
    if tables and optimizer == "adamw8bit":
        total += _ADAMW8BIT_TABLES
    for plan in plans:
        for name, entry in plan.entries.items():
            shape = entry.shape
            if optimizer != "muon" or len(shape) < 2 or not _in_block(name):
                total += _STEP_BYTES
            if rank is None:
                whole = _param_state(optimizer, name, shape, entry.numel, 0, itemsize, shampoo_dim)
                total += whole / plan.world_size
                continue
            start, end = plan.local_range(name, rank)
            cols = math.prod(shape[1:]) if len(shape) >= 2 else 1
            total += _param_state(
                optimizer, name, shape, end - start, start // cols, itemsize, shampoo_dim
            )
    return round(total)
