"""Collectives benchmark: raggedfsdp's Gloo all-gather and reduce-scatter against torch's own.

On Gloo, raggedfsdp builds its all-gather and reduce-scatter from point-to-point transfers
(``raggedfsdp.runtime._collectives``, [Note: all-gather on Gloo] and [Note: reduce-scatter on
Gloo]); this measures each against ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (AVG)
on the same process group, inputs and sizes, each call writing into a fresh output as the
runtime's do. Per call and rank: wall time, the process's CPU time (compute thread plus Gloo's
threads: on a machine with no idle core that is what a training step pays) and page faults; the
median over ``--repeats`` calls, the max over ranks.

Usage::

    python benchmarks/bench_collectives.py --world 2 --write-docs docs/results/runtime.md

prints a markdown table and, with ``--write-docs``, replaces the generated section of that file
(between the ``bench_collectives`` markers; the prose around it is kept).
"""

from __future__ import annotations

import argparse
import platform
import resource
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # generated_docs
from generated_docs import write_section
from raggedfsdp.runtime import RuntimeStats
from raggedfsdp.runtime._collectives import Pending, all_gather, reduce_scatter
from raggedfsdp.runtime._pool import BufferPool
from raggedfsdp.spawn import run_on_ranks

#: Per-rank shard sizes in MiB of fp32; 6 MiB is a gpt-ref block's shard at W=2.
DEFAULT_SHARD_MIB = (1.0, 6.0, 24.0)


def _measure(rank: int, world: int, shard_mib: list[float], repeats: int) -> list[dict]:
    rows = []
    for mib in shard_mib:
        for op, method, call in _calls(world, int(mib * 2**20) // 4):
            rows.append({"shard_mib": mib, "op": op, "method": method, **_time(call, repeats)})
    return rows


def _calls(world: int, numel: int) -> list[tuple[str, str, Callable[[], Pending | None]]]:
    """Each (collective, implementation, call) on shards of ``numel`` fp32 elements. Like the
    runtime, every call writes into a freshly allocated output (the unsharded buffer of an
    unshard, the gradient shard of a reduce-scatter). Ours return their pending work (waited
    inside the timing); torch's run synchronously."""
    shard, full = torch.randn(numel), torch.randn(world * numel)
    stats = RuntimeStats()
    pool = BufferPool(stats)  # the runtime's: receive buffers reused from call to call
    group = dist.group.WORLD

    def gathered() -> torch.Tensor:
        return torch.empty(world * numel)

    def reduced() -> torch.Tensor:
        return torch.empty(numel)

    return [
        ("all-gather", "raggedfsdp", lambda: all_gather(gathered(), shard, group, stats)),
        ("all-gather", "torch", lambda: dist.all_gather_into_tensor(gathered(), shard)),
        (
            "reduce-scatter",
            "raggedfsdp",
            lambda: reduce_scatter(reduced(), full, group, stats, scratch=pool),
        ),
        (
            "reduce-scatter",
            "torch",
            lambda: dist.reduce_scatter_tensor(reduced(), full, op=dist.ReduceOp.AVG),
        ),
    ]


def _time(call: Callable[[], Pending | None], repeats: int) -> dict[str, float]:
    """Median wall ms, CPU ms and page faults of ``call()`` (its work waited), after a warm-up."""
    walls, cpus, faults = [], [], []
    for i in range(repeats + 2):
        dist.barrier()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        pending = call()
        if pending is not None:
            pending.wait()
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
        if i >= 2:  # the first calls connect pairs and fault the buffers in
            walls.append(1e3 * wall)
            cpus.append(1e3 * (after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime))
            faults.append(after.ru_minflt - usage.ru_minflt)
    return {
        "wall_ms": statistics.median(walls),
        "cpu_ms": statistics.median(cpus),
        "faults": statistics.median(faults),
    }


def _merge(per_rank: list[list[dict]]) -> list[dict]:
    """Each row's figures as the max over ranks."""
    merged = []
    for rows in zip(*per_rank, strict=True):
        row = dict(rows[0])
        for key in ("wall_ms", "cpu_ms", "faults"):
            row[key] = max(r[key] for r in rows)
        merged.append(row)
    return merged


def _markdown(rows: list[dict], command: str, world: int, repeats: int) -> str:
    lines = [
        f"`{command}` — W={world} Gloo ranks on one host, fp32, torch {torch.__version__}, "
        f"{platform.machine()}; median of {repeats} calls per row, max over ranks.",
        "",
        "| shard MiB | collective | torch wall ms | raggedfsdp wall ms | torch CPU ms "
        "| raggedfsdp CPU ms | CPU ratio | torch faults | raggedfsdp faults |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    by_key = {(r["shard_mib"], r["op"], r["method"]): r for r in rows}
    for mib, op in dict.fromkeys((r["shard_mib"], r["op"]) for r in rows):
        ours, theirs = by_key[mib, op, "raggedfsdp"], by_key[mib, op, "torch"]
        ratio = ours["cpu_ms"] / theirs["cpu_ms"] if theirs["cpu_ms"] else float("nan")
        lines.append(
            f"| {mib:g} | {op} | {theirs['wall_ms']:.2f} | {ours['wall_ms']:.2f} "
            f"| {theirs['cpu_ms']:.2f} | {ours['cpu_ms']:.2f} | {ratio:.2f} "
            f"| {theirs['faults']:,.0f} | {ours['faults']:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="Gloo ranks (default: 2)")
    parser.add_argument(
        "--shard-mib",
        default=",".join(f"{m:g}" for m in DEFAULT_SHARD_MIB),
        help="comma-separated per-rank shard sizes in MiB (default: %(default)s)",
    )
    parser.add_argument("--repeats", type=int, default=15, help="calls per row (default: 15)")
    parser.add_argument(
        "--write-docs", type=Path, metavar="PATH", help="e.g. docs/results/runtime.md"
    )
    args = parser.parse_args(argv)
    sizes = [float(s) for s in args.shard_mib.split(",")]
    per_rank = run_on_ranks(_measure, args.world, sizes, args.repeats, backend="gloo", timeout=1200)
    command = shlex.join(["python", "benchmarks/bench_collectives.py", *sys.argv[1:]])
    text = _markdown(_merge(per_rank), command, args.world, args.repeats)
    print(text)
    if args.write_docs:
        write_section(args.write_docs, "bench_collectives", "\n" + text)
    return 0


if __name__ == "__main__":  # spawned rank processes re-import this file: keep the guard
    raise SystemExit(main())
