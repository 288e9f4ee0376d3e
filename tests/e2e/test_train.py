"""The training job end to end: real ``raggedfsdp train`` launches (torchrun's elastic agent, Gloo,
2 workers on CPU) of gpt-tiny for a few steps, and what they leave behind.

One uninterrupted 6-step run (``reference``) is the yardstick: a run resumed from its step-3
checkpoint, a run whose worker is SIGKILLed mid-run and restarted by the agent, a run killed while
saving and then resumed, and a run over two torchrun agents (two "nodes") must all end with the
same parameters, bit for bit. Checkpoints are also reloaded at other world sizes and shard
policies (through the multi-process harness: one launch of 3 ranks), into PyTorch FSDP2, and
exported to a plain state dict. Launching costs seconds, so each launch serves several checks.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import raggedfsdp as rf
from harness import run_world_grid
from launches import (
    ENV,
    assert_same_tensors,
    cli_command,
    ok,
    one_error_line,
    run_cli,
)
from raggedfsdp.layout import ShardLayout, row_numel
from raggedfsdp.models import GPT, GPT_CONFIGS
from raggedfsdp.tensor import shard_info, to_ragged_tensor
from raggedfsdp.train import build_model, build_optimizer, health
from raggedfsdp.train.checkpoints import (
    check_entries,
    export_checkpoint,
    load_checkpoint,
    load_full,
    save_checkpoint,
)
from raggedfsdp.train.config import TrainConfig
from raggedfsdp.train.run_dir import COMPLETE

# gpt-tiny, 6 steps, 2 micro-batches per step (no_sync), activation checkpointing; a short
# warm-up so that the cosine part of the schedule matters for resume exactness.
COMMON = [
    "--model=gpt-tiny",
    "--steps=6",
    "--batch-size=8",
    "--grad-accum=2",
    "--activation-checkpointing",
    "--warmup-steps=2",
    "--lr=3e-3",
    "--log-every=1",
    "--eval-every=3",
    "--eval-batches=2",
    "--checkpoint-every=3",
]


def _export(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    """The final parameters of a run (in this process: a launch costs seconds)."""
    export_checkpoint(checkpoint, out)
    return torch.load(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus) -> dict[str, Any]:
    """The uninterrupted 6-step run: its folder and its exported final parameters."""
    root = tmp_path_factory.mktemp("reference")
    out = root / "run"
    proc = ok(run_cli("train", *COMMON, f"--data={corpus}", f"--out={out}"))
    return {"out": out, "final": _export(out, root / "final.pt"), "proc": proc}


# ---------------------------------------------------------------------------------------------
# End to end.


def test_reference_run_writes_metrics_report_and_checkpoints(reference):
    out = reference["out"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, [r["loss"] for r in train]
    assert [r["step"] for r in evals] == [0, 3, 6]
    assert evals[2]["val_loss"] < evals[1]["val_loss"] < evals[0]["val_loss"]
    for key in ("tokens_per_s", "comm_fraction", "all_gather_bytes", "peak_rss_bytes"):
        assert train[-1][key] > 0, key
    assert train[-1]["world_size"] == 2
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for step in (3, 6):
        meta = json.loads((out / "checkpoints" / f"step_{step:06d}" / COMPLETE).read_text())
        assert meta["step"] == step and meta["world_size"] == 2
        assert meta["data"] == {"step": step} and meta["config"]["model"] == "gpt-tiny"
    assert "summary" in reference["proc"].stdout


def test_export_loads_into_a_plain_model(command, reference, corpus, tmp_path):
    status, out, _ = command(
        "export", "--checkpoint", str(reference["out"]), "--out", str(tmp_path / "m.pt")
    )
    assert status == 0 and "m.pt" in out
    exported = torch.load(tmp_path / "m.pt")
    assert_same_tensors(exported, reference["final"])
    model = GPT(GPT_CONFIGS["gpt-tiny"])
    model.load_state_dict(exported, strict=True)
    tokens = torch.frombuffer(bytearray(corpus.read_bytes()[:4097]), dtype=torch.uint8).long()
    with torch.no_grad():
        loss = model(tokens[:-1].view(64, 64), tokens[1:].view(64, 64))
    assert loss.item() < 5.0  # trained: below the ~5.55 of a uniform guess over 256 bytes


def test_bf16_run_with_tensorboard(tmp_path, corpus):
    out = tmp_path / "bf16"
    proc = ok(
        run_cli(
            "train",
            "--model=gpt-tiny",
            "--steps=12",
            "--batch-size=8",
            "--mixed-precision=bf16",
            "--block-size=32",
            "--tensorboard",
            "--log-every=4",
            "--checkpoint-every=0",
            "--warmup-steps=2",
            f"--data={corpus}",
            f"--out={out}",
        )
    )
    train = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in train if r["kind"] == "train"]
    assert losses[-1] < losses[0] - 0.5, losses
    if importlib.util.find_spec("tensorboard") is None:  # the optional extra is missing
        assert "tensorboard skipped" in proc.stdout
    else:
        assert any((out / "tensorboard").glob("events.out.tfevents.*"))
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000012"]


# ---------------------------------------------------------------------------------------------
# Exactness under resume, faults and several nodes.


def test_resume_is_bit_exact(reference, tmp_path, corpus):
    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        reference["out"] / "checkpoints" / "step_000003", out / "checkpoints" / "step_000003"
    )
    proc = ok(run_cli("train", *COMMON, f"--data={corpus}", f"--out={out}", "--resume"))
    assert "resumed from" in proc.stdout
    assert_same_tensors(_export(out, tmp_path / "final.pt"), reference["final"])


def test_killed_worker_is_restarted_and_resumes_exactly(reference, tmp_path, corpus):
    out = tmp_path / "fault"
    proc = ok(
        run_cli(
            "train",
            *COMMON,
            f"--data={corpus}",
            f"--out={out}",
            "--checkpoint-every=2",
            "--inject-fault=kill-at-step=5",
            "--max-restarts=1",
        )
    )
    assert (out / ".faults" / "step_5").exists()  # rank 1 did die once
    assert "resumed from" in proc.stdout and "step_000004" in proc.stdout
    assert_same_tensors(_export(out, tmp_path / "final.pt"), reference["final"])


def test_crash_during_save_keeps_previous_checkpoint(reference, tmp_path, corpus):
    out = tmp_path / "crash"
    args = ["train", *COMMON, f"--data={corpus}", f"--out={out}", "--checkpoint-every=2"]
    proc = run_cli(*args, "--inject-fault=kill-during-save=4")
    assert proc.returncode != 0
    assert "raggedfsdp: error: training failed" in proc.stderr
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step_000002", "step_000004.tmp"]
    resumed = ok(run_cli(*args, "--resume"))
    assert "removed an incomplete checkpoint" in resumed.stdout
    assert "resumed from" in resumed.stdout and "step_000002" in resumed.stdout
    assert_same_tensors(_export(out, tmp_path / "final.pt"), reference["final"])


def test_two_nodes_train_together(reference, tmp_path, corpus):
    out = tmp_path / "nodes"
    rdzv = f"--rdzv-endpoint=127.0.0.1:{_free_port()}"
    args = [*COMMON, f"--data={corpus}", f"--out={out}", "--nnodes=2", "--nproc=1", "--rdzv-id=two"]
    agents = [
        subprocess.Popen(
            cli_command("train", *args, f"--node-rank={node}", rdzv),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        for node in (0, 1)
    ]
    outputs = [agent.communicate(timeout=180) for agent in agents]
    for agent, (stdout, stderr) in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, f"{stdout}\n{stderr}"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["world_size"] for r in records if r["kind"] == "train"] == [2] * 6
    assert_same_tensors(_export(out, tmp_path / "final.pt"), reference["final"])


# ---------------------------------------------------------------------------------------------
# Checkpoints at other world sizes and policies, in FSDP2, and with a block-structured optimizer.


class RowBlockMomentum(torch.optim.Optimizer):
    """A toy third-party optimizer whose state has every kind a checkpoint meets: a param-shaped
    momentum (``zeros_like(param)``, placed like the parameter), a 0-D ``step``, a Python
    ``count``, and for matrices ``row_sq``: one value per row, held by the rank holding the row
    (like Shampoo's per-block factors), a layout only the optimizer knows, so it keeps that
    state as a RaggedTensor of its own layout (``to_ragged_tensor``) and computes on pieces."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.01})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros(())
                    state["count"] = 0
                    state["momentum"] = torch.zeros_like(p)
                    if self._matrix(p):
                        rows = self._rows(p)
                        piece = torch.zeros(rows.local_numel(shard_info(p).rank))
                        state["row_sq"] = to_ragged_tensor(piece, rows, p)
                state["step"] += 1
                state["count"] += 2
                state["momentum"].mul_(0.9).add_(p.grad)
                if self._matrix(p):
                    sq = p.grad.to_local().reshape(-1, self._cols(p)).square().sum(1)
                    state["row_sq"].to_local().add_(sq)
                p.add_(state["momentum"], alpha=-group["lr"])

    @staticmethod
    def _matrix(p: torch.Tensor) -> bool:
        return shard_info(p).layout.ndim >= 2

    @staticmethod
    def _cols(p: torch.Tensor) -> int:
        return row_numel(shard_info(p).layout.global_shape)

    @staticmethod
    def _rows(p: torch.Tensor) -> ShardLayout:
        """The rows' layout: rank r holds the rows of its piece of the parameter."""
        layout = shard_info(p).layout
        cols = row_numel(layout.global_shape)
        rows = tuple((start // cols, end // cols) for start, end in layout.ranges)
        return ShardLayout((layout.numel // cols,), 1, rows)


def _tiny(block: str, **kw: Any) -> TrainConfig:
    return TrainConfig(model="gpt-tiny", block_size=block, **kw)


def _toy_model(block: str) -> tuple[torch.nn.Module, RowBlockMomentum]:
    model = build_model(_tiny(block), torch.device("cpu"))
    return model, RowBlockMomentum(model.parameters())


def _on_two_ranks(rank: int, world: int, reference_ckpt: str, toy_dir: str) -> dict:
    """World 2: load the reference checkpoint into PyTorch FSDP2; judge a NaN globally; train
    the toy optimizer 2 steps and save it."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(123)  # values unlike the checkpoint's, so the load must replace them
    fsdp2 = GPT(GPT_CONFIGS["gpt-tiny"])
    for block in fsdp2.blocks:
        fully_shard(block)
    fully_shard(fsdp2)
    state = {"model": fsdp2.state_dict()}
    dcp.load(state, checkpoint_id=reference_ckpt)
    fsdp2.load_state_dict(state["model"])
    interop = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in fsdp2.state_dict().items()
    }

    nan_everywhere = health.global_loss(torch.tensor(float("nan") if rank == 1 else 1.0))
    mean = health.global_loss(torch.tensor(float(rank)))

    model, opt = _toy_model("4")
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randint(0, 256, (2, 16), generator=g)
        model(x[rank : rank + 1], x[rank : rank + 1]).backward()
        opt.step()
        opt.zero_grad()
    meta = {"config": _tiny("4").to_dict(), "data": {"step": 2}}
    save_checkpoint(toy_dir, 2, model=model, optimizer=opt, meta=meta)
    return {"interop": interop, "nan": nan_everywhere, "mean": mean}


def _reload(rank: int, world: int, block: str, adamw: tuple, toy: tuple | None) -> dict:
    """At another world size and policy: load the reference's step-3 checkpoint (AdamW) and the
    toy optimizer's, and save both again, so that both can be compared with the originals."""
    src, dst = adamw
    cfg = _tiny(block, out=dst)
    model = build_model(cfg, torch.device("cpu"))
    optimizer = build_optimizer(model, cfg)
    meta = load_checkpoint(src, model=model, optimizer=optimizer)
    save_checkpoint(dst, 3, model=model, optimizer=optimizer, meta=meta)
    full = rf.full_state_dict(model)
    if toy is not None:
        src, dst = toy
        model, opt = _toy_model(block)
        meta = load_checkpoint(src, model=model, optimizer=opt)
        save_checkpoint(dst, 2, model=model, optimizer=opt, meta=meta)
    return {"full": full, "world": dist.get_world_size()}


def _reloads(paths: dict[str, str], rank: int, world: int, group: None) -> dict:
    """World 2 (FSDP2, the loss judged globally, the toy optimizer saved), then 3 and 1."""
    if world == 2:
        return _on_two_ranks(rank, world, paths["step6"], paths["toy2"])
    if world == 3:
        return _reload(
            rank, world, "whole", (paths["step3"], paths["adamw3"]), (paths["toy"], paths["toy3"])
        )
    return _reload(rank, world, "32", (paths["step3"], paths["adamw1"]), None)


@pytest.fixture(scope="module")
def reloaded(reference, tmp_path_factory) -> dict[str, Any]:
    """One launch of 3 ranks: world 2, then 3, then 1, each as if launched on its own."""
    root = tmp_path_factory.mktemp("reload")
    step3 = reference["out"] / "checkpoints" / "step_000003"
    toy = root / "toy2" / "checkpoints" / "step_000002"
    paths = {
        "step3": str(step3),
        "step6": str(reference["out"] / "checkpoints" / "step_000006"),
        "toy": str(toy),
        **{name: str(root / name) for name in ("toy2", "toy3", "adamw3", "adamw1")},
    }
    runs = run_world_grid(functools.partial(_reloads, paths), [2, 3, 1], as_launches=True)
    two, three, one = runs[2], runs[3], runs[1]
    return {"root": root, "step3": step3, "toy": toy, "two": two, "three": three, "one": one}


def test_resume_at_other_world_sizes_and_policies_is_exact(reloaded):
    saved = load_full(reloaded["step3"], prefix="")
    assert any(k.startswith("optim.") and k.endswith(".exp_avg_sq") for k in saved)
    model = {k.removeprefix("model."): v for k, v in saved.items() if k.startswith("model.")}
    for world, result in ((3, reloaded["three"]), (1, reloaded["one"])):
        resaved = load_full(reloaded["root"] / f"adamw{world}" / "checkpoints" / "step_000003", "")
        assert_same_tensors(resaved, saved)  # parameters and every optimizer state, bit for bit
        for rank_result in result:
            assert_same_tensors(rank_result["full"], model)


def test_block_structured_optimizer_state_reshards(reloaded):
    saved = load_full(reloaded["toy"], prefix="optim.")
    resaved = load_full(reloaded["root"] / "toy3" / "checkpoints" / "step_000002", "optim.")
    assert_same_tensors(resaved, saved)
    rows = saved["blocks.0.mlp.fc.weight.row_sq"]
    assert rows.shape == (256,) and bool((rows > 0).all())  # every block of 4 rows, placed once
    assert float(saved["blocks.0.mlp.fc.weight.step"]) == 2.0


def test_checkpoint_loads_into_fsdp2(reloaded, reference):
    for rank_result in reloaded["two"]:
        assert_same_tensors(rank_result["interop"], reference["final"])


def test_nonfinite_loss_is_judged_globally(reloaded):
    import math

    for rank_result in reloaded["two"]:
        assert math.isnan(rank_result["nan"]) and rank_result["mean"] == 0.5


# ---------------------------------------------------------------------------------------------
# Health.


def test_watchdog_aborts_a_stuck_step():
    code = (
        "import time\n"
        "from raggedfsdp.train.health import StepWatchdog\n"
        "watchdog = StepWatchdog(0.3, rank=5)\n"
        "with watchdog.step(7):\n"
        "    time.sleep(30)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60
    )
    assert proc.returncode == health.WATCHDOG_EXIT_CODE
    assert "rank 5: step 7" in proc.stderr and "--step-timeout-s" in proc.stderr


# ---------------------------------------------------------------------------------------------
# Bad checkpoints: one line on stderr, a non-zero status, no traceback (bad options and paths,
# which need no launch: tests/unit/test_train_options_and_bad_input.py).


def _copy_step3(reference: dict, out: Path) -> Path:
    target = out / "checkpoints" / "step_000003"
    shutil.copytree(reference["out"] / "checkpoints" / "step_000003", target)
    return target


def test_incompatible_and_corrupt_checkpoints(command, reference, tmp_path, corpus):
    data = f"--data={corpus}"
    out = tmp_path / "small"
    ckpt = _copy_step3(reference, out)
    status, _, err = command("train", data, f"--out={out}", "--resume", "--model=gpt-small")
    assert status != 0
    one_error_line(err, "'model.tok_emb.weight'", "[256, 64]", "[256, 128]")
    status, _, err = command(
        "train", data, f"--out={out}", "--resume", "--model=gpt-tiny", "--optimizer=muon"
    )
    one_error_line(err, "--optimizer adamw", "muon")
    with pytest.raises(ValueError, match=r"has no entry 'model\.extra\.weight'"):
        check_entries(ckpt, {"model.extra.weight": (3,)}, {"config": {}})

    (ckpt / ".metadata").write_bytes(b"garbage")
    status, _, err = command("train", data, f"--out={out}", "--resume", "--model=gpt-tiny")
    one_error_line(err, "could not be read", ".metadata: 7 bytes")
    (ckpt / COMPLETE).write_text("{not json")
    status, _, err = command("train", data, f"--out={out}", "--resume", "--model=gpt-tiny")
    one_error_line(err, "COMPLETE.json is corrupt")
    status, _, err = command("export", "--checkpoint", str(tmp_path / "nothing"), "--out", "x.pt")
    one_error_line(err, "neither a complete checkpoint")


def test_corrupt_checkpoint_data_is_refused_before_launch(reference, tmp_path, corpus):
    """The only checkpoint fails its checksums: refused in one line before any worker starts
    (it used to fail in the workers); with an older intact one, resume falls back to it
    (tests/e2e/test_checkpoint_verify.py)."""
    out = tmp_path / "truncated"
    ckpt = _copy_step3(reference, out)
    payload = ckpt / "__0_0.distcp"
    payload.write_bytes(payload.read_bytes()[:100])
    proc = run_cli("train", *COMMON, f"--data={corpus}", f"--out={out}", "--resume")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("raggedfsdp: error:")]
    assert len(errors) == 1, proc.stderr
    assert "could not be read" in errors[0] and "__0_0.distcp: 100 bytes" in errors[0], errors
