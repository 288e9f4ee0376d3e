"""``raggedfsdp train --lora-rank R --base-weights nf4`` (QLoRA, issue 34 item 5): a real launch
(torchrun, 2 Gloo workers, tiny Llama) beside a one-process reference, then a second launch that
resumes from the first's step-3 checkpoint.

- W=2 equals one process on the global batch (1e-5 per step), and the loss falls;
- the tensor bytes each rank measured (its NF4 base, other frozen parameters, adapters,
  gradients, AdamW's state) are what :func:`raggedfsdp.capacity.lora.lora_bytes` predicts, computed
  here, within 5% (they are equal), and the NF4 base takes 0.5625 bytes a parameter (half a byte
  of code, 4 bytes of scale per 64);
- only the adapters train: the NF4 base at the end is the start's, and the adapters moved;
- a bad NF4 block is one line before launch, naming the linear, and leaves no ``--out``;
- resuming continues bit for bit (losses and every tensor), and loading a checkpoint restores the
  NF4 base itself: loaded into a model built from another seed (whose base differs: the negative
  control), it holds the checkpoint's base.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from launches import (
    assert_same_tensors,
    cli_command,
    metrics,
    ok,
    one_error_line,
    run_cli,
    run_side_by_side,
    train_losses,
    workers_in_one_process,
)
from raggedfsdp.capacity.lora import lora_bytes
from raggedfsdp.models.nf4 import NF4Weight
from raggedfsdp.train.build import (
    build_model,
    build_optimizer,
    build_planner,
    meta_model,
    new_model,
    wrap_policy,
)
from raggedfsdp.train.checkpoints import export_checkpoint, load_checkpoint, load_full
from raggedfsdp.train.config import TrainConfig

OPTIONS = {
    "hf_config": "tiny-llama",
    "lora_rank": 4,
    "base_weights": "nf4",
    "steps": 6,
    "batch_size": 8,
    "seq_len": 64,
    "warmup_steps": 2,
    "lr": 1e-2,
    "log_every": 1,
    "eval_every": 0,
    "eval_batches": 2,
    "checkpoint_every": 3,
}
ARGS = [f"--{k.replace('_', '-')}={v}" for k, v in OPTIONS.items()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus) -> dict[str, Path]:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("qlora")
    out = {k: root / k for k in ("w2", "w1", "resumed")}
    data = f"--data={corpus}"
    for proc in run_side_by_side(
        cli_command("train", *ARGS, data, f"--out={out['w2']}"),
        workers_in_one_process([*ARGS, data, f"--out={out['w1']}"]),
    ):
        ok(proc)
    step3 = out["w2"] / "checkpoints" / "step_000003"
    shutil.copytree(step3, out["resumed"] / "checkpoints" / "step_000003")
    (resumed,) = run_side_by_side(
        cli_command("train", *ARGS, data, f"--out={out['resumed']}", "--resume")
    )
    ok(resumed)
    return out


def _cfg(**changes: Any) -> TrainConfig:
    return TrainConfig(**{**OPTIONS, **changes})


def test_two_ranks_equal_one_process_and_the_loss_falls(runs):
    w2, w1 = train_losses(runs["w2"]), train_losses(runs["w1"])
    assert sorted(w2) == [1, 2, 3, 4, 5, 6]
    assert w2[6] < w2[1] - 0.1, w2
    for step in w2:
        assert abs(w2[step] - w1[step]) <= 1e-5, (step, w2[step], w1[step])


def test_tensor_bytes_per_rank_are_the_capacity_models(runs):
    (record,) = metrics(runs["w2"], "lora_bytes")
    model = meta_model(_cfg())
    predicted = lora_bytes(model, build_planner(_cfg()), 2, wrap=wrap_policy(model))
    assert [p.as_dict() for p in predicted] == record["predicted"]
    for got, want in zip(record["measured"], predicted, strict=True):
        for key, value in want.as_dict().items():
            assert abs(got[key] - value) <= 0.05 * value, (key, got[key], value)
        assert got["base"] > 0 and got["adapters"] > 0 and got["grads"] == got["adapters"]
    # two 64 x 64, two 32 x 64 and three 128 x 64 NF4 linears a layer, two layers
    base_numel = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64)
    assert record["base_numel"] == base_numel
    assert sum(m["base"] for m in record["measured"]) == base_numel * (0.5 + 4 / 64)


def test_only_the_adapters_train(runs):
    torch.manual_seed(0)  # as build_model seeds the run's model
    start = new_model(_cfg(), "cpu")  # its base, and its Bs at zero
    end = load_full(runs["w2"] / "checkpoints" / "step_000006")
    moved = []
    for name, param in start.named_parameters():
        value = param.dequantize() if isinstance(param, NF4Weight) else param.detach()
        if name.endswith(("lora_a", "lora_b")):
            moved.append(not torch.equal(end[name], value))
        else:
            assert torch.equal(end[name], value), name
    assert all(moved) and len(moved) == 2 * 2 * 7


def test_resume_is_bit_exact(runs, tmp_path):
    assert train_losses(runs["resumed"]) == {
        k: v for k, v in train_losses(runs["w2"]).items() if k > 3
    }
    export_checkpoint(runs["w2"], tmp_path / "full.pt")
    export_checkpoint(runs["resumed"], tmp_path / "resumed.pt")
    assert_same_tensors(torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "full.pt"))


def test_a_checkpoint_restores_the_nf4_base_itself(runs, group_of_one):
    """Into a model of another seed: its base is rebuilt otherwise, so only a load makes it the
    checkpoint's."""
    cfg = _cfg(seed=1)
    model = build_model(cfg, torch.device("cpu"))
    names = [n for n, p in model.named_parameters() if isinstance(p.to_local(), NF4Weight)]
    saved = load_full(runs["w2"] / "checkpoints" / "step_000006")
    before = {n: p.to_local().dequantize() for n, p in model.named_parameters() if n in names}
    assert all(not torch.equal(before[n], saved[n]) for n in names)  # the negative control
    load_checkpoint(runs["w2"] / "checkpoints" / "step_000006", model=model,
                    optimizer=build_optimizer(model, cfg))  # fmt: skip
    for name, param in model.named_parameters():
        local = param.to_local()
        assert isinstance(local, NF4Weight) == (name in names)
        value = local.dequantize() if name in names else local
        assert torch.equal(value, saved[name]), name


def test_an_nf4_block_that_cuts_a_row_is_one_line_before_launch(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "run"
    proc = run_cli("train", *ARGS, "--nf4-block-size=128", f"--out={out}")
    assert proc.returncode == 2
    one_error_line(proc.stderr, "nf4_block_size: 128", "'model.layers.0.self_attn.q_proj'")
    assert not out.exists()
