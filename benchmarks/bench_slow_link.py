"""Step time on a slow link: ``raggedfsdp bench --link-gbit RATE`` at several rates, every system
interleaved per rate (protocol of docs/design.md: gpt-ref, W=2, fp32 masters, AdamW, one thread
per rank, median of the measured steps).

Systems: the compute floor, DDP, FSDP2 (fp32 and bf16 mixed precision), raggedfsdp uncompressed
and with each compression (fp8 all-gather, int8 reduce-scatter, both). For each rate the table
gives each system's step time, its ratio to the floor, and its exposed communication: the share
of its step beyond the floor's, ``(step - floor) / step``, and for raggedfsdp the time its
compute thread spent blocked in collectives (``comm_wait_seconds``) as a share of its step.

Usage (root: the bed makes a network namespace per rate)::

    PYTHONPATH=src python3 benchmarks/bench_slow_link.py --rates 0.25,1,2.5,10,none \
        --json docs/results/compression_speed.json --write-docs docs/results/compression.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # generated_docs
from generated_docs import write_section
from raggedfsdp.bench import BenchOptions, run_bench

SYSTEMS = (
    "floor",
    "ddp",
    "fsdp2",
    "fsdp2-bf16",
    "raggedfsdp",
    "raggedfsdp-fp8ag",
    "raggedfsdp-int8rs",
    "raggedfsdp-q",
)


def _rate(text: str) -> float | None:
    return None if text.strip() in ("none", "unthrottled") else float(text)


def measure(rate: float | None, args: argparse.Namespace) -> dict[str, Any]:
    options = BenchOptions(
        model=args.model,
        world=2,
        steps=args.steps,
        warmup=args.warmup,
        systems=tuple(args.systems.split(",")),
        profile=False,
        memory=False,
        link_gbit=rate,
    )
    results = run_bench(options, log=lambda m: print(f"  {m}", file=sys.stderr, flush=True))
    floor = results["systems"]["floor"]["step_s"]
    out = {}
    for name, entry in results["systems"].items():
        step = entry["step_s"]
        row = {"step_s": step, "vs_floor": step / floor, "beyond_floor": (step - floor) / step}
        stats = entry.get("runtime_stats")
        if stats is not None:
            row["comm_wait_share"] = stats["comm_wait_seconds"] / step
            row["wire_bytes"] = stats["all_gather_bytes"] + stats["reduce_scatter_bytes"]
        out[name] = row
    return {
        "rate_gbit": rate,
        "systems": out,
        "load": results["environment"].get("loadavg_before_timing"),
    }


def table(measured: list[dict[str, Any]]) -> str:
    lines = [
        "| link | system | step | vs floor | beyond floor | comm wait | wire MiB/step/rank |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in measured:
        link = "unthrottled" if m["rate_gbit"] is None else f"{m['rate_gbit']:g} Gbit/s"
        for name, row in m["systems"].items():
            wait = f"{row['comm_wait_share']:.0%}" if "comm_wait_share" in row else ""
            wire = f"{row['wire_bytes'] / 2**20:.1f}" if "wire_bytes" in row else ""
            lines.append(
                f"| {link} | {name} | {row['step_s']:.2f} s | {row['vs_floor']:.2f} | "
                f"{row['beyond_floor']:.0%} | {wait} | {wire} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="0.25,1,2.5,10,none")
    parser.add_argument("--model", default="gpt-ref")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help="comma-separated, 'floor' among them"
    )
    parser.add_argument("--json", type=Path, default=Path("docs/results/compression_speed.json"))
    parser.add_argument("--write-docs", type=Path, help="replace the generated section here")
    args = parser.parse_args(argv)
    measured = []
    for text in args.rates.split(","):
        print(f"[link {text}]", file=sys.stderr, flush=True)
        measured.append(measure(_rate(text), args))
        args.json.write_text(json.dumps(measured, indent=1))  # what is done so far survives
    text = table(measured)
    print(text)
    if args.write_docs:
        command = "PYTHONPATH=src python3 benchmarks/bench_slow_link.py " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        write_section(
            args.write_docs, "compression_speed", f"`{command}`\n\n{text}", "bench_slow_link"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
