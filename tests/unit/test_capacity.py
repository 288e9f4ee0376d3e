"""The capacity planner's cost model against independent references (pure logic, one process):
FLOPs against torch's FlopCounterMode, optimizer state against real optimizers, activations
against the GPT block's own tensors, the ring formula by hand; presets and bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from raggedfsdp.capacity.capacity import CapacityOptions, capacity_report, plan_capacity
from raggedfsdp.capacity.cost import (
    OPTIMIZERS,
    StepShape,
    activation_bytes,
    memory_breakdown,
    optimizer_state_bytes,
    unit_bytes,
)
from raggedfsdp.capacity.hardware import HARDWARE, hardware
from raggedfsdp.capacity.shapes import model_shape
from raggedfsdp.capacity.steptime import collective_bytes, step_time
from raggedfsdp.cli import main
from raggedfsdp.models import GPT, GPT_CONFIGS, build_model
from raggedfsdp.planner import StructAwarePlanner
from raggedfsdp.train.build import build_optimizer, optimizer_bytes
from raggedfsdp.train.config import TrainConfig


def test_gpt_shape_matches_the_block_it_describes():
    cfg = GPT_CONFIGS["gpt-small"]
    d, v = cfg.d_model, cfg.vocab_size
    shape = model_shape(GPT(cfg, device="meta"))
    assert (shape.hidden, shape.vocab, shape.tied_numel) == (d, v, v * d)
    assert len(shape.blocks) == cfg.n_layer and shape.root.path == ""
    for block in shape.blocks:
        assert block.matmul_numel == 12 * d * d  # q k v 3d², proj d², fc 4d², proj 4d²
        assert block.activation_per_token == 16 * d  # docs: what the GPT block keeps
        assert block.widest_per_token == 4 * d
    assert shape.root.matmul_numel == v * d  # the tied head, once; the lookups are free


class _Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(16, 32, bias=False)
        self.w2 = nn.Linear(32, 16, bias=False)


class _Layer(nn.Module):
    def __init__(self, separate: bool) -> None:
        super().__init__()
        self.attn = nn.Linear(16, 48, bias=False)
        if separate:  # each expert an FSDP unit of its own (an element of a ModuleList)
            self.experts = nn.ModuleList(_Expert() for _ in range(4))
        else:  # fused [E, out, in] stacks
            self.w1 = nn.Parameter(torch.empty(4, 32, 16))
            self.w2 = nn.Parameter(torch.empty(4, 16, 32))


class _MoE(nn.Module):
    def __init__(self, separate: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.layers = nn.ModuleList(_Layer(separate) for _ in range(2))
        self.head = nn.Linear(16, 64, bias=False)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_experts_as_units_cost_what_fused_experts_cost(checkpointing):
    """Experts made FSDP units of their own (nested in their layer's unit) compute and keep
    what the same experts fused into stacks do: a share of experts_per_token / E each, no
    attention of their own, inside their block for checkpointing."""
    with torch.device("meta"):
        separate, fused = (
            model_shape(_MoE(True), experts_per_token=2),
            model_shape(_MoE(False), experts_per_token=2),
        )
    assert len(separate.units) == 2 * 5 + 1 and len(separate.blocks) == len(fused.blocks) == 2
    assert separate.step_flops(256, 64, checkpointing=checkpointing) == pytest.approx(
        fused.step_flops(256, 64, checkpointing=checkpointing)
    )
    step = StepShape(batch=4, seq_len=64, checkpointing=checkpointing)
    assert activation_bytes(separate, step) == activation_bytes(fused, step)
    with pytest.raises(ValueError, match="has routed experts: give experts_per_token"):
        model_shape(_MoE(True).to("meta"))


def test_step_flops_match_torch_flop_counter():
    """Matmul FLOPs of forward + backward against FlopCounterMode on the real model. The counter
    has no formula for the CPU flash-attention kernel before torch 2.15, and from 2.15 counts it
    without the causal half, so the attention term (2 T d per token and block forward, the
    causal half of Q Kᵀ and A V) is taken off the prediction and the attention ops off the
    count."""
    cfg = GPT_CONFIGS["gpt-tiny"]
    torch.manual_seed(0)
    model = GPT(cfg)
    batch, seq = 2, cfg.seq_len
    idx = torch.randint(0, cfg.vocab_size, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(idx, idx).backward()
    shape = model_shape(GPT(cfg, device="meta"))
    tokens = batch * seq
    predicted = shape.step_flops(tokens, seq)
    attention = 3 * 2 * seq * cfg.d_model * tokens * cfg.n_layer
    counted = counter.get_flop_counts()["Global"]
    matmuls = sum(n for op, n in counted.items() if "scaled_dot_product" not in str(op))
    assert predicted - attention == matmuls
    with_ac = shape.step_flops(tokens, seq, checkpointing=True)
    blocks_forward = sum(shape.forward_flops_per_token(b, seq) for b in shape.blocks) * tokens
    assert with_ac == predicted + blocks_forward


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_optimizer_state_matches_the_real_optimizer(optimizer):
    """At W=1 the shard is the parameter: the state a real optimizer (as ``train`` builds it)
    holds after a step, to the byte."""
    cfg = TrainConfig(model="gpt-tiny", optimizer=optimizer)
    torch.manual_seed(0)
    model = GPT(GPT_CONFIGS["gpt-tiny"])
    opt = build_optimizer(model, cfg)
    idx = torch.randint(0, 256, (2, 64))
    model(idx, idx).backward()
    opt.step()
    planner = StructAwarePlanner(optimizer_type=None if optimizer == "adamw" else optimizer)
    plans = planner.plan_model(GPT(GPT_CONFIGS["gpt-tiny"], device="meta"), 1)
    kw = {"shampoo_dim": cfg.max_preconditioner_dim, "tables": False}  # the state dicts alone
    assert optimizer_state_bytes(plans, optimizer, rank=0, **kw) == optimizer_bytes(opt)
    # the average rank, at W=1 the only one
    assert optimizer_state_bytes(plans, optimizer, **kw) == optimizer_bytes(opt)


def test_memory_counts_ragged_buffers_and_fsdp2_padding():
    """gpt-tiny at W=3 by hand: raggedfsdp holds each bucket's S, FSDP2 each parameter's
    ceil(dim0 / 3) rows."""
    module = GPT(GPT_CONFIGS["gpt-tiny"], device="meta")
    shape = model_shape(module)
    plans = StructAwarePlanner().plan_model(module, 3)
    units = unit_bytes(plans)
    step = StepShape(batch=2, seq_len=64)
    ours = memory_breakdown(shape, units, step, 0, world_size=3)
    fsdp2 = memory_breakdown(shape, units, step, 0, world_size=3, system="fsdp2")
    assert ours.params == ours.grads == 4 * sum(p.shard_numel for p in plans)
    padded = sum(math.ceil(p.shape[0] / 3) * math.prod(p.shape[1:]) for p in module.parameters())
    assert fsdp2.params == 4 * padded
    assert ours.activations == fsdp2.activations
    tokens, d, v = 128, 64, 256
    loss = tokens * 4 * (2 * 16 * d + 2 * d + 3 * v)  # docs: the two candidate peaks
    block = tokens * 4 * (2 * 16 * d + d + 4 * d) + 4 * v * d  # + the tied gradient
    assert activation_bytes(shape, step) == (loss, block)
    assert ours.activations == (loss if ours.phase == "loss" else block)


def test_frozen_buckets_have_no_gradients():
    """A frozen parameter's bucket (``/frozen/`` in its name) holds no gradient; the others do.
    Negative control: the same model with everything trainable has more gradient bytes."""
    module = GPT(GPT_CONFIGS["gpt-tiny"], device="meta")
    step = StepShape(batch=2, seq_len=64)

    def grads() -> int:
        units = unit_bytes(StructAwarePlanner().plan_model(module, 2))
        return memory_breakdown(model_shape(module), units, step, 0, world_size=2).grads

    trainable = grads()
    module.pos_emb.weight.requires_grad_(False)
    frozen = [p for p in StructAwarePlanner().plan_model(module, 2) if "/frozen/" in p.name]
    assert len(frozen) == 1 and frozen[0].param_numel == module.pos_emb.weight.numel()
    assert grads() == trainable - 4 * frozen[0].shard_numel


def test_ring_time_and_bytes_by_hand():
    """One collective: (W-1) x (latency + S x itemsize / bandwidth) per bucket."""
    module = GPT(GPT_CONFIGS["gpt-tiny"], device="meta")
    shape = model_shape(module)
    hw = hardware("h100", efficiency=1.0, intra_latency_s=1e-3)
    w = 4
    plans = StructAwarePlanner().plan_model(module, w, dtype=torch.bfloat16)
    units = unit_bytes(plans)
    step = StepShape(batch=1, seq_len=64, param_dtype=torch.bfloat16)
    moved = collective_bytes(units, step, w)
    s_total = sum(p.shard_numel for p in plans)
    last = units[-2].shard_numel
    assert moved.all_gather_bytes == 2 * (2 * s_total - units[-1].shard_numel - last)
    assert moved.reduce_scatter_bytes == 2 * w * s_total
    timing = step_time(shape, units, step, hw, w, optimizer_bytes=0)
    ring = [3 * (1e-3 + 2 * u.shard_numel / hw.intra_bytes_per_s) for u in units]
    # every unit gathered in forward, the blocks but the last again in backward, all reduced
    assert timing.comm_s == pytest.approx(2 * sum(ring) + sum(ring[:-2]))
    assert timing.total_s >= timing.compute_s + ring[-1] + ring[0]  # exposed at both ends


def test_cpu_gloo_adds_communication_to_compute():
    """Without overlap (CPU: Gloo takes the compute's cores) the step is compute, every
    collective and the optimizer, one after the other; with it, less."""
    module = GPT(GPT_CONFIGS["gpt-small"], device="meta")
    shape = model_shape(module)
    plans = StructAwarePlanner().plan_model(module, 2)
    units = unit_bytes(plans)
    step = StepShape(batch=2, seq_len=128, gloo=True)
    cpu = step_time(shape, units, step, HARDWARE["cpu-gloo"], 2, optimizer_bytes=0)
    assert cpu.total_s == pytest.approx(cpu.compute_s + cpu.comm_s + cpu.optimizer_s)
    overlapped = hardware("cpu-gloo", overlaps=True)
    assert step_time(shape, units, step, overlapped, 2, optimizer_bytes=0).total_s < cpu.total_s


def test_host_overhead_adds_to_the_step_and_not_to_the_waiting():
    """A measured CPU cost of the runtime is added as is; it is not communication."""
    module = GPT(GPT_CONFIGS["gpt-small"], device="meta")
    plans = StructAwarePlanner().plan_model(module, 2)
    units = unit_bytes(plans)
    step = StepShape(batch=2, seq_len=128, gloo=True)
    args = (model_shape(module), units, step, HARDWARE["cpu-gloo"], 2)
    plain = step_time(*args, optimizer_bytes=0)
    loaded = step_time(*args, optimizer_bytes=0, host_overhead_s=5e-3)
    assert loaded.total_s == pytest.approx(plain.total_s + 5e-3)
    assert loaded.exposed_comm_s == pytest.approx(plain.exposed_comm_s)
    with pytest.raises(ValueError, match=r"host_overhead_s must be >= 0, got -0\.001"):
        step_time(*args, optimizer_bytes=0, host_overhead_s=-1e-3)


def test_link_cpu_takes_the_compute_core_unless_the_link_is_slower():
    """The CPU a host backend's link costs per byte lengthens the compute it overlaps: with
    no waiting to hide it, by exactly the bytes sent times the cost; a link slow enough hides it
    in its waiting; an accelerator's NIC costs the compute nothing."""
    module = GPT(GPT_CONFIGS["gpt-small"], device="meta")
    plans = StructAwarePlanner().plan_model(module, 2)
    units = unit_bytes(plans)
    step = StepShape(batch=2, seq_len=128, gloo=True)
    cost = 2e-9

    def total(name: str, **figures: float) -> float:
        hw = hardware(name, **figures)
        return step_time(model_shape(module), units, step, hw, 2, optimizer_bytes=0).total_s

    sent = collective_bytes(units, step, 2).wire_bytes
    assert total("cpu-gloo", link_cpu_s_per_byte=cost) == pytest.approx(
        total("cpu-gloo") + sent * cost
    )
    slow = {"link_gbit": 0.01}
    assert total("cpu-gloo", **slow, link_cpu_s_per_byte=cost) == total("cpu-gloo", **slow)
    gpu_like = {"overlaps": True}  # copy engines and NICs move the bytes
    assert total("cpu-gloo", **gpu_like, link_cpu_s_per_byte=cost) == total("cpu-gloo", **gpu_like)
    with pytest.raises(ValueError, match="link_cpu_s_per_byte must be >= 0, got -1"):
        hardware("cpu-gloo", link_cpu_s_per_byte=-1)


def test_presets_and_overrides():
    assert set(HARDWARE) == {"h100", "h200", "a100", "b200", "cpu-gloo"}
    h100 = hardware("h100", link_gbit=100)
    assert h100.inter_bytes_per_s == 100e9 / 8
    assert h100.link_bytes_per_s(8) == h100.intra_bytes_per_s
    assert h100.link_bytes_per_s(16) == h100.inter_bytes_per_s


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: hardware("h900"), "unknown hardware preset 'h900'; known presets: h100"),
        (lambda: hardware("h100", link_gbit=0), "link bandwidth must be positive"),
        (lambda: hardware("h100", link_gbit=-5), "link bandwidth must be positive"),
        (lambda: hardware("h100", peak_flops=-1), "peak_flops must be positive"),
        (lambda: CapacityOptions(batch=0, seq_len=8).step(HARDWARE["h100"]), "batch must be"),
        (lambda: StepShape(batch=1, seq_len=-1), "seq_len must be a positive integer"),
        (lambda: CapacityOptions(batch=1, seq_len=8, optimizer="sgd"), "unknown optimizer"),
        (
            lambda: capacity_report("llama4", [8], HARDWARE["h100"], _options()),
            "unknown model 'llama4'; known models: gpt-tiny",
        ),
    ],
)
def test_bad_input_names_the_value(call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        call()


def _options(**kw):
    return CapacityOptions(batch=1, seq_len=64, **kw)


def test_world_larger_than_a_bucket_is_an_error(tmp_path):
    module = build_model("gpt-tiny")
    shape = model_shape(module)
    with pytest.raises(ValueError, match=r"W=64 is more ranks than bucket '.*' has blocks"):
        plan_capacity(module, shape, 64, HARDWARE["h100"], _options(block_size="whole"))
    # the plot's curve stops where sharding does (gpt-tiny's root has 5 whole tensors)
    argv = ["plan", "--model", "gpt-tiny", "--world", "4", "--block-size", "whole", "--gpu", "h100"]
    assert main([*argv, "--plot", str(tmp_path / "c.png"), "--json"]) == 0


def test_zoo_models_cost_in_under_a_second_at_16384():
    for name in ("llama3-405b", "deepseek-v3-671b", "gpt-oss-120b"):
        report = capacity_report(
            name, [16384], HARDWARE["h100"], _options(checkpointing=True), find_smallest=False
        )
        (world,) = report.worlds
        assert world.plan_seconds < 1.0, (name, world.plan_seconds)


# ---------------------------------------------------------------------------------------------
# The command.


def test_plan_command_capacity_json_and_plot(capsys, tmp_path):
    plot = tmp_path / "curve.png"
    argv = ["plan", "--model", "gpt-tiny", "--world", "2,4", "--gpu", "cpu-gloo", "--json"]
    assert main([*argv, "--batch", "2", "--plot", str(plot)]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["world_size"] for r in records] == [2, 4]
    module = GPT(GPT_CONFIGS["gpt-tiny"], device="meta")
    for record in records:
        w = record["world_size"]
        plans = StructAwarePlanner().plan_model(module, w)
        want = memory_breakdown(
            model_shape(module),
            unit_bytes(plans),
            StepShape(batch=2, seq_len=64, gloo=True),
            optimizer_state_bytes(plans, "adamw"),
            world_size=w,
        )
        assert record["raggedfsdp"]["memory"] == want.to_dict()
        assert record["smallest_world"] == 1 and record["raggedfsdp"]["fits"]
        assert {"forward_s", "backward_s", "tokens_per_s", "comm_share"} <= set(
            record["fsdp2"]["time"]
        )
    assert plot.stat().st_size > 10_000


def test_plan_command_capacity_table(capsys):
    argv = ["plan", "--model", "llama3-8b", "--world", "8", "--gpu", "a100", "--seq", "8192"]
    assert main([*argv, "--link-gbit", "100", "--activation-checkpointing"]) == 0
    out = capsys.readouterr().out
    for text in ("W=8", "raggedfsdp", "fsdp2", "peak", "tokens/s per device", "smallest"):
        assert text in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpu", "h900"], "unknown hardware preset 'h900'; known presets: h100, h200"),
        (["--link-gbit", "0"], "--link-gbit must be positive, got 0"),
        (["--link-gbit", "-1"], "--link-gbit must be positive, got -1"),
        (["--batch", "0"], "--batch must be positive, got 0"),
        (["--seq", "-8"], "--seq must be positive, got -8"),
        (["--reserve", "1.5"], "reserve must be a fraction in [0, 1), got 1.5"),
        (["--gpu", "h100", "--block-size", "whole", "--world", "64"], "W=64 is more ranks"),
    ],
)
def test_plan_command_bad_capacity_input(capsys, flags, message):
    argv = ["plan", "--model", "gpt-tiny", "--world", "2", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_plan_command_unknown_model_lists_the_zoo(capsys):
    assert main(["plan", "--model", "llama9", "--world", "8", "--gpu", "h100"]) == 2
    assert "unknown model 'llama9'; known models: gpt-tiny, gpt-small" in capsys.readouterr().err
