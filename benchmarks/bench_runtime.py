"""Runtime benchmark: raggedfsdp (zero copy and copy path) against FSDP2, DDP and the compute floor.

A thin wrapper over :mod:`raggedfsdp.bench` (the library behind ``raggedfsdp bench``): same
arguments, plus where to write the results. See docs/design.md, "Benchmark protocol", and
docs/results/runtime.md for the figures measured on this machine class.

Usage::

    python benchmarks/bench_runtime.py --model gpt-ref --world 2 \\
        --out-json runtime.json --write-docs docs/results/runtime.md

prints the tables, writes the results as JSON (``--out-json``) and as markdown (``--out-md``), and
with ``--write-docs`` replaces the generated section of that file (between the ``bench_runtime``
markers, or those of ``--section``; the prose around it is kept).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # generated_docs
from generated_docs import write_section
from raggedfsdp.bench import run_bench
from raggedfsdp.cli import bench as bench_command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_command.configure(parser)
    parser.add_argument("--out-json", type=Path, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--out-md", type=Path, metavar="PATH", help="write markdown tables")
    parser.add_argument(
        "--write-docs",
        type=Path,
        metavar="PATH",
        help="replace the generated section of this markdown file (e.g. docs/results/runtime.md)",
    )
    parser.add_argument(
        "--section",
        default="bench_runtime",
        help="name of the generated section --write-docs replaces (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    results = run_bench(bench_command.options_from_args(args), log=None if args.json else _log)
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        bench_command.render(results, sys.stdout)
    markdown = bench_command.render_markdown(results)
    if args.out_json:
        args.out_json.write_text(json.dumps(results, indent=2) + "\n")
    if args.out_md:
        args.out_md.write_text(markdown)
    if args.write_docs:
        write_section(args.write_docs, args.section, "\n" + markdown, script="bench_runtime")
    return 0


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":  # spawned rank processes re-import this file: keep the guard
    raise SystemExit(main())
