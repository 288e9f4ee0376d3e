"""The block rule for tensor-subclass parameters (``planner/subclass_blocks.py``): every rank
holds whole blocks and whole rows, as evenly as the units allow, at any W, where FSDP2's equal
chunks need the rows to divide by W; a subclass tells its block by attribute or registration."""

from __future__ import annotations

import pytest
import torch

import raggedfsdp as rf
from raggedfsdp.models.nf4 import DEFAULT_BLOCK as BLOCK
from raggedfsdp.models.nf4 import NF4Weight
from raggedfsdp.planner import block_layout, block_numel_of
from subclasses import Opaque


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7, 64])
@pytest.mark.parametrize(("shape", "block"), [((41, 64), 64), ((46, 32), 64), ((8, 8, 16), 256)])
def test_every_rank_holds_whole_blocks_and_rows_as_evenly_as_units_allow(
    shape: tuple[int, ...], block: int, world: int
) -> None:
    layout = block_layout("w", shape, world, block)
    row = torch.Size(shape[1:]).numel()
    sizes = []
    for start, end in layout.ranges:
        assert start % block == 0 and (end - start) % block == 0  # whole blocks
        assert start % row == 0 and end % row == 0  # whole rows: the protocol concatenates dim 0
        sizes.append(end - start)
    assert sum(sizes) == torch.Size(shape).numel()
    assert max(sizes) - min(sizes) <= layout.unit_numel  # as even as whole units allow
    assert sizes == sorted(sizes, reverse=True)  # the first ranks hold the extra unit


def test_the_issue_case_41_rows_at_w_2_and_3() -> None:
    rows = lambda w: [(e - s) // 64 for s, e in block_layout("w", (41, 64), w, 64).ranges]  # noqa: E731
    assert rows(2) == [21, 20] and rows(3) == [14, 14, 13]
    # two rows per 64-element block of a [46, 32] weight: 23 blocks
    rows32 = [(e - s) // 32 for s, e in block_layout("w", (46, 32), 2, 64).ranges]
    assert rows32 == [24, 22]


def test_the_cut_of_whole_rows_alone_would_split_a_block_of_the_subclass() -> None:
    """Negative control: rows split evenly without the block (23 + 23 rows of 32) cut a
    64-element block, which the subclass's own slice refuses."""
    weight = NF4Weight.quantize(torch.randn(46, 32))
    _, end = block_layout("w", (46, 32), 2).ranges[0]
    with pytest.raises(ValueError, match="cut a 64-block"):
        weight[: end // 32]
    _, end = block_layout("w", (46, 32), 2, block_numel_of(weight)).ranges[0]
    assert weight[: end // 32].shape == (24, 32)


def test_a_shard_policy_unit_is_kept_too() -> None:
    layout = block_layout("w", (41, 64), 2, 64, rf.RaggedShard(block_size=4))
    assert [(e - s) // 64 for s, e in layout.ranges] == [24, 17]  # 11 bands of 4 rows: 6 + 5


def test_blocks_that_do_not_tile_the_parameter_are_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"'w' of shape \[41, 32\].*blocks of 64"):
        block_layout("w", (41, 32), 2, 64)


def test_a_subclass_tells_its_block_by_attribute_or_registration() -> None:
    assert block_numel_of(NF4Weight.quantize(torch.randn(2, BLOCK))) == BLOCK
    assert block_numel_of(torch.zeros(4)) is None

    class Tagged(Opaque):
        pass

    tagged = Tagged(torch.zeros(4, 8))
    assert block_numel_of(tagged) is None
    rf.register_block_numel(Tagged, lambda t: t.shape[-1] * 2)
    assert block_numel_of(tagged) == 16
    with pytest.raises(TypeError, match=r"torch\.Tensor subclass"):
        rf.register_block_numel(int, 4)
    with pytest.raises(ValueError, match="positive number of elements"):
        rf.register_block_numel(Tagged, 0)
