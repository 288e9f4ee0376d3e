"""Convergence of each optimizer on ragged shards: a byte-level GPT on the embedded real text.

The corpus is ``load_corpus(None, seed=0)`` (the Python standard library's own sources, bytes as
tokens, vocabulary 256; validation is a held-out set of files). The model is ``gpt-small`` (d=128,
4 layers, 4 heads, sequence 128, vocab 256, 0.84 M parameters). The reference GPT's vocab (8192)
means nothing for byte data, and ``gpt-ref`` is far too slow on 2 CPU cores for hundreds of steps
× 4 optimizers; so is ``gpt-medium``: measured here at 1.9 s per step (W=2, 8 × 256 bytes), its
250 steps × 4 optimizers would take ~35 minutes. ``gpt-small`` at 0.2 s per step (32 × 128
bytes; 0.4 s while other jobs share the 2 cores) is the largest named config that keeps this
script within 15 minutes: 400 steps × 4 optimizers take ~6 minutes alone, ~13 under that load.
It is sharded by ``rf.FSDPBackend`` over W=2 Gloo ranks (one thread each) with a
``StructAwarePlanner`` whose ``optimizer_type`` matches the optimizer, and trained from the same
seed on the same batches with:

- ``adamw``      ``torch.optim.AdamW``;
- ``muon``       ``rf.optim.Muon`` on the blocks' matrices (Newton–Schulz in bf16, torch's
                 numbers, ``adjust_lr_fn="match_rms_adamw"``: Moonlight's scaling, so one learning
                 rate and weight decay serve every optimizer), with its auxiliary AdamW for the
                 embeddings (tied with the head) and every 1-D parameter;
- ``shampoo``    ``rf.optim.Shampoo`` (``max_preconditioner_dim`` = d_model = 128; Adam grafting;
                 roots every 10 steps from step 10);
- ``adamw8bit``  ``rf.optim.AdamW8bit`` (256-element blocks).

Every optimizer: peak lr 2e-3, betas (0.9, 0.95), decoupled weight decay 0.1 on every parameter,
linear warm-up over the first 10% of steps then cosine decay to 10% of the peak, no gradient
clipping. The training loss of every step (the global batch's mean over both ranks) and the
validation loss every ``--eval-every`` steps (fixed held-out batches) are written to a JSON file,
and the curves to a PNG (matplotlib, Agg).

Usage::

    PYTHONPATH=src python3 experiments/convergence.py --json docs/results/convergence.json \
        --png docs/results/convergence.png --write-docs docs/results/optimizers.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # generated_docs
import raggedfsdp as rf
from generated_docs import write_section
from raggedfsdp.data import BatchSampler, eval_batches, load_corpus
from raggedfsdp.models.gpt import GPT, GPT_CONFIGS
from raggedfsdp.spawn import run_on_ranks

OPTIMIZERS = ("adamw", "muon", "shampoo", "adamw8bit")
LABELS = {
    "adamw": "torch AdamW",
    "muon": "Muon (+AdamW for emb/1-D)",
    "shampoo": "Shampoo (Adam grafting)",
    "adamw8bit": "AdamW8bit",
}
#: Parameters Muon leaves to its auxiliary AdamW (besides every 1-D parameter).
AUX_NAMES = ("tok_emb.weight", "pos_emb.weight", "head.weight")


@dataclass(frozen=True)
class Options:
    model: str = "gpt-small"
    world: int = 2
    steps: int = 400
    global_batch: int = 32
    lr: float = 2e-3
    weight_decay: float = 0.1
    eval_every: int = 25
    eval_batches: int = 8
    seed: int = 0
    timeout: float = 1800.0


def build_optimizer(kind: str, model: nn.Module, options: Options) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    params = [p for _, p in named]
    common = {"lr": options.lr, "weight_decay": options.weight_decay}
    betas = (0.9, 0.95)
    if kind == "adamw":
        return torch.optim.AdamW(params, betas=betas, **common)
    if kind == "muon":
        aux_ids = {id(p) for name, p in named if name in AUX_NAMES}
        return rf.optim.Muon(
            params,
            momentum=0.95,
            adjust_lr_fn="match_rms_adamw",
            adamw_params=lambda p, shape: id(p) in aux_ids or len(shape) < 2,
            adamw_lr=options.lr,
            adamw_betas=betas,
            adamw_weight_decay=options.weight_decay,
            **common,
        )
    if kind == "shampoo":
        return rf.optim.Shampoo(
            params,
            betas=betas,
            max_preconditioner_dim=GPT_CONFIGS[options.model].d_model,
            precondition_frequency=10,
            start_preconditioning_step=10,
            **common,
        )
    if kind == "adamw8bit":
        return rf.optim.AdamW8bit(params, betas=betas, block_numel=256, **common)
    raise ValueError(f"unknown optimizer {kind!r}")


def planner_for(kind: str, options: Options) -> rf.StructAwarePlanner:
    if kind == "shampoo":
        dim = GPT_CONFIGS[options.model].d_model
        return rf.StructAwarePlanner(optimizer_type="shampoo", max_preconditioner_dim=dim)
    return rf.StructAwarePlanner(optimizer_type=kind)


def lr_factor(step: int, total: int) -> float:
    """Linear warm-up over the first 10% of steps, then cosine decay to 10% of the peak."""
    warmup = max(1, total // 10)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _global_mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    return float(t)


def _rank_main(rank: int, world: int, kind: str, options: Options) -> dict[str, Any]:
    cfg = GPT_CONFIGS[options.model]
    corpus = load_corpus(None, seed=0)
    torch.manual_seed(options.seed)
    model = GPT(cfg)
    rf.FSDPBackend(model, planner=planner_for(kind, options))
    optimizer = build_optimizer(kind, model, options)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, options.steps)
    )
    train = BatchSampler(
        corpus.train,
        seq_len=cfg.seq_len,
        global_batch=options.global_batch,
        seed=options.seed,
        rank=rank,
        world_size=world,
    )
    val_batches = eval_batches(
        corpus.val,
        options.eval_batches,
        seq_len=cfg.seq_len,
        global_batch=options.global_batch,
        seed=options.seed,
        rank=rank,
        world_size=world,
    )

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            losses = [float(model(x, y)) for x, y in val_batches]
        model.train()
        return _global_mean(sum(losses) / len(losses))

    train_loss: list[float] = []
    val_loss: list[tuple[int, float]] = [(0, evaluate())]
    step_s: list[float] = []
    opt_s: list[float] = []
    start = time.perf_counter()
    for step in range(options.steps):
        x, y = train.next()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        t1 = time.perf_counter()
        optimizer.step()
        schedule.step()
        t2 = time.perf_counter()
        step_s.append(t2 - t0)
        opt_s.append(t2 - t1)
        train_loss.append(_global_mean(float(loss.detach())))
        if (step + 1) % options.eval_every == 0 or step + 1 == options.steps:
            val_loss.append((step + 1, evaluate()))
        if rank == 0 and (step + 1) % options.eval_every == 0:
            print(
                f"{kind} step {step + 1}: train {train_loss[-1]:.4f} val {val_loss[-1][1]:.4f} "
                f"({time.perf_counter() - start:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    skipped = getattr(optimizer, "skipped_steps", 0)
    return {
        "train_loss": train_loss,
        "val_loss": val_loss,
        "step_s": step_s,
        "opt_s": opt_s,
        "wall_s": time.perf_counter() - start,
        "skipped_steps": skipped,
        "num_params": sum(
            math.prod(rf.layout_of(p).global_shape) if rf.layout_of(p) else p.numel()
            for p in model.parameters()
        ),
        "corpus": {
            "source": corpus.source,
            "train_bytes": corpus.train.numel(),
            "val_bytes": corpus.val.numel(),
            "files": corpus.num_files,
        },
    }


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def summary(results: dict[str, Any]) -> str:
    runs = results["runs"]
    lines = [
        f"Command: `{results['command']}`  ",
        f"{results['model']} ({next(iter(runs.values()))['num_params']:,} parameters), W="
        f"{results['options']['world']}, {results['options']['steps']} steps of "
        f"{results['options']['global_batch']} × {results['seq_len']} bytes; total wall time "
        f"{results['wall_s']:.0f} s on a shared machine (1-minute load average "
        f"{results['loadavg_start']:.1f} at the start, {results['loadavg_end']:.1f} at the end, "
        f"on {os.cpu_count()} cores).",
        "",
        "| optimizer | final train loss (mean of last 10 steps) | final val loss | best val loss "
        "| median step (s) | median opt step (s) | skipped steps |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kind, run in runs.items():
        last = run["train_loss"][-10:]
        best = min(v for _, v in run["val_loss"])
        lines.append(
            f"| {LABELS[kind]} | {sum(last) / len(last):.4f} | {run['val_loss'][-1][1]:.4f} | "
            f"{best:.4f} | {_median(run['step_s']):.3f} | {_median(run['opt_s']):.3f} | "
            f"{run['skipped_steps']} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for kind, run in results["runs"].items():
        losses = run["train_loss"]
        window = 10
        smooth = [
            sum(losses[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1))
            for i in range(len(losses))
        ]
        (line,) = ax_train.plot(range(1, len(losses) + 1), smooth, label=LABELS[kind])
        ax_train.plot(range(1, len(losses) + 1), losses, color=line.get_color(), alpha=0.15)
        steps, values = zip(*run["val_loss"], strict=True)
        ax_val.plot(steps, values, marker="o", markersize=3, label=LABELS[kind])
    opts = results["options"]
    ax_train.set_title(f"train loss (10-step mean; faint: every step), {results['model']}")
    ax_val.set_title(f"validation loss (held-out files, every {opts['eval_every']} steps)")
    for ax in (ax_train, ax_val):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    ax_train.set_ylabel("cross-entropy (nats / byte)")
    ax_train.set_ylim(top=min(4.0, max(max(r["train_loss"]) for r in results["runs"].values())))
    fig.suptitle(
        f"raggedfsdp, W={opts['world']} (Gloo, CPU), byte-level Python stdlib corpus, "
        f"batch {opts['global_batch']}×{results['seq_len']}, lr {opts['lr']:g} (warm-up + cosine)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-small", choices=["gpt-small", "gpt-medium"])
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--steps", type=int, default=Options.steps)
    parser.add_argument("--global-batch", type=int, default=Options.global_batch)
    parser.add_argument("--lr", type=float, default=Options.lr)
    parser.add_argument("--eval-every", type=int, default=Options.eval_every)
    parser.add_argument("--eval-batches", type=int, default=Options.eval_batches)
    parser.add_argument("--json", type=Path, default=Path("docs/results/convergence.json"))
    parser.add_argument("--png", type=Path, default=Path("docs/results/convergence.png"))
    parser.add_argument("--write-docs", type=Path, help="replace the generated section here")
    args = parser.parse_args(argv)
    optimizers = tuple(s for s in args.optimizers.split(",") if s)
    if set(optimizers) - set(OPTIMIZERS):
        parser.error(f"unknown optimizers {sorted(set(optimizers) - set(OPTIMIZERS))}")
    options = Options(
        model=args.model,
        steps=args.steps,
        global_batch=args.global_batch,
        lr=args.lr,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
    )
    start = time.monotonic()
    results: dict[str, Any] = {
        "command": "PYTHONPATH=src python3 experiments/convergence.py "
        + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "model": options.model,
        "seq_len": GPT_CONFIGS[options.model].seq_len,
        "options": asdict(options),
        "runs": {},
        "loadavg_start": os.getloadavg()[0],
    }
    for kind in optimizers:
        t0 = time.monotonic()
        ranks = run_on_ranks(
            _rank_main,
            options.world,
            kind,
            options,
            timeout=options.timeout,
            pg_timeout=options.timeout,
        )
        results["runs"][kind] = ranks[0]
        print(f"{kind}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    results["wall_s"] = time.monotonic() - start
    results["loadavg_end"] = os.getloadavg()[0]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    plot(results, args.png)
    text = summary(results)
    print(text)
    if args.write_docs:
        write_section(args.write_docs, "convergence", text, folder="experiments")
    return 0


if __name__ == "__main__":
    sys.exit(main())
