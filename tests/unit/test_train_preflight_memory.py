"""``raggedfsdp train``'s memory preflight: the capacity planner's prediction for the run,
against the memory a rank may use, before any worker starts; ``--force`` overrides. (The
command refusing a run: tests/e2e/test_commands_in_a_fresh_interpreter.py.)"""

from __future__ import annotations

import pytest

from raggedfsdp.train import preflight
from raggedfsdp.train.config import TrainConfig


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
