"""The capacity planner under compressed communication: each bucket's message is the runtime
codec's, byte for byte; the residuals and quantized shards count what the runtime keeps; the
bytes per step shrink to codes and scales and quantizing shows in the step time; ``raggedfsdp
plan`` takes ``raggedfsdp train``'s compression flags. (That the prediction equals a real run's
``wire_bytes`` is asserted in ``test_train_compression.py``.)"""

from __future__ import annotations

import json

import pytest
import torch

import raggedfsdp as rf
from raggedfsdp.capacity.capacity import CapacityOptions, capacity_report
from raggedfsdp.capacity.hardware import hardware
from raggedfsdp.capacity.wire import CODE_DTYPES, CompressionSpec, message_bytes
from raggedfsdp.cli import main
from raggedfsdp.layout import RaggedShard
from raggedfsdp.models import GPT, GPT_CONFIGS
from raggedfsdp.planner import StructAwarePlanner
from raggedfsdp.runtime.compression import BucketCodec, Residual
from raggedfsdp.train import config as train_config

BOTH = CompressionSpec(all_gather=torch.float8_e4m3fn, reduce_scatter=torch.int8)


@pytest.mark.parametrize("policy", [None, 4, (4, 8), "whole"])
@pytest.mark.parametrize("world", [1, 2, 3, 5, 16])  # 16: parameters over many ranks
def test_message_bytes_are_the_runtime_codec(policy, world):
    shard = RaggedShard(block_size=policy)
    comp = rf.CommCompression(all_gather=torch.int8, reduce_scatter=torch.int8)
    module = GPT(GPT_CONFIGS["gpt-tiny"], device="meta")
    plans = StructAwarePlanner(shard_policy=shard, compression=comp).plan_model(module, world)
    for plan in plans:
        codec = BucketCodec(plan, shard, None)
        assert message_bytes(plan, shard, None) == codec.message_bytes, plan.name


@pytest.mark.parametrize("storage", ["int8", "bf16", "fp32"])
def test_compression_state_is_what_the_runtime_keeps(storage):
    shard = RaggedShard(block_size=4)
    comp = rf.CommCompression(
        all_gather=torch.int8,
        reduce_scatter=torch.int8,
        error_feedback=True,
        residual_storage=storage,
    )
    options = CapacityOptions(batch=1, seq_len=8, block_size=4, compression=comp)
    report = capacity_report("gpt-tiny", [3], hardware("cpu-gloo"), options, find_smallest=False)
    module = GPT(GPT_CONFIGS["gpt-tiny"], device="meta")
    plans = StructAwarePlanner(shard_policy=shard, compression=comp).plan_model(module, 3)
    runtime = 0
    for plan in plans:
        codec = BucketCodec(plan, shard, comp.block_size)
        residual = Residual(codec, comp.residual_storage, torch.device("cpu"))
        runtime += residual.nbytes + codec.message_bytes  # + the quantized shard
    assert report.worlds[0].systems["raggedfsdp"].memory.compression == runtime
    assert report.worlds[0].systems["fsdp2"].memory.compression == 0


def test_bytes_shrink_to_codes_and_scales_and_quantizing_costs_time():
    def cost(compression):
        options = CapacityOptions(batch=1, seq_len=64, block_size=32, compression=compression)
        report = capacity_report(
            "gpt-small", [2], hardware("cpu-gloo"), options, find_smallest=False
        )
        return report.worlds[0].systems["raggedfsdp"]

    plain, both = cost(None), cost(BOTH)
    # 8-bit codes and one fp32 scale per 32 x 32 tile (per run of 32 for 1-D parameters)
    ratio = both.bytes.wire_bytes / plain.bytes.wire_bytes
    assert 0.25 < ratio < 0.252, ratio
    assert both.bytes.all_gather_calls == plain.bytes.all_gather_calls
    assert plain.time.codec_s == 0 < both.time.codec_s
    assert both.time.total_s == pytest.approx(
        both.time.forward_s + both.time.backward_s + both.time.optimizer_s + both.time.codec_s
    )
    assert plain.memory.compression == 0 < both.memory.compression


def test_plan_flags_are_train_spellings(capsys):
    assert train_config.CODE_DTYPES is CODE_DTYPES
    argv = ["plan", "--model", "gpt-tiny", "--world", "2", "--json"]
    flags = ["--compress-all-gather", "fp8", "--compress-reduce-scatter", "int8"]
    assert main([*argv, *flags, "--error-feedback"]) == 0
    record = json.loads(capsys.readouterr().out)[0]
    assert record["compression"] == "all-gather float8_e4m3fn, reduce-scatter int8, error feedback"
    assert record["raggedfsdp"]["memory"]["compression"] > 0
    assert record["raggedfsdp"]["time"]["codec_s"] > 0
    assert main([*argv, "--error-feedback"]) == 2
    assert "error feedback needs reduce-scatter compression" in capsys.readouterr().err
    assert main([*argv, "--compress-all-gather", "fp8_e5m2"]) == 2  # not an all-gather code
    assert "invalid choice: 'fp8_e5m2'" in capsys.readouterr().err
