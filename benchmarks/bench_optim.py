"""Optimizer-step cost on ragged shards: forward+backward vs optimizer step, per optimizer.

The reference GPT of docs/design.md (``gpt-ref``: d=512, 8 layers, 8 heads, vocab 8192, seq 256),
batch 4 per rank, fp32, sharded by ``rf.FSDPBackend`` with a ``StructAwarePlanner`` whose
``optimizer_type`` matches the optimizer, at W = 2 and 4 Gloo ranks on the CPU, one thread per
rank. Tokens are uniform random ids in ``[0, 8192)`` (the embedded byte corpus has only 256
symbols; timing does not depend on the values). Every optimizer trains its own copy of the same
model (same seed) on the same batches. Optimizers:

- ``adamw``      ``torch.optim.AdamW`` (planner ``"adamw"``);
- ``muon``       ``rf.optim.Muon`` (Newton–Schulz in bf16, torch's numbers) on every matrix of the
                 blocks; the auxiliary AdamW takes the embeddings (``tok_emb``, tied with the
                 head), ``pos_emb`` and every 1-D parameter (planner ``"muon"``);
- ``shampoo``    ``rf.optim.Shampoo`` with ``max_preconditioner_dim=512`` (= d_model: one block
                 per 512×512 tile, and the planner's unit is 512 rows), preconditioners
                 recomputed every ``precondition_frequency=5`` steps from step 1 (planner
                 ``"shampoo"``);
- ``adamw8bit``  ``rf.optim.AdamW8bit`` with 256-element blocks (planner ``"adamw8bit"``).

Protocol: all optimizers live side by side in each rank process and run *interleaved*: round
``k`` gives each one a step on batch ``k``, in an order rotated by ``k``, each step starting at a
barrier. A step is timed in two parts on every rank, ``zero_grad + forward + backward`` (the
backward ends when every reduce-scatter is done) and ``optimizer.step()``; a part's time is the
slowest rank's, and the reported figure is the median over the measured rounds after the
warm-ups. Shampoo recomputes its inverse roots at steps 1, 6, 11, ...; the median is a step
without the recomputation, and the recomputing step is reported beside it with the amortized
cost.

After the timed rounds, Muon runs two more steps instrumented (not in the timing table), one with
``ns_dtype=torch.bfloat16`` (as timed) and one with ``ns_dtype=torch.float32`` (the Newton–Schulz
dtype ablation: the same optimizer with its ``ns_dtype`` switched): per rank, the time inside
Newton–Schulz (and its flops), blocked in the two ``all_to_all_single`` waits, in the non-finite
check's all-reduce, and the rest (momentum, copies, the auxiliary AdamW, the update).

Muon's extra traffic (``Muon.comm_bytes_last_step``: the gather and the scatter of matrices split
over ranks) is compared with ``2(W-1)/W² · P · 2`` bytes (bf16), ``P`` the elements of the
Muon-updated matrices (``b = 4`` bytes for fp32 on the wire).

Usage::

    PYTHONPATH=src python3 benchmarks/bench_optim.py --json bench_optim.json \
        --write-docs docs/results/optimizers.md

prints markdown tables and, with ``--write-docs``, replaces the generated section of that file
(between the ``bench_optim`` markers; the prose around it is kept).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # generated_docs
import raggedfsdp as rf
from generated_docs import write_section
from raggedfsdp.bench import make_batches
from raggedfsdp.models.gpt import GPT, GPT_CONFIGS
from raggedfsdp.spawn import run_on_ranks

OPTIMIZERS = ("adamw", "muon", "shampoo", "adamw8bit")
LABELS = {
    "adamw": "torch AdamW",
    "muon": "Muon (NS bf16) + AdamW",
    "shampoo": "Shampoo (dim 512, roots every 5)",
    "adamw8bit": "AdamW8bit (256-elt blocks)",
}
SHAMPOO_DIM = 512
SHAMPOO_FREQUENCY = 5
#: Parameters Muon leaves to its auxiliary AdamW (besides every 1-D parameter).
AUX_NAMES = ("tok_emb.weight", "pos_emb.weight", "head.weight")
#: The issue's target: optimizer step under this fraction of forward+backward.
TARGET_RATIO = 0.10


@dataclass(frozen=True)
class Options:
    model: str = "gpt-ref"
    worlds: tuple[int, ...] = (2, 4)
    optimizers: tuple[str, ...] = OPTIMIZERS
    batch_size: int = 4
    warmup: int = 2
    steps: int = 4
    seed: int = 0
    timeout: float = 900.0


# ---------------------------------------------------------------------------------------------
# Building one optimizer's model.


def build_optimizer(
    kind: str, model: nn.Module, lr_scale: float = 1.0
) -> tuple[torch.optim.Optimizer, dict[str, Any]]:
    """The optimizer ``kind`` over ``model``'s (sharded) parameters, and its settings."""
    named = list(model.named_parameters())
    params = [p for _, p in named]
    if kind == "adamw":
        settings = {"lr": 1e-3 * lr_scale, "betas": (0.9, 0.95), "weight_decay": 0.1}
        return torch.optim.AdamW(params, **settings), settings
    if kind == "muon":
        aux_ids = {id(p) for name, p in named if name in AUX_NAMES}

        def rule(p: torch.Tensor, shape: torch.Size) -> bool:
            return id(p) in aux_ids or len(shape) < 2

        settings = {
            "lr": 0.02 * lr_scale,
            "momentum": 0.95,
            "weight_decay": 0.1,
            "adamw_lr": 1e-3 * lr_scale,
            "adamw_betas": (0.9, 0.95),
            "adamw_weight_decay": 0.1,
            "ns_dtype": torch.bfloat16,
        }
        return rf.optim.Muon(params, adamw_params=rule, **settings), settings
    if kind == "shampoo":
        settings = {
            "lr": 1e-3 * lr_scale,
            "betas": (0.9, 0.95),
            "weight_decay": 0.1,
            "max_preconditioner_dim": SHAMPOO_DIM,
            "precondition_frequency": SHAMPOO_FREQUENCY,
            "start_preconditioning_step": 1,
        }
        return rf.optim.Shampoo(params, **settings), settings
    if kind == "adamw8bit":
        settings = {"lr": 1e-3 * lr_scale, "betas": (0.9, 0.95), "weight_decay": 0.1}
        return rf.optim.AdamW8bit(params, block_numel=256, **settings), settings
    raise ValueError(f"unknown optimizer {kind!r}")


