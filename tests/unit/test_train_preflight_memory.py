"""``raggedfsdp train``'s memory preflight: the capacity planner's prediction for the run,
against the memory a rank may use, before any worker starts; ``--force`` overrides. (The
command refusing a run: tests/e2e/test_commands_in_a_fresh_interpreter.py.)"""

from __future__ import annotations

import pytest

from raggedfsdp.capacity.capacity import DEFAULT_RESERVE
from raggedfsdp.capacity.cost import (
    MemoryBreakdown,
    memory_breakdown,
    optimizer_state_bytes,
    unit_bytes,
)
from raggedfsdp.capacity.lora import lora_bytes
from raggedfsdp.train import preflight
from raggedfsdp.train.build import build_planner, meta_model, wrap_policy
from raggedfsdp.train.config import TrainConfig
from raggedfsdp.train.preflight import PROCESS_BYTES


def test_the_prediction_is_the_runs_own() -> None:
    """Micro-batch per rank, mixed precision and checkpointing reach the prediction."""
    plain = preflight.predicted_memory(TrainConfig(model="gpt-small", batch_size=16), 2)
    halved = preflight.predicted_memory(
        TrainConfig(model="gpt-small", batch_size=16, grad_accum=2), 2
    )
    checkpointed = preflight.predicted_memory(
        TrainConfig(model="gpt-small", batch_size=16, activation_checkpointing=True), 2
    )
    bf16 = preflight.predicted_memory(
        TrainConfig(model="gpt-small", batch_size=16, mixed_precision="bf16"), 2
    )
    assert plain.activations > checkpointed.activations
    assert halved.activations < plain.activations and halved.persistent == plain.persistent
    assert bf16.unsharded < plain.unsharded  # bf16 all-gathers; fp32 masters stay
    assert bf16.params == plain.params


