"""Where a tensor-subclass parameter may be cut: its own block, told by the subclass.

A block-quantized subclass (NF4: one scale per 64 elements) must not be cut inside a block. FSDP2
cuts dim 0 into W equal chunks, so the rows must divide by W; here every rank holds whole blocks
and whole rows, any number of them, at any W. A subclass tells its block by an attribute
``fsdp_block_numel`` (elements) or, for a third party's class, :func:`register_block_numel`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ..layout import RaggedShard, ShardLayout

__all__ = ["BLOCK_ATTRIBUTE", "block_layout", "block_numel_of", "register_block_numel"]

#: the attribute a subclass defines to keep blocks of that many elements on one rank
BLOCK_ATTRIBUTE = "fsdp_block_numel"

BlockRule = int | Callable[[torch.Tensor], int]
_REGISTERED: dict[type, BlockRule] = {}


def register_block_numel(cls: type, block: BlockRule) -> None:
    """Keep blocks of ``block`` consecutive elements (row-major) of every ``cls`` parameter on
    one rank: an int, or a function of the tensor (``lambda t: t.block_size`` for torchao's
    ``NF4Tensor``). For classes one cannot give :data:`BLOCK_ATTRIBUTE`; a registration wins
    over the attribute, and applies to subclasses of ``cls``."""
    if not isinstance(cls, type) or not issubclass(cls, torch.Tensor):
        raise TypeError(f"register_block_numel takes a torch.Tensor subclass, got {cls!r}")
    if not callable(block):
        _check_block(block, cls.__qualname__)
    _REGISTERED[cls] = block


def block_numel_of(tensor: torch.Tensor) -> int | None:
    """The block ``tensor`` asks to keep whole (its class's registration, else its
    :data:`BLOCK_ATTRIBUTE`), or ``None``."""
    for cls in type(tensor).__mro__:
        if cls in _REGISTERED:
            rule = _REGISTERED[cls]
            block = rule(tensor) if callable(rule) else rule
            break
    else:
        block = getattr(tensor, BLOCK_ATTRIBUTE, None)
    if block is not None:
        _check_block(block, type(tensor).__qualname__)
    return block


def _check_block(block: object, owner: str) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"{owner}'s block must be a positive number of elements, got {block!r}")


def block_layout(
    name: str,
    shape: Sequence[int] | torch.Size,
    world_size: int,
    block_numel: int | None = None,
    policy: RaggedShard | None = None,
) -> ShardLayout:
    """Rank by rank, whole units of ``name`` (``shape``) as evenly as units allow, the first
    ranks one more: a unit is the fewest whole rows that are whole blocks of ``block_numel``
    and whole units of ``policy``. ``ValueError`` when the blocks do not tile the parameter."""
    shape = torch.Size(shape)
    numel = shape.numel()
    block = block_numel or 1
    if numel % block:
        raise ValueError(
            f"parameter {name!r} of shape {list(shape)} ({numel} elements) is not whole blocks "
            f"of {block} elements: its subclass's blocks do not tile it"
        )
    policy_unit = policy.unit_numel(name, shape) if policy is not None else 1
    dim_0_slice = math.prod(shape[1:]) if len(shape) >= 2 else 1  # the protocol concatenates dim 0
    unit = math.lcm(dim_0_slice, block, policy_unit)
    units = -(-numel // unit) if numel else 0
    base, extra = divmod(units, world_size)
    ranges, start = [], 0
    for rank in range(world_size):
        end = min(numel, start + (base + (rank < extra)) * unit)
        ranges.append((start, end))
        start = end
    return ShardLayout(shape, unit_numel=max(unit, 1), ranges=tuple(ranges))
