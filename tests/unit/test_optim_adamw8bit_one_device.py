"""8-bit AdamW in one process: the quantization maps and their round trip, the table quantizer
against a binary search, closeness to fp32 AdamW and torch's AdamW exactly on small parameters,
the state dict, and bad input named. (On block-aligned shards at W = 1..4:
tests/distributed/test_optim_adamw8bit.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fake_ranks import fake_world
from harness import sharded_param
from optim_grid import state_dict_round_trip
from raggedfsdp.layout import ShardLayout
from raggedfsdp.optim import AdamW8bit
from raggedfsdp.optim.adamw8bit import dequantize_blocks, dynamic_map, quantize_blocks


def test_dynamic_maps() -> None:
    signed, unsigned = dynamic_map(signed=True), dynamic_map(signed=False)
    for qmap in (signed, unsigned):
        assert qmap.shape == (256,) and qmap.dtype == torch.float32
        assert torch.all(qmap[1:] > qmap[:-1])  # sorted, no duplicates
        assert qmap[-1] == 1.0 and 0.0 in qmap
    assert signed[0] < -0.99 and (signed < 0).sum() == 127
    assert unsigned[0] == 0.0
    # Dense near zero: the smallest non-zero magnitude is 10^-6 scale.
    assert unsigned[1] < 1e-6


@pytest.mark.parametrize("block_shape", [(1, 256), (32, 32), (5, 7)])
def test_quantize_round_trip_error_is_small(block_shape: tuple[int, int]) -> None:
    x = torch.randn(70, 90, generator=torch.Generator().manual_seed(5))
    for qmap, values in ((dynamic_map(True), x), (dynamic_map(False), x * x)):
        codes, scales = quantize_blocks(values, block_shape, qmap)
        assert codes.dtype == torch.uint8 and codes.shape == values.shape
        assert scales.shape == (-(-70 // block_shape[0]), -(-90 // block_shape[1]))
        back = dequantize_blocks(codes, scales, block_shape, qmap)
        # The map's widest gap is ~0.03 of the block absmax, so the error is at most ~0.015.
        error = (back - values).abs().max() / values.abs().max()
        assert error < 0.02, error


def test_table_quantizer_equals_bucketize_exactly() -> None:
    """The table lookup of quantize_blocks picks the same code as a binary search everywhere,
    including on every midpoint, its float neighbours, signed zeros and tiny values."""
    from raggedfsdp.optim.adamw8bit import _NearestCode

    g = torch.Generator().manual_seed(0)
    for signed in (True, False):
        qmap = dynamic_map(signed)
        mids = (qmap[:-1] + qmap[1:]) / 2
        x = torch.rand(200_000, generator=g) * (2 if signed else 1) - (1 if signed else 0)
        x = x * torch.rand(200_000, generator=g) ** 8  # dense near 0, where the map is
        edges = [mids, mids.nextafter(torch.tensor(2.0)), mids.nextafter(torch.tensor(-2.0))]
        specials = torch.tensor([0.0, -0.0, 1.0, 1e-30, -1e-30, 1e-45, qmap[0].item()])
        x = torch.cat([x, *edges, specials])
        want = torch.bucketize(x, mids, out_int32=True).to(torch.uint8)
        assert torch.equal(_NearestCode(qmap, x.device)(x), want)


def test_close_to_fp32_adamw() -> None:
    gen = torch.Generator().manual_seed(6)
    ours = nn.Parameter(torch.randn(64, 80, generator=gen))
    ref = nn.Parameter(ours.detach().clone())
    start = ours.detach().clone()
    opts = [AdamW8bit([ours], lr=0.01), torch.optim.AdamW([ref], lr=0.01)]
    for _ in range(10):
        g = torch.randn(64, 80, generator=gen)
        ours.grad, ref.grad = g.clone(), g
        for o in opts:
            o.step()
    relative = (ours - ref).norm() / (ref - start).norm()
    assert relative < 0.05, relative


def test_small_parameters_get_torch_adamw_exactly() -> None:
    gen = torch.Generator().manual_seed(7)
    ours = nn.Parameter(torch.randn(16, 16, generator=gen))
    ref = nn.Parameter(ours.detach().clone())
    opts = [AdamW8bit([ours], lr=0.01), torch.optim.AdamW([ref], lr=0.01)]
    for _ in range(3):
        g = torch.randn(16, 16, generator=gen)
        ours.grad, ref.grad = g.clone(), g
        for o in opts:
            o.step()
    assert torch.equal(ours, ref)


def test_state_dict_round_trip_keeps_codes_and_scales() -> None:
    state, equal_after_step = state_dict_round_trip(AdamW8bit, (64, 64), seed=8)
    assert state["exp_avg_codes"].dtype == torch.uint8
    assert state["exp_avg_sq_scales"].dtype == torch.float32
    assert equal_after_step


@pytest.mark.parametrize(
    ("ranges", "options", "message"),
    [
        (((0, 100), (100, 6144)), {}, r"'w'.*block 0 \(elements \[0, 256\)\).*unit is 1"),
        (((0, 16 * 96), (16 * 96, 6144)), {"block_shape": (32, 32)}, r"'w'.*32×32 tiles"),
    ],
)
def test_layout_cutting_a_block_is_named(ranges, options, message) -> None:
    layout = ShardLayout((64, 96), 1, ranges)
    with fake_world(0, 2):  # rank 0 of the layout's two
        param = sharded_param(layout.to_local(torch.zeros(64, 96), 0).clone(), layout, None)
        with pytest.raises(ValueError, match=message):
            AdamW8bit([("w", param)], **options)


def test_bad_hyper_parameters_are_named() -> None:
    param = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="block_numel"):
        AdamW8bit([param], block_numel=0)
    with pytest.raises(ValueError, match="block_shape"):
        AdamW8bit([param], block_shape=(32,))
    with pytest.raises(ValueError, match="betas"):
        AdamW8bit([param], betas=(1.5, 0.9))
