"""Compressed all-gather cases run on every rank (``test_compression.py`` judges them): the
parameters forward sees, the single-process quantize-dequantize they must equal, and each rank's
codes and scales. ``native-`` cases run NCCL's all-gather of the messages on Gloo
(``gloo_point_to_point=False``) under its asynchrony emulated (``collective_wrap``)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import raggedfsdp as rf
from collective_wrap import emulated_when
from parity_models import OddModel
from raggedfsdp.planner import QuantBlock, quant_block
from raggedfsdp.runtime.compression._quant import dequantize, quantize

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
POLICIES = {"element": None, "tiles4x8": (4, 8), "whole": "whole"}  # rows: rows4-copy


def quant_dequant(x: torch.Tensor, block: QuantBlock, dtype: torch.dtype):
    """Single process: the full tensor quantized and dequantized; also each element's scale."""
    flat = x.detach().reshape(-1).float()
    codes = torch.empty(flat.numel(), dtype=dtype)
    scales = torch.empty(block.num_blocks(flat.numel()))
    quantize(flat, block, codes, scales)
    deq, scale_of = torch.empty_like(flat), torch.empty_like(flat)
    dequantize(codes, scales, block, deq)
    dequantize(torch.ones_like(flat, dtype=torch.int8), scales, block, scale_of)
    return deq.view(x.shape), scale_of.view(x.shape)


def _unsharded_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """What forward sees: every unit unsharded (the root first: it initialises them all)."""
    units = [m for m in model.modules() if isinstance(m, rf.FSDPModule)]
    for unit in units:  # model.modules() order: the root first
        unit.unshard()
    seen = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    for unit in units:
        unit.reshard()
    return seen


def _compressions(model: nn.Module) -> list:
    """Every bucket's quantized all-gather."""
    from raggedfsdp.runtime._hooks import states_under

    return [b.gather for s in states_under(model) for b in s.group.buckets]


def _messages(model: nn.Module) -> dict[str, tuple[bytes, list[float]]]:
    """This rank's codes and scales of each of its pieces, from the quantized shards the
    all-gathers sent (for the comparison across world sizes)."""
    from raggedfsdp.runtime._hooks import states_under

    out = {}
    for state in states_under(model):
        group = state.group
        for bucket in group.buckets:
            codec, message = bucket.gather.codec, bucket.gather._quantized
            assert message is not None
            for piece in codec.pieces[bucket.rank]:
                codes = codec.codes(message, torch.uint8)[piece.elements]
                name = group.qualify(piece.name)  # the codec's names are the unit's own
                out[name] = (bytes(codes.tolist()), codec.scales(message)[piece.scales])
    return out


def _all_gather_case(rank, world, policy, dtype, mp, zero_copy=True, native=False):
    torch.manual_seed(0)
    base = OddModel()
    model = copy.deepcopy(base)
    comp = rf.CommCompression(all_gather=dtype)
    rf.FSDPBackend(
        model,
        shard_policy=rf.RaggedShard(block_size=policy),
        compression=comp,
        mp_policy=mp,
        dbuffer_config=rf.DBufferConfig(
            zero_copy=zero_copy, group_level=zero_copy, gloo_point_to_point=not native
        ),
    )
    with emulated_when(native) as emulation:
        seen = _unsharded_parameters(model)
    messages = _messages(model)
    failures = []
    if _messages(model) is None or messages.keys() != _messages(model).keys():
        failures.append("no quantized shards")
    kept = [c._quantized for c in _compressions(model)]
    _unsharded_parameters(model)  # gathers again: the quantized shards are reused, not remade
    if any(a is not c._quantized for a, c in zip(kept, _compressions(model), strict=True)):
        failures.append("quantized again within one iteration")
    if emulation is not None and emulation.failure():
        failures.append(emulation.failure())
    full = rf.full_state_dict(model)
    for name, got in seen.items():
        block = quant_block(name, got.shape, rf.RaggedShard(block_size=policy))
        want, _ = quant_dequant(full[name], block, dtype)
        if mp is not None:
            want = want.to(mp.param_dtype)
        if got.dtype != want.dtype or not torch.equal(got, want):
            failures.append((name, (got.float() - want.float()).abs().max().item()))
    return failures, messages


def gather_grid(rank: int, world: int):
    results = {}
    bf16 = rf.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for pname, policy in POLICIES.items():
        for dtype in (torch.int8, E4M3):
            results[(pname, str(dtype))] = _all_gather_case(rank, world, policy, dtype, None)
    results[("tiles4x8-bf16", "e4m3")] = _all_gather_case(rank, world, (4, 8), E4M3, bf16)
    # The FSDP2-style copy path with a storage per bucket (scratch blocks not pooled).
    results[("rows4-copy", "int8")] = _all_gather_case(rank, world, 4, torch.int8, None, False)
    # NCCL's calls on Gloo, under its asynchrony emulated.
    for name, policy, dtype, mp in (
        ("tiles4x8", (4, 8), torch.int8, None),
        ("bf16", 4, E4M3, bf16),
    ):
        results[(f"native-{name}", str(dtype))] = _all_gather_case(
            rank, world, policy, dtype, mp, native=True
        )
    return results
