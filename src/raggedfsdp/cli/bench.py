"""``raggedfsdp bench``: its arguments, and the results as rich tables, markdown or JSON.

The benchmark itself (:func:`raggedfsdp.bench.run_bench`: the phases in fresh rank processes,
the systems, the profiled step, the memory phase) is the ``bench`` room's; this module turns the
flags into :class:`~raggedfsdp.bench.BenchOptions`, logs progress on stderr and prints what
comes back (:func:`render`, :func:`render_markdown` for docs/).
"""

from __future__ import annotations

import argparse
import json
import sys

from ..bench import BENCH_MODELS, DEFAULT_SYSTEMS, SYSTEMS, BenchOptions, run_bench
from ..bench.slow_link import DEFAULT_BURST_KB, JUMBO_BELOW_KB, MIN_BURST_KB
from ._bench_tables import render, render_markdown

__all__ = ["configure", "options_from_args", "render", "render_markdown", "run"]


def run(args: argparse.Namespace) -> int:
    """Run ``raggedfsdp bench``; returns the exit status."""
    results = run_bench(options_from_args(args), log=None if args.json else _stderr_log)
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        render(results, sys.stdout)
    return 0


def _stderr_log(message: str) -> None:
    """The progress log of the command: one ``[bench]`` line on stderr."""
    sys.stderr.write(f"[bench] {message}\n")
    sys.stderr.flush()


def _parse_systems(text: str) -> tuple[str, ...]:
    """``--systems``: comma-separated names of :data:`SYSTEMS`, returned in report order."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown systems {','.join(unknown) or '(none)'}: expected a comma-separated subset "
            f"of {','.join(SYSTEMS)}"
        )
    return tuple(s for s in SYSTEMS if s in names)  # report order, no duplicates


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` arguments to ``parser``.

    One add_argument per flag; long by nature.
    """
    parser.add_argument(
        "--model",
        default="gpt-ref",
        choices=BENCH_MODELS,
        help="GPT shape (default: gpt-ref, the reference model of docs/design.md)",
    )
    parser.add_argument(
        "--world", type=int, default=2, metavar="W", help="ranks to launch (default: 2)"
    )
    parser.add_argument(
        "--steps", type=int, default=4, help="measured steps per system (default: 4)"
    )
    parser.add_argument(
        "--warmup", type=int, default=2, help="warm-up steps per system (default: 2)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=4,
        metavar="B",
        help="sequences per rank per step (default: 4)",
    )
    parser.add_argument(
        "--systems",
        type=_parse_systems,
        default=DEFAULT_SYSTEMS,
        metavar="S[,S...]",
        help=f"systems to run, of {','.join(SYSTEMS)} (default: {','.join(DEFAULT_SYSTEMS)})",
    )
    parser.add_argument("--seed", type=int, default=0, help="model and data seed (default: 0)")
    parser.add_argument(
        "--no-profile",
        dest="profile",
        action="store_false",
        help="skip the profiled step (copy counts, collective bytes, time split)",
    )
    parser.add_argument(
        "--profile-rounds",
        type=int,
        default=2,
        metavar="N",
        help="profiled steps per system; the fastest one's time split is reported (default: 2)",
    )
    parser.add_argument(
        "--no-memory",
        dest="memory",
        action="store_false",
        help="skip the per-system memory phase (fresh processes)",
    )
    parser.add_argument(
        "--top-ops",
        type=int,
        default=12,
        metavar="N",
        help="operators listed per system by self CPU time (default: 12)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=1200.0,
        metavar="SECONDS",
        help="limit per phase before the rank processes are killed (default: 1200)",
    )
    parser.add_argument(
        "--link-gbit",
        type=float,
        default=None,
        metavar="RATE",
        help="throttle the ranks' traffic to RATE Gbit/s: run them in a network namespace whose "
        "loopback is rate-limited by tc (needs root and iproute2; always removed)",
    )
    parser.add_argument(
        "--link-burst-kb",
        type=int,
        default=DEFAULT_BURST_KB,
        metavar="KIB",
        help=f"with --link-gbit: the token bucket in KiB, what passes at once after an idle gap "
        f"(default: {DEFAULT_BURST_KB}; from {MIN_BURST_KB}; below {JUMBO_BELOW_KB} the "
        f"loopback's MTU is set to 9000 so that packets fit the bucket)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """The :class:`BenchOptions` of arguments parsed by a :func:`configure` parser."""
    return BenchOptions(
        model=args.model,
        world=args.world,
        steps=args.steps,
        warmup=args.warmup,
        batch_size=args.batch_size,
        systems=tuple(args.systems),
        seed=args.seed,
        profile=args.profile,
        profile_rounds=args.profile_rounds,
        memory=args.memory,
        top_ops=args.top_ops,
        timeout=args.timeout,
        link_gbit=args.link_gbit,
        link_burst_kb=args.link_burst_kb,
    )
