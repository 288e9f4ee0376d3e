"""The capacity planner's CPU-offload split against the runtime's own counters: real Gloo ranks
on the offload copy path (``DBufferConfig(host_copies_on_cpu=True)``, the same code an
accelerator runs), W = 2 and 3 (one launch for both, every case inside it), two models, two
optimizers, and two variants (bf16 mixed precision, an int8 reduce-scatter with error feedback)
that put something besides the unsharded units on the device. Predicted host bytes equal
``stats()["offloaded_bytes"]``, the device's persistent bytes ``persistent_bytes -
offloaded_bytes``, the host optimizer state the optimizer's own, and the unsharded high-water
mark (with bf16's pooled staging) the runtime's, exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy

import raggedfsdp as rf
from harness import world_grid_fixture
from raggedfsdp.capacity.cost import (
    MemoryBreakdown,
    StepShape,
    memory_breakdown,
    optimizer_state_bytes,
    unit_bytes,
)
from raggedfsdp.capacity.shapes import model_shape
from raggedfsdp.capacity.wire import CompressionSpec, message_bytes
from raggedfsdp.models import GPT, GPT_CONFIGS
from raggedfsdp.planner import StructAwarePlanner
from raggedfsdp.train.build import optimizer_bytes

WORLDS = (2, 3)
BATCH = 2
#: name -> (model, optimizer, variant)
CASES = {
    "tiny-adamw": ("gpt-tiny", "adamw", None),
    "tiny-adamw8bit": ("gpt-tiny", "adamw8bit", None),
    "small-adamw": ("gpt-small", "adamw", None),
    "small-adamw8bit": ("gpt-small", "adamw8bit", None),
    "tiny-adamw-bf16": ("gpt-tiny", "adamw", "bf16"),
    "tiny-adamw-int8-ef": ("gpt-tiny", "adamw", "int8-ef"),
}
_INT8_EF = rf.CommCompression(reduce_scatter=torch.int8, error_feedback=True)


def _planner(optimizer: str, variant: str | None) -> StructAwarePlanner:
    return StructAwarePlanner(
        optimizer_type=None if optimizer == "adamw" else optimizer,  # type: ignore[arg-type]
        compression=_INT8_EF if variant == "int8-ef" else None,
    )


def _step(rank: int, world: int, case: str) -> dict[str, int]:
    """One step of ``case`` under offload; the counters after the optimizer step (gradients
    still held, as between the reduce-scatter and ``zero_grad``)."""
    model_name, optimizer, variant = CASES[case]
    torch.manual_seed(0)
    cfg = GPT_CONFIGS[model_name]
    model = GPT(cfg)
    kwargs: dict[str, Any] = {
        "planner": _planner(optimizer, variant),
        "offload_policy": CPUOffloadPolicy(pin_memory=False),
        "dbuffer_config": rf.DBufferConfig(host_copies_on_cpu=True),
    }
    if variant == "bf16":
        kwargs["mp_policy"] = rf.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if variant == "int8-ef":
        kwargs["compression"] = _INT8_EF
    for block in model.blocks:
        rf.fully_shard(block, **kwargs)
    rf.fully_shard(model, **kwargs)
    opt_class = torch.optim.AdamW if optimizer == "adamw" else rf.optim.AdamW8bit
    opt = opt_class(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len), generator=g)
    model(idx, idx).backward()
    opt.step()
    stats = model.stats()
    return {
        "persistent_bytes": int(stats["persistent_bytes"]),
        "offloaded_bytes": int(stats["offloaded_bytes"]),
        "peak_unsharded_bytes": int(stats["peak_unsharded_bytes"]),
        "optimizer_state_bytes": optimizer_bytes(opt),
    }


def _cases(rank: int, world: int, group: None = None) -> dict[str, dict[str, int]]:
    torch.set_num_threads(1)
    return {case: _step(rank, world, case) for case in CASES}


# One launch for both world sizes, each as if launched on its own (``fully_shard``'s mesh must
# cover the whole group: harness.run_world_grid remakes it), every case inside it.
grid = world_grid_fixture(_cases, WORLDS, as_launches=True, timeout=600)


def predict(case: str, world: int, rank: int, *, offload: bool = True) -> MemoryBreakdown:
    """The capacity planner's figures for one rank of ``case``."""
    model_name, optimizer, variant = CASES[case]
    cfg = GPT_CONFIGS[model_name]
    module = GPT(cfg, device="meta")
    bf16 = variant == "bf16"
    plans = _planner(optimizer, variant).plan_model(
        module, world, dtype=torch.bfloat16 if bf16 else None
    )
    spec = CompressionSpec.parse(None, "int8", True) if variant == "int8-ef" else None
    messages = None
    if spec is not None:
        policy = rf.RaggedShard()
        messages = [message_bytes(p, policy, spec.block_size) for p in plans]
    units = unit_bytes(plans, messages)
    step = StepShape(
        batch=BATCH,
        seq_len=cfg.seq_len,
        param_dtype=torch.bfloat16 if bf16 else torch.float32,
        gloo=True,
        compression=spec,
        offload=offload,
    )
    state = optimizer_state_bytes(plans, optimizer, rank=rank)
    return memory_breakdown(model_shape(module), units, step, state, world_size=world)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", CASES)
def test_offloaded_and_device_bytes_match_the_runtime(grid, world, case):
    optimizer = CASES[case][1]
    for rank, results in enumerate(grid[world]):
        got = results[case]
        where = f"{case} W={world} rank {rank}"
        want = predict(case, world, rank)
        assert got["offloaded_bytes"] > 0, where
        assert want.offloaded == got["offloaded_bytes"], where
        # the device's persistent bytes, as the runtime counts them (it leaves out the Gloo
        # reduce-scatter's cached divisor, which the planner counts on the device)
        device = got["persistent_bytes"] - got["offloaded_bytes"]
        assert want.device_persistent - want.constants == device, where
        # the host's optimizer state is the optimizer's own (AdamW8bit's tables aside)
        tables = optimizer_state_bytes([], optimizer) if optimizer == "adamw8bit" else 0
        assert want.host - want.offloaded - tables == got["optimizer_state_bytes"], where
        if CASES[case][2] != "int8-ef":  # the compressed reduce-scatter's own scratch aside
            assert want.unsharded_peak == got["peak_unsharded_bytes"], where


def test_the_variants_put_bytes_on_the_device(grid):
    """Error feedback's residuals stay on the device (a split worth checking); bf16's staging
    shows in the runtime's unsharded high-water mark."""
    for rank, results in enumerate(grid[2]):
        got = results["tiny-adamw-int8-ef"]
        assert got["persistent_bytes"] - got["offloaded_bytes"] > 0
        assert predict("tiny-adamw-bf16", 2, rank).staging > 0


@pytest.mark.parametrize("world", WORLDS)
def test_negative_control_without_offload_the_split_is_wrong(grid, world):
    """The prediction without offload puts everything on the device: it must not match."""
    for rank, results in enumerate(grid[world]):
        got = results["small-adamw"]
        plain = predict("small-adamw", world, rank, offload=False)
        assert plain.offloaded != got["offloaded_bytes"]
        assert plain.device_persistent - plain.constants != (
            got["persistent_bytes"] - got["offloaded_bytes"]
        )
        # ... and its device peak is larger by the shards and the optimizer state
        offloaded = predict("small-adamw", world, rank)
        assert plain.peak - offloaded.peak == plain.params + plain.optimizer
