"""The capacity planner's memory under bf16 parameters with an fp32 reduction against the runtime's
own counters, as tests/distributed/test_capacity_measured.py does for fp32: each unit's
unsharded gradient is cast to fp32 for its reduce-scatter (a pooled block, ``W S`` fp32 per
trainable bucket, held while the reduce-scatter is in flight), and on Gloo the receive buffer
and the divisor are fp32 too. Real Gloo ranks, the bench's memory phase, W = 2 and 3."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import raggedfsdp as rf
from harness import run_distributed
from raggedfsdp.bench.memory import memory_phase
from raggedfsdp.bench.options import BenchOptions
from raggedfsdp.bench.systems import Runner
from raggedfsdp.capacity.cost import StepShape, memory_breakdown, optimizer_state_bytes, unit_bytes
from raggedfsdp.capacity.shapes import model_shape
from raggedfsdp.models import GPT, GPT_CONFIGS

pytestmark = pytest.mark.slow

BATCH = 2
MODEL = "gpt-small"
BF16_FP32 = rf.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _build(name: str, options: BenchOptions, device: torch.device) -> Runner:
    torch.manual_seed(options.seed)
    model = GPT(GPT_CONFIGS[options.model], device=device)
    rf.FSDPBackend(model, mp_policy=BF16_FP32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.lr)
    return Runner(name, model, optimizer, device, model.stats, model.reset_stats)


def _measure(rank: int, world: int) -> dict[str, int]:
    torch.set_num_threads(1)
    options = BenchOptions(model=MODEL, world=world, batch_size=BATCH, systems=("raggedfsdp",))
    result = memory_phase(rank, world, options, "raggedfsdp", _build)
    return {k: v for k, v in result.items() if isinstance(v, int)}


def _predict(world: int, rank: int, *, reduce_dtype: torch.dtype | None = torch.float32):
    module = GPT(GPT_CONFIGS[MODEL], device="meta")
    plans = rf.StructAwarePlanner().plan_model(module, world, dtype=torch.bfloat16)
    step = StepShape(
        batch=BATCH,
        seq_len=GPT_CONFIGS[MODEL].seq_len,
        param_dtype=torch.bfloat16,
        reduce_dtype=reduce_dtype,
        gloo=True,
    )
    state = optimizer_state_bytes(plans, "adamw", rank=rank)
    return memory_breakdown(model_shape(module), unit_bytes(plans), step, state, world_size=world)


@pytest.mark.parametrize("world", [2, 3])
def test_fp32_reduce_of_bf16_gradients_matches_the_runtime(world):
    measured = run_distributed(_measure, world, timeout=600)
    for rank, got in enumerate(measured):
        where = f"{MODEL} bf16/fp32 W={world} rank {rank}"
        want = _predict(world, rank)
        assert got["framework_persistent_bytes"] == want.params + want.grads, where
        # the runtime's unsharded high-water mark: its pooled fp32 cast counted, exactly
        assert got["framework_peak_unsharded_bytes"] == want.unsharded_peak, where
        assert 0 <= got["tensor_at_step_start_bytes"] - want.persistent <= 1024, where
        peak = got["tensor_peak_bytes"]
        assert abs(want.peak - peak) <= 0.05 * peak, (where, want.peak, peak)
        # Negative control: without the cast (reduce in bf16) the high-water mark is lower.
        uncast = _predict(world, rank, reduce_dtype=None)
        assert uncast.unsharded_peak < got["framework_peak_unsharded_bytes"], where


def test_cast_is_counted_only_when_the_dtypes_differ():
    """Pure: the cast's bytes are the difference between the two predictions."""
    world = 4
    cast, plain = _predict(world, 0), _predict(world, 0, reduce_dtype=None)
    same = _predict(world, 0, reduce_dtype=torch.bfloat16)
    assert dataclasses.asdict(same) == dataclasses.asdict(plain)
    assert cast.unsharded_peak > plain.unsharded_peak
    assert cast.constants == 4 and plain.constants == 2  # the Gloo divisor in the reduce dtype
