"""Compressed communication, pure logic: CommCompression, each parameter's quantization block,
the planner's units, and the quantization formulas against a per-block reference."""

from __future__ import annotations

import math

import pytest
import torch

import raggedfsdp as rf
from raggedfsdp.planner import QuantBlock, quant_block
from raggedfsdp.runtime.compression import BucketCodec, Residual, _quant
from raggedfsdp.runtime.compression._quant import CODE_MAX, dequantize, quantize
from raggedfsdp.runtime.compression._reduce_scatter import quantize_gradient

CODE_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


def reference(x: torch.Tensor, block: QuantBlock, dtype: torch.dtype):
    """docs/design.md's formulas block by block: (codes, scales, dequantized) of a whole piece."""
    rows, cols = block.view_shape(x.numel())
    matrix = x.float().reshape(rows, cols)
    codes = torch.empty(rows, cols, dtype=dtype)
    deq = torch.empty(rows, cols)
    scales = []
    for r0 in range(0, rows, block.rows):
        for c0 in range(0, cols, block.cols):
            tile = matrix[r0 : r0 + block.rows, c0 : c0 + block.cols]
            amax = tile.abs().max()
            s = torch.tensor(1.0) if amax == 0 else amax / torch.tensor(CODE_MAX[dtype])
            if dtype == torch.int8:
                q = torch.clamp(torch.round(tile / s), -127, 127).to(torch.int8)
            else:
                q = (tile / s).to(dtype)
            codes[r0 : r0 + block.rows, c0 : c0 + block.cols] = q
            deq[r0 : r0 + block.rows, c0 : c0 + block.cols] = q.float() * s
            scales.append(s)
    return codes.reshape(-1), torch.stack(scales), deq.reshape(-1)


def ours(x: torch.Tensor, block: QuantBlock, dtype: torch.dtype):
    codes = torch.empty(x.numel(), dtype=dtype)
    scales = torch.empty(block.num_blocks(x.numel()))
    residual = torch.empty(x.numel())
    quantize(x.reshape(-1), block, codes, scales, residual=residual)
    deq = torch.empty(x.numel())
    dequantize(codes, scales, block, deq)
    return codes, scales, deq, residual


def _assert_equals_reference(x: torch.Tensor, block: QuantBlock, dtype: torch.dtype):
    """Codes, scales, dequantized values and residual of ``x``, bit for bit the per-block
    reference's; our codes and scales, and the reference's dequantized values."""
    codes, scales, deq, residual = ours(x, block, dtype)
    ref_codes, ref_scales, ref_deq = reference(x, block, dtype)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
    assert torch.equal(scales, ref_scales)
    assert torch.equal(deq, ref_deq)
    assert torch.equal(residual, x.reshape(-1).float() - ref_deq)
    return codes, scales, ref_deq


@pytest.mark.parametrize("dtype", CODE_DTYPES)
@pytest.mark.parametrize(
    ("shape", "block"),
    [
        ((37, 53), QuantBlock(8, 16, 53)),  # partial tiles at the right, bottom and corner
        ((64, 32), QuantBlock(32, 32, 32)),  # whole tiles only
        ((5, 3, 7), QuantBlock(4, 4, 7)),  # a stack viewed as [15, 7]
        ((1000,), QuantBlock(1, 256, 0)),  # runs, a partial last one
        ((3, 100), QuantBlock(1, 256, 0)),  # element policy on a matrix: runs of the flat tensor
        ((), QuantBlock(1, 1, 0)),
    ],
)
def test_quantize_equals_per_block_reference(shape, block, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape) * torch.logspace(-3, 3, math.prod(shape) or 1)[: math.prod(shape)].view(
        shape
    )
    if x.numel() > 40:
        x.view(-1)[:40] = 0  # an all-zero block: scale 1, codes 0
    _assert_equals_reference(x, block, dtype)


@pytest.mark.parametrize("dtype", CODE_DTYPES)
@pytest.mark.parametrize(
    ("shape", "block", "chunk"),
    [
        ((37, 53), QuantBlock(8, 16, 53), 300),  # bands of 8 rows cut across and down
        ((64, 32), QuantBlock(4, 4, 32), 40),  # chunks smaller than a band: 2 tiles across
        ((5000,), QuantBlock(1, 256, 0), 1000),  # runs in chunks of 3 runs, a partial last one
        ((40, 40), QuantBlock(32, 32, 40), 100),  # a tile larger than a chunk: the scratch grows
    ],
)
def test_quantize_in_chunks_equals_per_block_reference(shape, block, chunk, dtype, monkeypatch):
    """Regions processed in chunks of whole tiles (``_quant.CHUNK``) give the same bits."""
    monkeypatch.setattr(_quant, "CHUNK", chunk)
    monkeypatch.setattr(_quant, "_SCRATCH", {})
    torch.manual_seed(1)
    x = torch.randn(shape) * torch.logspace(-3, 3, math.prod(shape)).view(shape)
    codes, scales, ref_deq = _assert_equals_reference(x, block, dtype)
    total = torch.randn(x.numel())
    expected = total + ref_deq
    dequantize(codes, scales, block, total, accumulate=True)
    assert torch.equal(total, expected)