def test_refusal_names_the_numbers_and_what_to_change(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = TrainConfig(model="gpt-small", batch_size=64)
    need = preflight.predicted_memory(cfg, 2).peak
    # a node with just too little RAM for two such ranks, and one with enough
    tight = 2 * (preflight.PROCESS_BYTES + need)
    monkeypatch.setattr(preflight, "available_ram_bytes", lambda: tight)
    with pytest.raises(ValueError, match=r"memory: each rank needs about .* --force") as err:
        preflight.check_memory(cfg, 2, 2)
    for text in ("--batch-size, now 32 per rank", "--activation-checkpointing", "more ranks"):
        assert text in str(err.value)
    preflight.check_memory(TrainConfig(model="gpt-small", batch_size=64, force=True), 2, 2)
    monkeypatch.setattr(preflight, "available_ram_bytes", lambda: 2 * tight)
    preflight.check_memory(cfg, 2, 2)


def test_on_a_gpu_the_budget_is_its_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here, so CUDA's answers are stood in for: the GPU's free memory (NVML) is each
    rank's budget, its total when NVML is missing, and the run is refused by the same rule."""
    gib = 2**30
    props = type("Props", (), {"total_memory": 80 * gib})()
    monkeypatch.setattr(preflight.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(preflight.torch.cuda, "get_device_properties", lambda _: props)
    monkeypatch.setattr(preflight.torch.cuda, "device_memory_used", lambda _: 30 * gib)
    assert preflight._memory_per_rank(8) == (50 * gib, "GPU 0's free memory, 50.0 GiB of 80.0 GiB")

    def no_nvml(_: int) -> int:
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(preflight.torch.cuda, "device_memory_used", no_nvml)
    assert preflight._memory_per_rank(8) == (80 * gib, "GPU 0's total memory, 80.0 GiB")
    cfg = TrainConfig(model="gpt-small", batch_size=64)
    need = preflight.predicted_memory(cfg, 2).peak
    props.total_memory = need  # no room for the 10% reserve
    with pytest.raises(ValueError, match=r"is usable: GPU 0's total memory"):
        preflight.check_memory(cfg, 2, 2)


#: A QLoRA run of tiny Llama (tests/e2e/test_train_qlora.py's model), one short sequence a rank,
#: so the persistent bytes and the unsharded units, not the activations, decide its peak.
QLORA = {
    "hf_config": "tiny-llama",
    "lora_rank": 4,
    "base_weights": "nf4",
    "batch_size": 2,
    "seq_len": 16,
}


def _every_parameter_trained_in_fp32(cfg: TrainConfig) -> MemoryBreakdown:
    """The negative control: the preflight's prediction before it costed LoRA runs as such,
    the run's plans (the NF4 base in fp32 buckets) and AdamW's state for every parameter."""
    run = preflight._run_plans(cfg, 2)
    state = optimizer_state_bytes(run.plans, "adamw")
    step = preflight._step_shape(cfg, 2)
    return memory_breakdown(run.shape, unit_bytes(run.plans), step, state, world_size=2)


def test_a_qlora_runs_prediction_holds_its_own_tensor_bytes() -> None:
    """Persistent: the largest rank's :func:`lora_bytes` (the NF4 base, the other frozen
    parameters, the adapters, their gradients and AdamW state), exactly. Unsharded at the last
    block's backward (tiny Llama: an fp32 root of 32,832 elements; a block of 128 norm
    elements, 4,096 adapter elements and 36,864 NF4 ones), by hand: the root, the last block
    with its adapters' gradients and the block prefetched, the NF4 base at 0.5625 bytes."""
    pytest.importorskip("transformers")
    cfg = TrainConfig(**QLORA)
    memory = preflight.predicted_memory(cfg, 2)
    model = meta_model(cfg)
    top = max(r.total for r in lora_bytes(model, build_planner(cfg), 2, wrap=wrap_policy(model)))
    assert memory.params + memory.grads + memory.optimizer == top
    assert memory.persistent == top + memory.constants
    block = (128 + 4096) * 4 + 36864 * 9 // 16
    assert memory.phase == "block"
    assert memory.unsharded == 32832 * 4 + 2 * block + 4096 * 4
    old = _every_parameter_trained_in_fp32(cfg)
    plain = preflight.predicted_memory(TrainConfig(hf_config="tiny-llama", batch_size=2), 2)
    for control in (old, plain):
        assert 4 * memory.persistent < control.persistent
    assert 2 * memory.unsharded < old.unsharded
    assert memory.activations == old.activations  # the same model of them
    report = preflight.dry_run_report(cfg, 2)  # shows what check_memory judges
    assert f"{memory.peak / 2**20:>10,.1f} MiB" in report.splitlines()[-2]


def test_a_qlora_run_that_fits_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget between the QLoRA prediction and the old one: accepted, where the old
    prediction (patched in) is refused, and so is the same model trained in full."""
    pytest.importorskip("transformers")
    cfg = TrainConfig(**QLORA)
    new = preflight.predicted_memory(cfg, 2)
    old = _every_parameter_trained_in_fp32(cfg)
    share = int((new.peak + old.peak) / 2 / (1 - DEFAULT_RESERVE))  # usable: halfway between
    monkeypatch.setattr(preflight, "available_ram_bytes", lambda: 2 * (PROCESS_BYTES + share))
    preflight.check_memory(cfg, 2, 2)
    with pytest.raises(ValueError, match=r"memory: each rank needs about .* --force"):
        preflight.check_memory(
            TrainConfig(**{**QLORA, "lora_rank": None, "base_weights": None}), 2, 2
        )
    with monkeypatch.context() as before:
        before.setattr(preflight, "predicted_memory", lambda *_: old)
        with pytest.raises(ValueError, match=r"memory: each rank needs about .* --force"):
            preflight.check_memory(cfg, 2, 2)
    # too little even for QLoRA: the refusal names its own persistent state
    monkeypatch.setattr(preflight, "available_ram_bytes", lambda: 2 * (PROCESS_BYTES + new.peak))
    with pytest.raises(ValueError, match="frozen base, adapters, their gradients and AdamW state"):
        preflight.check_memory(cfg, 2, 2)
