"""Planner benchmark: plan time and padding on public LLM shapes, against the bound and FSDP2.

For every model, granularity (element, 32-row, 128-row), bucket cap (one bucket per FSDP unit, and
several ``buffer_size`` values) and world size, plan the whole model (median wall time of
``--repeats`` runs, a fresh planner each run so no cache carries over) and report

- our padding beside the padding the planner's provable lower bound forces, and ``S / bound``
  (overall and for the worst bucket);
- FSDP2's padding (``ceil(dim0/W)*W`` rows per parameter) and the policy blocks FSDP2 and FSDP1
  cut on the same shapes (ours cut none);
- per target of the issue: plan time under 0.3 s at W=10000, ``S`` within 1.10x of the bound on
  every bucket, padding under 1% (element, 32-row) / 3% (128-row) wherever the bound allows.

It also times single buckets (``--parts buckets``): for every model, policy (element, 32-row,
128-row, tile, whole) and W in 2, 8, 64, 1024, 16384 the slowest distinct bucket (median of
``--repeats``, a fresh planner each run), a synthetic 2,002-tensor bucket, and the whole
DeepSeek-V3 with separate experts, against the targets of 0.3 s per bucket and 1 s per model.
And it checks the planner against the fixture of shard sizes recorded before the type-count
search (``--parts fixture``, ``tests/support/planner_fixture.json``): no bucket of any recorded
case may get a larger ``S`` (``--record-fixture PATH`` writes a new one from the current planner).

Usage::

    PYTHONPATH=src python3 benchmarks/bench_planner.py --write-docs docs/results/planner.md

prints markdown tables and, with ``--write-docs``, replaces the generated sections of that file
(between the ``bench_planner`` and ``bench_planner_buckets`` markers; the prose is kept).

The parts live in ``planner_bench/``: ``scenarios`` (what is planned), ``runner`` (planning,
timing, the fixture) and ``report`` (the markdown).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # generated_docs
from generated_docs import write_section
from planner_bench.report import bucket_markdown, fixture_lines, markdown
from planner_bench.runner import bucket_times, check_fixture, record_fixture, run
from planner_bench.scenarios import BUFFERS, FIXTURE, GRANULARITIES, MODELS, WORLDS


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated model names")
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="world sizes")
    parser.add_argument(
        "--granularities", default=",".join(GRANULARITIES), help=f"of {list(GRANULARITIES)}"
    )
    parser.add_argument("--buffers", default=",".join(BUFFERS), help=f"of {list(BUFFERS)}")
    parser.add_argument("--repeats", type=int, default=5, help="runs per figure (median time)")
    parser.add_argument(
        "--parts",
        default="main,buckets,fixture",
        help="of main (the whole-model grid), buckets (single-bucket and whole-model timing), "
        "fixture (no S larger than recorded)",
    )
    parser.add_argument("--fixture", type=Path, default=FIXTURE, help="recorded shard sizes")
    parser.add_argument(
        "--record-fixture",
        type=Path,
        metavar="PATH",
        help="write the current S per case, then exit",
    )
    parser.add_argument(
        "--write-docs", type=Path, metavar="PATH", help="e.g. docs/results/planner.md"
    )
    args = parser.parse_args(argv)
    buffers = _csv(args.buffers)
    parts = _csv(args.parts)
    for name, chosen, known in (
        ("granularities", _csv(args.granularities), GRANULARITIES),
        ("buffers", buffers, BUFFERS),
        ("parts", parts, ("main", "buckets", "fixture")),
    ):
        unknown = [c for c in chosen if c not in known]
        if unknown:
            parser.error(f"unknown {name} {unknown}; expected some of {list(known)}")
    models = _csv(args.models)
    if args.record_fixture:
        record_fixture(args.record_fixture, models)
        print(f"# wrote {args.record_fixture}", file=sys.stderr)
        return 0
    command = "PYTHONPATH=src python3 benchmarks/bench_planner.py " + shlex.join(
        sys.argv[1:] if argv is None else list(argv)
    )
    failed = False
    sections = []
    if "main" in parts:
        rows = run(
            models,
            [int(w) for w in _csv(args.worlds)],
            _csv(args.granularities),
            buffers,
            args.repeats,
        )
        sections.append(("bench_planner", markdown(rows, buffers, command.rstrip(), args.repeats)))
    check = None
    if "fixture" in parts:
        check = check_fixture(args.fixture, models)
        failed = bool(check.worse)
    if "buckets" in parts or check is not None:
        fixture = json.loads(args.fixture.read_text()) if args.fixture.exists() else None
        rows_b, whole = (
            bucket_times(models, args.repeats, fixture) if "buckets" in parts else ([], [])
        )
        text = bucket_markdown(rows_b, whole, check) if rows_b else fixture_lines(check)
        env = (
            f"Python {platform.python_version()}, torch {torch.__version__}, "
            f"{os.cpu_count()} CPUs ({platform.machine()}), median of {args.repeats} runs"
        )
        head = ["", "Produced by:", "", "```", command.rstrip(), "```", "", f"on {env}.", ""]
        sections.append(("bench_planner_buckets", "\n".join([*head, *text])))
    for name, section in sections:
        print(section)
        if args.write_docs:
            write_section(args.write_docs, name, section, script="bench_planner")
    if args.write_docs:
        print(f"# wrote {args.write_docs}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