def test_int8_error_within_half_a_step_and_exact_on_the_grid():
    block = QuantBlock(4, 4, 12)
    x = torch.randn(8, 12)
    _, scales, deq, _ = ours(x, block, torch.int8)
    step = scales.view(2, 3).repeat_interleave(4, 0).repeat_interleave(4, 1)
    assert bool(((deq.view(8, 12) - x).abs() <= step / 2 * (1 + 1e-6)).all())
    grid = torch.randint(-127, 128, (8, 12)).float() * 0.5  # representable: s = 0.5 per block
    grid[0, 0] = grid[0, 4] = grid[0, 8] = grid[4, 0] = grid[4, 4] = grid[4, 8] = 127 * 0.5
    assert torch.equal(ours(grid, block, torch.int8)[2], grid.reshape(-1))


def test_accumulate_adds_dequantized_values():
    block = QuantBlock(1, 256, 0)
    x = torch.randn(600)
    codes, scales, deq, _ = ours(x, block, torch.float8_e4m3fn)
    out = torch.ones(600)
    dequantize(codes, scales, block, out, accumulate=True)
    assert torch.equal(out, 1 + deq)


def test_non_finite_values_leave_a_non_finite_scale():
    x = torch.randn(4, 8)
    x[2, 5] = float("nan")
    _, scales, _, _ = ours(x, QuantBlock(2, 4, 8), torch.int8)
    assert torch.isfinite(scales).tolist() == [True, True, True, False]


def test_quant_block_follows_the_policy_or_the_block_size():
    policy = rf.RaggedShard(block_size=32, overrides={"emb": (8, 16), "head": "whole"})
    assert quant_block("w", (64, 48), policy) == QuantBlock(32, 32, 48)
    assert quant_block("emb", (64, 48), policy) == QuantBlock(8, 16, 48)
    assert quant_block("head", (64, 48), policy) == QuantBlock(128, 128, 48)
    assert quant_block("w", (64, 48), policy, 16) == QuantBlock(16, 16, 48)
    assert quant_block("w", (96,), policy) == QuantBlock(1, 32, 0)
    assert quant_block("w", (8, 3, 3, 3), policy) == QuantBlock(32, 32, 27)  # conv: filter rows
    assert quant_block("w", (), policy) == QuantBlock(1, 1, 0)
    element = rf.RaggedShard()
    assert quant_block("w", (64, 48), element) == QuantBlock(1, 256, 0)
    assert quant_block("w", (64, 48), element, (4, 8)) == QuantBlock(4, 8, 48)
    assert quant_block("b", (10,), element) == QuantBlock(1, 256, 0)
    with pytest.raises(ValueError, match=r"'w' of shape \[64, 48\].*48.*does not divide"):
        quant_block("w", (64, 48), policy, 48)
    with pytest.raises(ValueError, match=r"\(32, 24\) does not divide"):
        quant_block("w", (64, 48), policy, (32, 24))


def test_comm_compression_validates():
    comp = rf.CommCompression(all_gather=torch.float8_e4m3fn, block_size=[4, 8])
    assert comp.block_size == (4, 8) and comp.enabled
    assert not rf.CommCompression().enabled
    with pytest.raises(ValueError, match=r"all_gather=torch.uint8 is not supported.*torch 2"):
        rf.CommCompression(all_gather=torch.uint8)
    with pytest.raises(ValueError, match=r"reduce_scatter=torch.bfloat16"):
        rf.CommCompression(reduce_scatter=torch.bfloat16)
    with pytest.raises(ValueError, match=r"all_gather=torch.float8_e5m2"):
        rf.CommCompression(all_gather=torch.float8_e5m2)
    with pytest.raises(ValueError, match="block_size"):
        rf.CommCompression(all_gather=torch.int8, block_size=(4, 0))
    with pytest.raises(ValueError, match=r"error_feedback=True.*reduce_scatter"):
        rf.CommCompression(all_gather=torch.int8, error_feedback=True)
    with pytest.raises(ValueError, match=r"residual_storage must be one of.*'fp16'"):
        rf.CommCompression(reduce_scatter=torch.int8, residual_storage="fp16")  # type: ignore[arg-type]


