"""``raggedfsdp train`` with compressed communication: a real launch (torchrun, 2 Gloo workers,
gpt-tiny) reports bytes on the wire and the compression ratio, trains, and resumes bit for bit
from a checkpoint that carries the error-feedback residuals."""

from __future__ import annotations

import json
import shutil

import torch

from launches import assert_same_tensors, ok, run_cli
from raggedfsdp.capacity.capacity import CapacityOptions, capacity_report
from raggedfsdp.capacity.hardware import hardware
from raggedfsdp.capacity.wire import CompressionSpec
from raggedfsdp.train.checkpoints import export_checkpoint

COMMON = [
    "--model=gpt-tiny",
    "--steps=6",
    "--batch-size=8",
    "--block-size=32",
    "--warmup-steps=2",
    "--log-every=1",
    "--eval-every=6",
    "--eval-batches=1",
    "--checkpoint-every=3",
    "--compress-all-gather=fp8",
    "--compress-reduce-scatter=int8",
    "--error-feedback",
]


def _predicted_wire_bytes() -> int:
    """What ``raggedfsdp plan --model gpt-tiny --world 2 --block-size 32
    --compress-all-gather fp8 --compress-reduce-scatter int8 --error-feedback`` predicts one
    rank feeds its collectives per step (the monitor's ``wire_bytes``)."""
    options = CapacityOptions(
        batch=4,
        seq_len=32,
        block_size=32,
        compression=CompressionSpec.parse("fp8", "int8", True),
    )
    report = capacity_report("gpt-tiny", [2], hardware("cpu-gloo"), options, find_smallest=False)
    predicted = report.worlds[0].systems["raggedfsdp"].bytes
    return predicted.all_gather_bytes + predicted.reduce_scatter_bytes


def test_compressed_run_reports_wire_bytes_and_resumes_bit_for_bit(tmp_path, corpus):
    out = tmp_path / "run"
    proc = ok(run_cli("train", *COMMON, f"--data={corpus}", f"--out={out}"))
    assert "compression ratio" in proc.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"]
    # 8-bit codes and a scale per 32x32 tile against fp32: a little over a quarter.
    assert all(0.25 < r["compression_ratio"] < 0.26 for r in train), train[0]
    assert all(r["wire_bytes"] == train[0]["wire_bytes"] for r in train)
    # The capacity planner's prediction for the same run is the monitor's figure, exactly.
    assert _predicted_wire_bytes() == train[0]["wire_bytes"]
    step3 = out / "checkpoints" / "step_000003"
    assert sorted(p.name for p in (step3 / "residuals").iterdir()) == [
        "rank_00000.pt",
        "rank_00001.pt",
    ]
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(step3, resumed / "checkpoints" / "step_000003")
    ok(run_cli("train", *COMMON, f"--data={corpus}", f"--out={resumed}", "--resume"))
    final = {}
    for name, run in (("straight", out), ("resumed", resumed)):
        export_checkpoint(run, tmp_path / f"{name}.pt")
        final[name] = torch.load(tmp_path / f"{name}.pt")
    assert_same_tensors(final["resumed"], final["straight"])