def planner_for(kind: str) -> rf.StructAwarePlanner:
    options = {"max_preconditioner_dim": SHAMPOO_DIM} if kind == "shampoo" else {}
    return rf.StructAwarePlanner(optimizer_type=kind, **options)


def muon_matrix_numel(optimizer: torch.optim.Optimizer) -> int:
    """Global elements of the matrices Muon (not its auxiliary AdamW) updates."""
    total = 0
    for group in optimizer.param_groups:
        if group.get("use_muon", False):
            for p in group["params"]:
                layout = rf.layout_of(p)
                total += math.prod(layout.global_shape) if layout is not None else p.numel()
    return total


@dataclass
class Runner:
    kind: str
    model: nn.Module
    optimizer: torch.optim.Optimizer

    def step(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        self.model.reset_stats()  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(x, y)
        loss.backward()
        t1 = time.perf_counter()
        self.optimizer.step()
        t2 = time.perf_counter()
        stats = self.model.stats()  # type: ignore[attr-defined]
        out: dict[str, Any] = {
            "fb": t1 - t0,
            "opt": t2 - t1,
            "loss": float(loss.detach()),
            "fsdp_bytes": stats["all_gather_bytes"] + stats["reduce_scatter_bytes"],
        }
        if isinstance(self.optimizer, rf.optim.Muon):
            out["muon_bytes"] = self.optimizer.comm_bytes_last_step
        return out


def _build(kind: str, options: Options) -> Runner:
    torch.manual_seed(options.seed)
    model = GPT(GPT_CONFIGS[options.model])
    rf.FSDPBackend(model, planner=planner_for(kind))
    optimizer, _ = build_optimizer(kind, model)
    return Runner(kind, model, optimizer)


# ---------------------------------------------------------------------------------------------
# The instrumented Muon step.


def _ns_flops(rows: int, cols: int, steps: int) -> int:
    """Flops of ``steps`` Newton–Schulz iterations on a ``rows × cols`` matrix (as torch runs
    them, on the wide orientation): ``X Xᵀ``, ``B·B`` and ``(…)·X`` per iteration."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (2 * m * m * n + 2 * m**3 + 2 * m * m * n)


@contextlib.contextmanager
def _instrument_muon(acc: dict[str, float]) -> Iterator[None]:
    """Accumulate into ``acc`` the time spent in Newton–Schulz (and its flops), blocked in
    ``Work.wait`` (the all-to-alls) and in ``dist.all_reduce`` (the non-finite check).

    Patches ``raggedfsdp.optim.muon._newton_schulz`` (the module looks it up at call time),
    ``torch.distributed.all_reduce`` and ``Work.wait`` for the duration only."""
    from raggedfsdp.optim import muon as muon_module

    original_ns = getattr(muon_module, "_newton_schulz", None)
    original_reduce = dist.all_reduce
    original_wait = dist.Work.wait

    def ns(x: torch.Tensor, coefficients: Any, steps: int, eps: float) -> torch.Tensor:
        start = time.perf_counter()
        out = original_ns(x, coefficients, steps, eps)  # type: ignore[misc]
        acc["ns_s"] += time.perf_counter() - start
        acc["ns_flops"] += _ns_flops(x.shape[0], x.shape[1], steps)
        acc["ns_calls"] += 1
        return out

    in_reduce = [False]  # a synchronous all-reduce waits inside: count that time once

    def all_reduce(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        in_reduce[0] = True
        try:
            return original_reduce(*args, **kwargs)
        finally:
            in_reduce[0] = False
            acc["allreduce_s"] += time.perf_counter() - start

    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original_wait(self, *args, **kwargs)
        finally:
            if not in_reduce[0]:
                acc["wait_s"] += time.perf_counter() - start

    if original_ns is not None:
        muon_module._newton_schulz = ns
    dist.all_reduce = all_reduce
    with contextlib.suppress(AttributeError, TypeError):
        dist.Work.wait = wait  # type: ignore[method-assign]
    try:
        yield
    finally:
        if original_ns is not None:
            muon_module._newton_schulz = original_ns
        dist.all_reduce = original_reduce
        with contextlib.suppress(AttributeError, TypeError):
            dist.Work.wait = original_wait  # type: ignore[method-assign]


def _muon_breakdown(runner: Runner, batch: tuple[Any, Any], ns_dtype: torch.dtype) -> dict:
    """One instrumented Muon step with Newton–Schulz (and the wire) in ``ns_dtype``."""
    optimizer = runner.optimizer
    assert isinstance(optimizer, rf.optim.Muon)
    saved, optimizer.ns_dtype = optimizer.ns_dtype, ns_dtype
    try:
        optimizer.zero_grad(set_to_none=True)
        runner.model(*batch).backward()
        acc = dict.fromkeys(("ns_s", "ns_flops", "ns_calls", "wait_s", "allreduce_s"), 0.0)
        dist.barrier()
        with _instrument_muon(acc):
            start = time.perf_counter()
            optimizer.step()
            acc["step_s"] = time.perf_counter() - start
        acc["other_s"] = acc["step_s"] - acc["ns_s"] - acc["wait_s"] - acc["allreduce_s"]
        acc["bytes_sent"] = optimizer.comm_bytes_last_step
        return acc
    finally:
        optimizer.ns_dtype = saved


# ---------------------------------------------------------------------------------------------
# One rank.


def _rank_main(rank: int, world: int, options: Options) -> dict[str, Any]:
    runners = {kind: _build(kind, options) for kind in options.optimizers}
    rounds = options.warmup + options.steps
    batches = make_batches(options, rounds + 1, rank, world)
    records: dict[str, list[dict[str, Any]]] = {kind: [] for kind in options.optimizers}
    order = list(options.optimizers)
    for k in range(rounds):
        shift = k % len(order)
        for kind in order[shift:] + order[:shift]:
            dist.barrier()
            records[kind].append(runners[kind].step(*batches[k]))
    breakdown = {}
    if "muon" in runners:
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            breakdown[name] = _muon_breakdown(runners["muon"], batches[rounds], dtype)
    info: dict[str, Any] = {}
    for kind, runner in runners.items():
        stats = runner.model.stats()  # type: ignore[attr-defined]
        local = sum(p.numel() for p in runner.model.parameters())
        entry = {
            "padding_numel": stats["padding_numel"],
            "param_numel": stats["param_numel"],
            "local_numel": local,
        }
        if kind == "muon":
            entry["muon_numel"] = muon_matrix_numel(runner.optimizer)
        if kind == "shampoo":
            entry["shampoo_blocks"] = sum(
                len(state.get("L", [])) for state in runner.optimizer.state.values()
            )
        info[kind] = entry
    return {"records": records, "breakdown": breakdown, "info": info}


# ---------------------------------------------------------------------------------------------
# Merging ranks.


def merge(options: Options, world: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    first = options.warmup
    for kind in options.optimizers:
        per_rank = [r["records"][kind] for r in ranks]
        steps = len(per_rank[0])
        fb = [max(pr[k]["fb"] for pr in per_rank) for k in range(steps)]
        opt = [max(pr[k]["opt"] for pr in per_rank) for k in range(steps)]
        rank_opt = [statistics.median(x["opt"] for x in pr[first:]) for pr in per_rank]
        entry: dict[str, Any] = {
            "fb_s": statistics.median(fb[first:]),
            "opt_s": statistics.median(opt[first:]),
            "fb_min_s": min(fb[first:]),
            "opt_min_s": min(opt[first:]),
            "fb_all": fb,
            "opt_all": opt,
            "rank_opt_s": rank_opt,
            "opt_balance": max(rank_opt) / statistics.mean(rank_opt),
            "loss": [per_rank[0][k]["loss"] for k in range(steps)],
            "fsdp_bytes_per_rank": per_rank[0][-1]["fsdp_bytes"],
            **ranks[0]["info"][kind],
        }
        entry["ratio"] = entry["opt_s"] / entry["fb_s"]
        entry["padding_ratio"] = entry["padding_numel"] / entry["param_numel"]
        entry["local_numel_per_rank"] = [r["info"][kind]["local_numel"] for r in ranks]
        if kind == "shampoo":
            entry["shampoo_blocks_per_rank"] = [r["info"][kind]["shampoo_blocks"] for r in ranks]
            roots = [k for k in range(first, steps) if k % SHAMPOO_FREQUENCY == 0]
            plain = [opt[k] for k in range(first, steps) if k % SHAMPOO_FREQUENCY != 0]
            if roots and plain:
                root_s, plain_s = statistics.median(opt[k] for k in roots), statistics.median(plain)
                entry["root_step_s"] = root_s
                entry["amortized_opt_s"] = (root_s + (SHAMPOO_FREQUENCY - 1) * plain_s) / (
                    SHAMPOO_FREQUENCY
                )
                entry["amortized_ratio"] = entry["amortized_opt_s"] / entry["fb_s"]
        if kind == "muon":
            sent = [r["records"][kind][-1]["muon_bytes"] for r in ranks]
            expected = 2 * (world - 1) / world**2 * entry["muon_numel"] * 2
            entry.update(
                muon_bytes_per_rank=sent,
                muon_bytes_expected=expected,
                muon_bytes_vs_expected=max(sent) / expected if expected else None,
                breakdown={
                    name: [r["breakdown"][name] for r in ranks] for name in ranks[0]["breakdown"]
                },
            )
        out[kind] = entry
    return out


# ---------------------------------------------------------------------------------------------
# Report.


def cpu_description() -> str:
    """``"<model name>, N cores"`` from /proc/cpuinfo where there is one, and whether the CPU has
    AVX512-BF16 (bf16 matmuls then run at about twice the fp32 rate)."""
    model, bf16 = platform.processor() or platform.machine(), False
    with contextlib.suppress(OSError):
        text = Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        bf16 = "avx512_bf16" in text
    return f"{model}, {os.cpu_count()} cores{', AVX512-BF16' if bf16 else ''}"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def render(results: dict[str, Any]) -> str:
    lines: list[str] = []
    add = lines.append
    add(f"Command: `{results['command']}`  ")
    add(
        f"Machine: {results['machine']}; torch {results['torch']}; Gloo, one thread per rank; "
        f"total wall time {results['wall_s']:.0f} s. The machine is shared with other jobs "
        f"(1-minute load average {results.get('loadavg_start', float('nan')):.1f} at the start, "
        f"{results.get('loadavg_end', float('nan')):.1f} at the end), so times are noisy: "
        f"medians of {results['options']['steps']} measured rounds after "
        f"{results['options']['warmup']} warm-ups (min in brackets); each phase's time is the "
        f"slowest rank's."
    )
    add("")
    for world, per in results["worlds"].items():
        cores = results["cores"]
        note = (
            f" ({world} ranks oversubscribe {cores} cores: each rank gets ~{cores}/{world} of a "
            f"core, so both phases are ~{int(world) / cores:.1f}× slower per rank than with a "
            f"core each)"
            if int(world) > cores
            else ""
        )
        add(f"**W = {world}**{note}")
        add("")
        add(
            "| optimizer | fwd+bwd (s) | opt step (s) | opt / fwd+bwd | target < 10% | "
            "opt max/mean over ranks | FSDP padding |"
        )
        add("| --- | ---: | ---: | ---: | --- | ---: | ---: |")
        for kind, e in per.items():
            met = "met" if e["ratio"] < TARGET_RATIO else "missed"
            add(
                f"| {LABELS[kind]} | {e['fb_s']:.3f} ({e['fb_min_s']:.3f}) | {e['opt_s']:.3f} "
                f"({e['opt_min_s']:.3f}) | {e['ratio']:.1%} | {met} | {e['opt_balance']:.2f} | "
                f"{e['padding_ratio']:.2%} |"
            )
        shampoo = per.get("shampoo")
        if shampoo and "root_step_s" in shampoo:
            add("")
            add(
                f"Shampoo: a step that recomputes the inverse roots takes "
                f"{shampoo['root_step_s']:.3f} s; amortized over its {SHAMPOO_FREQUENCY}-step "
                f"period {shampoo['amortized_opt_s']:.3f} s ({shampoo['amortized_ratio']:.1%} of "
                f"fwd+bwd). Preconditioner blocks per rank: {shampoo['shampoo_blocks_per_rank']}."
            )
        muon = per.get("muon")
        if muon:
            add("")
            add(
                "| Muon traffic | bytes sent per rank per step (MiB) | 2(W−1)/W²·P·b (MiB) | "
                "measured / formula | FSDP AG+RS bytes per rank per step (MiB) |"
            )
            add("| --- | --- | ---: | ---: | ---: |")
            for name, wire in (("bf16", 2), ("fp32", 4)):
                rows = muon["breakdown"].get(name)
                if not rows:
                    continue
                sent = [r["bytes_sent"] for r in rows]
                expected = muon["muon_bytes_expected"] * wire / 2
                add(
                    f"| NS/wire {name}, P = {muon['muon_numel']:,}, b = {wire} | "
                    f"{', '.join(_mib(b) for b in sent)} | {_mib(expected)} | "
                    f"{max(sent) / expected:.3f} | {_mib(muon['fsdp_bytes_per_rank'])} |"
                )
            add("")
            add(
                "| Muon step, instrumented (rank 0 / 1 / …) | step (s) | Newton–Schulz (s) | "
                "NS GFLOP/s | NS calls | all-to-all wait (s) | finite-check all-reduce (s) | "
                "rest (s) |"
            )
            add("| --- | --- | --- | --- | --- | --- | --- | --- |")
            for name, rows in muon["breakdown"].items():

                def col(key: str, fmt: str = "{:.3f}", rows: list = rows) -> str:
                    return " / ".join(fmt.format(r[key]) for r in rows)

                gflops = " / ".join(
                    f"{r['ns_flops'] / r['ns_s'] / 1e9:.0f}" if r["ns_s"] else "-" for r in rows
                )
                add(
                    f"| ns_dtype={name} | {col('step_s')} | {col('ns_s')} | {gflops} | "
                    f"{col('ns_calls', '{:.0f}')} | {col('wait_s')} | {col('allreduce_s')} | "
                    f"{col('other_s')} |"
                )
        add("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-ref", choices=sorted(GPT_CONFIGS))
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--batch-size", type=int, default=4, help="rows per rank")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="measured rounds (>= 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the raw results here")
    parser.add_argument("--write-docs", type=Path, help="replace the generated section here")
    parser.add_argument(
        "--from-json", type=Path, help="render the results saved by an earlier --json run"
    )
    args = parser.parse_args(argv)
    if args.from_json:
        text = render(json.loads(args.from_json.read_text()))
        print(text)
        if args.write_docs:
            write_section(args.write_docs, "bench_optim", text)
        return 0
    optimizers = tuple(s for s in args.optimizers.split(",") if s)
    unknown = set(optimizers) - set(OPTIMIZERS)
    if unknown or args.warmup < 2 or args.steps < 4:
        parser.error(f"unknown optimizers {sorted(unknown)}, or warmup < 2, or steps < 4")
    options = Options(
        model=args.model,
        worlds=tuple(int(w) for w in args.worlds.split(",")),
        optimizers=optimizers,
        batch_size=args.batch_size,
        warmup=args.warmup,
        steps=args.steps,
        seed=args.seed,
    )
    start = time.monotonic()
    load_start = os.getloadavg()[0]
    worlds: dict[str, Any] = {}
    for world in options.worlds:
        t0 = time.monotonic()
        ranks = run_on_ranks(
            _rank_main, world, options, timeout=options.timeout, pg_timeout=options.timeout
        )
        worlds[str(world)] = merge(options, world, ranks)
        print(f"W={world}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    results = {
        "command": "PYTHONPATH=src python3 benchmarks/bench_optim.py "
        + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        "machine": cpu_description(),
        "torch": torch.__version__,
        "cores": os.cpu_count(),
        "options": {**options.__dict__},
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg()[0],
        "wall_s": time.monotonic() - start,
        "worlds": worlds,
    }
    text = render(results)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    if args.write_docs:
        write_section(args.write_docs, "bench_optim", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