def test_planner_units_keep_quantization_blocks_whole():
    comp = rf.CommCompression(all_gather=torch.int8)
    element = rf.StructAwarePlanner(compression=comp)
    assert element.unit_numel("w", (64, 48)) == 256
    assert element.unit_numel("tiny", (3, 5)) == 15  # smaller than a block: whole
    tiles = rf.StructAwarePlanner(shard_policy=rf.RaggedShard(block_size=(8, 16)))
    tiled = rf.StructAwarePlanner(
        shard_policy=rf.RaggedShard(block_size=(8, 16)),
        compression=rf.CommCompression(all_gather=torch.int8, block_size=(4, 16)),
    )
    assert tiles.unit_numel("w", (64, 48)) == tiled.unit_numel("w", (64, 48)) == 8 * 48
    muon = rf.StructAwarePlanner(optimizer_type="adamw8bit", compression=comp)
    assert muon.unit_numel("b", (1000,)) == 256
    assert rf.StructAwarePlanner(compression=rf.CommCompression()).compression is None
    strict = rf.StructAwarePlanner(
        shard_policy=rf.RaggedShard(padding_strategy="error"), compression=comp
    )
    with pytest.raises(ValueError, match="quantization block"):
        strict.unit_numel("w", (10, 10))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_codec_pieces_are_whole_blocks_and_encode_like_one_process(world):
    """Encoding each rank's shard gives, in rank order, the single-process codes and scales."""
    policy = rf.RaggedShard()
    comp = rf.CommCompression(all_gather=torch.int8, block_size=(4, 8))
    planner = rf.StructAwarePlanner(shard_policy=policy, compression=comp)
    params = {"a": torch.randn(13, 20), "b": torch.randn(2, 8), "c": torch.randn(300)}
    plan = planner.plan(params, world)
    codec = BucketCodec(plan, policy, comp.block_size)
    flat = torch.zeros(plan.total_numel)
    for name, value in params.items():
        offset = plan.entries[name].offset
        flat[offset : offset + value.numel()] = value.reshape(-1)
    messages = torch.zeros(world, codec.message_bytes, dtype=torch.uint8)
    for rank in range(world):
        shard = flat[rank * plan.shard_numel : (rank + 1) * plan.shard_numel]
        codec.encode(shard, rank, messages[rank], torch.int8)
    for name, value in params.items():
        block = quant_block(name, value.shape, policy, comp.block_size)
        ref_codes, ref_scales, _ = reference(value, block, torch.int8)
        pieces = [(r, p) for r in range(world) for p in codec.pieces[r] if p.name == name]
        codes = torch.cat([codec.codes(messages[r], torch.int8)[p.elements] for r, p in pieces])
        scales = torch.cat([codec.scales(messages[r])[p.scales] for r, p in pieces])
        assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)


def test_codec_rejects_a_plan_that_cuts_a_block():
    plan = rf.StructAwarePlanner().plan({"w": torch.empty(64, 47)}, 3)  # element units
    with pytest.raises(ValueError, match=r"'w'.*inside a quantization block.*compression="):
        BucketCodec(plan, rf.RaggedShard(), None)


def test_128x128_tiles_move_a_quarter_of_fp32():
    policy = rf.RaggedShard(block_size=128)
    comp = rf.CommCompression(all_gather=torch.int8)
    plan = rf.StructAwarePlanner(shard_policy=policy, compression=comp).plan({"w": (1024, 1024)}, 2)
    codec = BucketCodec(plan, policy, None)
    assert codec.scale_counts == [4 * 8, 4 * 8]  # 4 tile rows of 8 tiles per rank
    assert codec.message_bytes == 512 * 1024 + 4 * 32
    assert codec.message_bytes / (4 * plan.shard_numel) == pytest.approx(0.25, rel=1e-3)


def accumulated_error(storage: str | None, steps: int, dtype=torch.float8_e5m2) -> float:
    """Sum of ``steps`` quantized copies of one fixed gradient against the true sum, through a
    bucket's reduce-scatter quantization (one rank) with residuals stored as ``storage``."""
    comp = rf.CommCompression(
        reduce_scatter=dtype, error_feedback=storage is not None, residual_storage=storage or "int8"
    )
    policy = rf.RaggedShard(block_size=(4, 8))
    plan = rf.StructAwarePlanner(shard_policy=policy, compression=comp).plan({"w": (16, 24)}, 1)
    codec = BucketCodec(plan, policy, comp.block_size)
    residual = Residual(codec, comp.residual_storage, torch.device("cpu")) if storage else None
    gradient = torch.randn(plan.total_numel, generator=torch.Generator().manual_seed(0))
    message = torch.empty(codec.message_bytes, dtype=torch.uint8)
    total = torch.zeros(plan.total_numel)
    for _ in range(steps):
        quantize_gradient(codec, dtype, residual, gradient, message)
        codec.decode(message, 0, total, dtype, accumulate=True)
    return (total - steps * gradient).abs().max().item()


@pytest.mark.parametrize("storage", ["fp32", "bf16", "int8"])
def test_error_feedback_drives_the_accumulated_error_towards_zero(storage):
    one_step = accumulated_error(None, 1)
    assert accumulated_error(None, 64) > 30 * one_step  # without: the bias adds up
    # With it the sum's error stays about one step's, so the mean's goes to zero as 1/steps.
    assert accumulated_error(storage, 64) <= 1.5 * one_step
