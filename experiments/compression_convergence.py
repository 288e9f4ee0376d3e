"""Convergence under compressed communication: the default training run (``make run``:
``raggedfsdp train`` with its defaults, gpt-small, 400 steps, the standard library's sources,
W=2 Gloo workers) with each compression setting, against the same run uncompressed.

Each setting is one real ``raggedfsdp train`` launch (fresh ``--out``, no checkpoints but the
last); the final validation loss and the curves come from its ``metrics.jsonl``. The bf16
settings are compared with the uncompressed bf16 run (mixed precision is its own baseline).
Pass: final validation loss within 1% (relative) of the baseline.

Usage::

    PYTHONPATH=src python3 experiments/compression_convergence.py \
        --json docs/results/compression_convergence.json \
        --png docs/results/compression_convergence.png --write-docs docs/results/compression.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # generated_docs
from generated_docs import write_section

#: name -> (extra ``raggedfsdp train`` options, the baseline it is judged against)
SETTINGS: dict[str, tuple[list[str], str]] = {
    "fp32": ([], "fp32"),
    "fp8 all-gather": (["--compress-all-gather=fp8"], "fp32"),
    "int8 reduce-scatter": (["--compress-reduce-scatter=int8"], "fp32"),
    "both": (["--compress-all-gather=fp8", "--compress-reduce-scatter=int8"], "fp32"),
    "both + error feedback": (
        ["--compress-all-gather=fp8", "--compress-reduce-scatter=int8", "--error-feedback"],
        "fp32",
    ),
    "bf16": (["--mixed-precision=bf16", "--block-size=128x128"], "bf16"),
    "bf16 + fp8 all-gather (128x128)": (
        ["--mixed-precision=bf16", "--block-size=128x128", "--compress-all-gather=fp8"],
        "bf16",
    ),
}
TOLERANCE = 0.01


def run_setting(options: list[str], out: Path, steps: int, seed: int) -> dict[str, Any]:
    """One ``raggedfsdp train`` launch; its train and validation curves and wall time."""
    command = [sys.executable, "-m", "raggedfsdp.cli", "train", f"--out={out}"]
    command += [f"--steps={steps}", f"--seed={seed}", "--checkpoint-every=0", *options]
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stdout}\n{proc.stderr}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    return {
        "command": " ".join(["raggedfsdp train", *options]),
        "wall_s": time.perf_counter() - started,
        "train_loss": [(r["step"], r["loss"]) for r in train],
        "val_loss": [(r["step"], r["val_loss"]) for r in records if r["kind"] == "eval"],
        "wire_bytes": train[-1]["wire_bytes"],
        "compression_ratio": train[-1]["compression_ratio"],
    }


def summary(results: dict[str, Any]) -> str:
    runs = results["runs"]
    lines = [
        "| setting | final val loss | baseline | relative | within 1% | wire bytes / step / "
        "rank | ratio | wall |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, run in runs.items():
        base_name = SETTINGS[name][1]
        final, base = run["val_loss"][-1][1], runs[base_name]["val_loss"][-1][1]
        rel = (final - base) / base
        lines.append(
            f"| {name} | {final:.4f} | {base:.4f} ({base_name}) | {rel:+.2%} | "
            f"{'yes' if abs(rel) <= TOLERANCE else 'NO'} | {run['wire_bytes'] / 2**20:.2f} MiB | "
            f"{run['compression_ratio']:.3f} | {run['wall_s']:.0f} s |"
        )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, run in results["runs"].items():
        style = "--" if name.startswith("bf16") else "-"
        ax_train.plot(*zip(*run["train_loss"], strict=True), style, label=name)
        ax_val.plot(*zip(*run["val_loss"], strict=True), style, marker="o", ms=3, label=name)
    ax_train.set_title("train loss (logged steps)")
    ax_val.set_title("validation loss")
    for ax in (ax_train, ax_val):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_train.set_ylabel("cross-entropy (nats / byte)")
    fig.suptitle("raggedfsdp train (gpt-small, W=2, Gloo CPU) under compressed communication")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0, help="raggedfsdp train --seed")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument(
        "--json", type=Path, default=Path("docs/results/compression_convergence.json")
    )
    parser.add_argument(
        "--png", type=Path, default=Path("docs/results/compression_convergence.png")
    )
    parser.add_argument("--write-docs", type=Path, help="replace the generated section here")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.settings.split(",")]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="compression-convergence-") as tmp:
        for i, name in enumerate(names):
            print(f"[{name}]", flush=True)
            runs[name] = run_setting(SETTINGS[name][0], Path(tmp) / str(i), args.steps, args.seed)
            print(f"  final val loss {runs[name]['val_loss'][-1][1]:.4f}", flush=True)
    results = {"steps": args.steps, "seed": args.seed, "runs": runs}
    args.json.write_text(json.dumps(results, indent=1))
    plot(results, args.png)
    table = summary(results)
    print(table)
    if args.write_docs:
        command = "PYTHONPATH=src python3 experiments/compression_convergence.py " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        write_section(
            args.write_docs,
            "compression_convergence",
            f"`{command}`\n\n{table}",
            folder="experiments",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
