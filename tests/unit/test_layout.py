"""RaggedShard units and ShardLayout geometry (pure logic, no process group)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import raggedfsdp as rf
from raggedfsdp.layout import row_numel


@pytest.mark.parametrize(
    ("shape", "block", "unit"),
    [
        ((64, 48), None, 1),
        ((64, 48), 32, 32 * 48),
        ((64, 48), (32, 16), 32 * 48),
        ((64, 48), "whole", 64 * 48),
        ((100,), 32, 32),
        ((4, 6, 8), 2, 2 * 8),  # expert stack: rows of `in` elements
        ((8, 3, 3, 3), 4, 4 * 27),  # convolution: a row is one output filter
        ((8, 3, 3, 3), None, 27),  # ... kept whole even without a block (Conv2d)
        ((8, 3, 2, 4, 4), None, 96),  # Conv3d: one filter of in*kt*kh*kw
        ((8, 3, 2, 4, 4), (2, 32), 2 * 96),  # a band of whole filters, tiles whole
        ((4, 6, 8), None, 1),  # a 3-D expert stack (or Conv1d) still cuts anywhere
        ((), 32, 1),  # zero-dim: one unit
        ((5, 7), 32, 35),  # block larger than the tensor: the whole tensor
    ],
)
def test_unit_numel(shape, block, unit):
    assert rf.RaggedShard(block_size=block).unit_numel("w", shape) == unit


def test_row_numel_definitions():
    assert row_numel((10, 20)) == 20
    assert row_numel((3, 10, 20)) == 20
    assert row_numel((16, 8, 3, 3)) == 72
    assert row_numel((7,)) == 1


def test_overrides_first_match_wins():
    policy = rf.RaggedShard(
        block_size=32, overrides={"*.bias": None, "layers.*": "whole", "layers.0.*": 8}
    )
    assert policy.unit_numel("layers.0.w", (64, 4)) == 64 * 4  # "layers.*" matched first
    assert policy.unit_numel("head.bias", (64,)) == 1
    assert policy.unit_numel("head.weight", (64, 4)) == 32 * 4
    assert policy == rf.RaggedShard(
        block_size=32, overrides={"*.bias": None, "layers.*": "whole", "layers.0.*": 8}
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_size": 0}, "positive integer"),
        ({"block_size": -3}, "positive integer"),
        ({"block_size": 2.5}, "block size"),
        ({"block_size": (32, 0)}, "positive integers"),
        ({"block_size": "rows"}, "block size"),
        ({"padding_strategy": "drop"}, "padding_strategy"),
        ({"overrides": {"x.*": 0}}, r"overrides\['x\.\*'\]"),
    ],
)
def test_bad_policies(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rf.RaggedShard(**kwargs)


def test_tile_columns_must_divide_row_names_parameter():
    with pytest.raises(ValueError, match=r"'blk.w'.*\[64, 48\].*\(32, 20\)"):
        rf.RaggedShard(block_size=(32, 20)).unit_numel("blk.w", (64, 48))


def test_padding_error_names_parameter_shape_block():
    policy = rf.RaggedShard(block_size=32, padding_strategy="error")
    with pytest.raises(ValueError, match=r"'fc.w' of shape \[40, 8\].*40 rows.*32"):
        policy.unit_numel("fc.w", (40, 8))
    assert policy.unit_numel("fc.w", (64, 8)) == 256


def test_layout_rejects_cut_inside_unit():
    with pytest.raises(ValueError, match="inside a unit"):
        rf.ShardLayout((4, 8), 8, ((0, 12), (12, 32)))
    with pytest.raises(ValueError, match="tile"):
        rf.ShardLayout((4, 8), 8, ((0, 8), (16, 32)))


def test_local_shape_nd_when_whole_rows():
    layout = rf.ShardLayout((6, 4), 4, ((0, 8), (8, 12), (12, 24), (24, 24)))
    assert layout.local_shape(0) == (2, 4)
    assert layout.local_shape(1) == (1, 4)
    assert layout.local_shape(3) == (0, 4)
    flat = rf.ShardLayout((6, 4), 2, ((0, 6), (6, 24)))
    assert flat.local_shape(0) == (6,)
    scalar = rf.ShardLayout((), 1, ((0, 0), (0, 1)))
    assert scalar.local_shape(0) == (0,) and scalar.local_shape(1) == ()


@st.composite
def layouts(draw):
    ndim = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    numel = math.prod(shape)
    unit = draw(st.integers(1, numel))
    cuts = sorted(draw(st.lists(st.integers(0, numel // unit), max_size=5)))
    bounds = [min(c * unit, numel) for c in cuts]
    ranges = list(zip([0, *bounds], [*bounds, numel], strict=True))
    return rf.ShardLayout(shape, unit, ranges)


@settings(max_examples=300, deadline=None)
@given(layouts(), st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.float64]))
def test_boxes_tile_ranges_and_roundtrip(layout, dtype):
    full = torch.arange(layout.numel).reshape(layout.global_shape).to(dtype)
    index = torch.arange(layout.numel).reshape(layout.global_shape)
    pieces = []
    for rank, (start, end) in enumerate(layout.ranges):
        boxes = layout.boxes(rank)
        assert len(boxes) <= max(1, 2 * layout.ndim - 1)
        covered = []
        for offsets, sizes in boxes:
            region = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
            covered += region.reshape(-1).tolist()
        assert covered == list(range(start, end))  # exact, in row-major order, no overlap
        piece = layout.to_local(full, rank)
        assert piece.shape == layout.local_shape(rank)
        pieces.append(piece.clone())
    assert torch.equal(layout.from_locals(pieces), full)
