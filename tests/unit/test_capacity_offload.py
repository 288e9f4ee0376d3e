"""The capacity planner under CPU offload, by hand (pure logic, one process): where each byte
lives, the host <-> device copies and the host optimizer step on small made-up units, the
presets' host figures, the command's output and its errors. The split against the runtime's
counters is tests/distributed/test_capacity_offload_measured.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from raggedfsdp.capacity.capacity import CapacityOptions, plan_capacity
from raggedfsdp.capacity.cost import (
    StepShape,
    UnitBytes,
    memory_breakdown,
    optimizer_state_bytes,
    unit_bytes,
)
from raggedfsdp.capacity.hardware import HARDWARE, hardware
from raggedfsdp.capacity.shapes import model_shape
from raggedfsdp.capacity.steptime import host_copy_bytes, step_time
from raggedfsdp.cli import main
from raggedfsdp.facts import RAGGEDFSDP, Stream
from raggedfsdp.models import GPT, GPT_CONFIGS
from raggedfsdp.planner import StructAwarePlanner

#: gpt-tiny's three units (two blocks, the root with a frozen bucket), with round numbers:
#: (path, each bucket's S, trainable, FSDP2's padded shard, parameter elements)
UNITS = [
    UnitBytes("blocks.0", (1000,), (True,), 1100, 2000),
    UnitBytes("blocks.1", (1000,), (True,), 1100, 2000),
    UnitBytes("", (3000, 500), (True, False), 3200, 7000),
]
SHAPE = model_shape(GPT(GPT_CONFIGS["gpt-tiny"], device="meta"))


def _step(**kw) -> StepShape:
    return StepShape(batch=1, seq_len=64, **kw)


def test_offload_moves_shards_gradients_and_state_to_the_host():
    plain = memory_breakdown(SHAPE, UNITS, _step(), 1000, world_size=4)
    off = memory_breakdown(SHAPE, UNITS, _step(offload=True), 1000, world_size=4)
    assert off.params == plain.params == 4 * 5500 and off.grads == 4 * 5000
    assert off.offloaded == 4 * 10500 and plain.offloaded == 0
    assert off.host == 4 * 10500 + 1000 and plain.host == 0
    assert off.device_persistent == 0 and plain.device_persistent == plain.persistent
    # the device keeps the unsharded units and activations; fp32: nothing to stage
    assert off.staging == 0
    assert off.peak == off.unsharded + off.activations
    assert plain.peak - off.peak == plain.params + 1000
    # the Gloo divisor stays on the device
    gloo = memory_breakdown(SHAPE, UNITS, _step(offload=True, gloo=True), 0, world_size=4)
    assert gloo.device_persistent == gloo.constants == 4


def test_offload_with_a_cast_stages_one_master_buffer_per_shard_size():
    bf16 = _step(offload=True, param_dtype=torch.bfloat16)
    ours = memory_breakdown(SHAPE, UNITS, bf16, 0, world_size=4)
    assert ours.staging == 4 * (1000 + 3000 + 500)  # distinct S: 1000 (twice), 3000, 500
    plain = memory_breakdown(SHAPE, UNITS, _step(param_dtype=torch.bfloat16), 0, world_size=4)
    assert ours.unsharded_peak == plain.unsharded_peak + ours.staging
    assert ours.peak == ours.unsharded + ours.staging + ours.activations


def test_fsdp2_offload_holds_padded_host_shards_and_copies_the_prefetch():
    off = memory_breakdown(SHAPE, UNITS, _step(offload=True), 0, world_size=4, system="fsdp2")
    plain = memory_breakdown(SHAPE, UNITS, _step(), 0, world_size=4, system="fsdp2")
    assert off.host == off.offloaded == 2 * 4 * (1100 + 1100 + 3200)
    assert off.staging == 0
    if off.phase == "block":  # the prefetched block's padded shards, copied in (fp32)
        assert off.unsharded == plain.unsharded + 4 * 1100


def test_copy_bytes_by_hand():
    h2d, d2h = host_copy_bytes(UNITS, _step(offload=True))
    assert h2d == [4000, 4000, 14000] and d2h == [4000, 4000, 12000]  # frozen: not reduced
    h2d, d2h = host_copy_bytes(UNITS, _step(offload=True), "fsdp2")
    assert h2d == [4400, 4400, 12800] and d2h == [4400, 4400, 12800]
    assert host_copy_bytes(UNITS, _step()) == ([0, 0, 0], [0, 0, 0])
    # master bytes move; the cast to bf16 happens on the device
    h2d, _ = host_copy_bytes(UNITS, _step(offload=True, param_dtype=torch.bfloat16))
    assert h2d == [4000, 4000, 14000]


def _times(system: str, world: int = 4):
    hw = hardware("h100", pcie_bytes_per_s=1e6, host_memory_bytes_per_s=8e6)
    kw = {"optimizer_bytes": 1000, "system": system}
    plain = step_time(SHAPE, UNITS, _step(), hw, world, **kw)
    off = step_time(SHAPE, UNITS, _step(offload=True), hw, world, **kw)
    return plain, off


def test_raggedfsdp_copies_run_in_series_with_its_collectives():
    """raggedfsdp copies on the copy-in and reduce-scatter streams (runtime/_param_group.py,
    held to the runtime by tests/distributed/test_facts_conformance.py): every gather's H2D
    (forward: 3 units; backward: blocks.0 again) and every reduce's D2H, (1000 + 1000 + 3500 +
    1000 + 1000 + 1000 + 3000) x 4 B at 1 MB/s, lengthen its collectives, not the compute
    stream."""
    plain, off = _times("raggedfsdp")
    assert off.host_copy_s == 0.0
    assert off.comm_s == pytest.approx(plain.comm_s + 46_000 / 1e6)
    # the optimizer on the host: shards read and written, gradients read, state both ways,
    # at the node's host bandwidth shared by its 4 ranks (W = 4 < 8 per node)
    assert off.optimizer_s == pytest.approx((3 * 4 * 5500 + 2 * 1000) / (8e6 / 4))
    assert off.total_s > plain.total_s + off.optimizer_s - plain.optimizer_s
    # past a node, 8 ranks share its host memory
    _, wide = _times("raggedfsdp", world=16)
    assert wide.optimizer_s == pytest.approx((3 * 4 * 5500 + 2 * 1000) / (8e6 / 8))


def test_copies_on_the_compute_stream_add_to_the_step():
    """A system that copied on the compute stream (raggedfsdp's description before the
    runtime's streams) would pay the same 46,000 B at 1 MB/s on the step itself, its
    collectives unchanged."""
    copies = dataclasses.replace(
        RAGGEDFSDP.host_copies, to_device=Stream.COMPUTE, to_host=Stream.COMPUTE
    )
    on_compute = dataclasses.replace(RAGGEDFSDP, name="on-compute", host_copies=copies)
    hw = hardware("h100", pcie_bytes_per_s=1e6, host_memory_bytes_per_s=8e6)
    kw = {"optimizer_bytes": 1000, "system": on_compute}
    plain = step_time(SHAPE, UNITS, _step(), hw, 4, **kw)
    off = step_time(SHAPE, UNITS, _step(offload=True), hw, 4, **kw)
    assert off.host_copy_s == pytest.approx(46_000 / 1e6)
    assert off.total_s == pytest.approx(
        plain.total_s + off.host_copy_s + off.optimizer_s - plain.optimizer_s
    )
    assert off.comm_s == pytest.approx(plain.comm_s)
    assert off.exposed_comm_s == pytest.approx(plain.exposed_comm_s)


def test_fsdp2_copies_run_in_series_with_its_collectives():
    """FSDP2 copies on its collectives' streams: they lengthen the collectives (forward: 3
    gathers; backward: both blocks again; reduces of all 3 units), not the compute stream."""
    plain, off = _times("fsdp2")
    assert off.host_copy_s == 0.0
    copies = (4 * (1100 + 1100 + 3200 + 1100 + 1100) + 4 * (1100 + 1100 + 3200)) / 1e6
    assert off.comm_s == pytest.approx(plain.comm_s + copies)
    assert off.total_s > plain.total_s


def test_presets_have_sourced_host_figures():
    for name, pcie, host in (
        ("h100", 64e9, 614.4e9),
        ("h200", 64e9, 614.4e9),
        ("a100", 32e9, 409.6e9),
        ("b200", 64e9, 716.8e9),
    ):
        hw = HARDWARE[name]
        assert (hw.pcie_bytes_per_s, hw.host_memory_bytes_per_s) == (pcie, host)
        assert hw.host_memory_bytes == 2 * 1024**4  # the DGX systems' 2 TB
        assert hw.offload_rates(2) == (pcie, host / 2)
        assert hw.offload_rates(1024) == (pcie, host / 8)
    cpu = HARDWARE["cpu-gloo"]
    assert cpu.pcie_bytes_per_s is None and cpu.host_memory_bytes_per_s is None
    assert cpu.host_memory_bytes is None


def test_offload_fits_only_where_the_node_has_the_host_ram():
    """gpt-tiny's host bytes against a node's host RAM: it fits at the limit, not a byte below
    it; the device side alone would fit both times (the negative control)."""
    module = GPT(GPT_CONFIGS["gpt-tiny"], device="meta")
    options = CapacityOptions(batch=1, seq_len=64, offload=True, reserve=0.0)
    cost = plan_capacity(module, SHAPE, 16, HARDWARE["h100"], options).systems["raggedfsdp"]
    assert cost.fits and cost.host_fits and cost.host_per_node == 8 * cost.memory.host
    for ram, fits in ((cost.host_per_node, True), (cost.host_per_node - 1, False)):
        hw = hardware("h100", host_memory_bytes=ram)
        got = plan_capacity(module, SHAPE, 16, hw, options).systems["raggedfsdp"]
        assert (got.fits, got.host_fits) == (fits, fits)
        assert got.memory.peak <= hw.memory_bytes  # the device alone fits


def test_plan_command_says_when_the_host_ram_is_short(capsys):
    argv = ["plan", "--model", "deepseek-v3-671b", "--world", "8", "--gpu", "h100", "--json"]
    assert main([*argv, "--offload"]) == 0
    (record,) = json.loads(capsys.readouterr().out)
    ours = record["raggedfsdp"]
    assert ours["host_per_node"] > 2 * 1024**4 * 0.9 and not ours["host_fits"]
    assert not ours["fits"]
    assert main([*argv[:-1], "--offload"]) == 0
    out = capsys.readouterr().out
    assert "NO (host RAM of the node)" in out
    assert "usable: 67.1 GiB per device, 1.8 TiB of host RAM per node (8 ranks a node)" in out


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: HARDWARE["cpu-gloo"].offload_rates(2), "--offload .* 'cpu-gloo' has none"),
        (
            lambda: plan_capacity(
                GPT(GPT_CONFIGS["gpt-tiny"], device="meta"),
                SHAPE,
                2,
                HARDWARE["cpu-gloo"],
                CapacityOptions(batch=1, seq_len=64, offload=True),
            ),
            "the host already",
        ),
        (lambda: hardware("h100", pcie_bytes_per_s=0), "pcie_bytes_per_s must be positive"),
        (
            lambda: step_time(
                SHAPE, UNITS, _step(offload=True), HARDWARE["cpu-gloo"], 2, optimizer_bytes=0
            ),
            "nothing to offload",
        ),
    ],
)
def test_offload_without_a_host_link_is_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpu", "cpu-gloo", "--offload"], "--offload needs a device with a host"),
        (["--gpu", "h100", "--pin-memory"], "--pin-memory pins the host copies of --offload"),
    ],
)
def test_plan_command_offload_errors_name_the_flag(capsys, flags, message):
    assert main(["plan", "--model", "gpt-tiny", "--world", "2", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err
    assert len(captured.err.strip().splitlines()) == 1


def test_plan_command_offload_json(capsys):
    argv = ["plan", "--model", "gpt-tiny", "--world", "2,16", "--gpu", "h100", "--json"]
    assert main([*argv, "--dtype", "float32"]) == 0
    without = json.loads(capsys.readouterr().out)
    assert main([*argv, "--offload", "--pin-memory", "--dtype", "float32"]) == 0
    records = json.loads(capsys.readouterr().out)
    module = GPT(GPT_CONFIGS["gpt-tiny"], device="meta")
    for record, plain in zip(records, without, strict=True):
        w = record["world_size"]
        assert record["offload"] and record["pin_memory"]
        assert record["smallest_world"] == 1 and record["smallest_world_without_offload"] == 1
        plans = StructAwarePlanner().plan_model(module, w)
        want = memory_breakdown(
            model_shape(module),
            unit_bytes(plans),
            StepShape(batch=1, seq_len=64, offload=True),
            optimizer_state_bytes(plans, "adamw"),
            world_size=w,
        )
        ours = record["raggedfsdp"]
        assert ours["memory"] == want.to_dict()
        assert ours["host_per_node"] == want.host * min(w, 8)
        # both systems copy on their collectives' streams: the copies lengthen the
        # collectives, none holds up the compute stream
        for name in ("raggedfsdp", "fsdp2"):
            assert record[name]["time"]["host_copy_s"] == 0
            assert record[name]["time"]["comm_s"] > plain[name]["time"]["comm_s"]


def test_plan_command_offload_table(capsys):
    argv = ["plan", "--model", "llama3-8b", "--world", "8", "--gpu", "h100", "--seq", "8192"]
    assert main([*argv, "--offload"]) == 0
    out = capsys.readouterr().out
    for text in (
        "raggedfsdp device",
        "raggedfsdp host",
        "fsdp2 host",
        "per node",
        "device peak",
        "CPU offload (pageable)",
        "host <-> device copies",
        "smallest power-of-two W that fits with CPU offload",
        "(without offload:",
    ):
        assert text in out, text
