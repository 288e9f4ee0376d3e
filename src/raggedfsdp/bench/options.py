"""What one ``raggedfsdp bench`` invocation runs: the systems, the options and their flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..models import GPT_CONFIGS
from .slow_link import DEFAULT_BURST_KB, JUMBO_BELOW_KB, MIN_BURST_KB, check_burst_kb

__all__ = [
    "BENCH_MODELS",
    "DEFAULT_SYSTEMS",
    "SYSTEMS",
    "BenchOptions",
    "configure_parser",
    "options_from_args",
]

SYSTEMS: dict[str, str] = {
    "raggedfsdp": "raggedfsdp (zero copy)",
    "raggedfsdp-copy": "raggedfsdp (zero_copy=False)",
    "fsdp2": "PyTorch FSDP2 (fully_shard)",
    "fsdp2-last": "PyTorch FSDP2, last block kept unsharded (as torchtitan)",
    "ddp": "DDP",
    "floor": "compute floor (no comm)",
    "fsdp2-bf16": "PyTorch FSDP2, bf16 mixed precision",
    "raggedfsdp-fp8ag": "raggedfsdp, fp8 all-gather",
    "raggedfsdp-int8rs": "raggedfsdp, int8 reduce-scatter",
    "raggedfsdp-q": "raggedfsdp, fp8 all-gather + int8 reduce-scatter",
}
"""Every system the bench knows, in report order."""

DEFAULT_SYSTEMS = ("raggedfsdp", "raggedfsdp-copy", "fsdp2", "fsdp2-last", "ddp", "floor")
"""What runs without ``--systems`` (the compressed and bf16 ones are for the slow-link bed)."""

BENCH_MODELS = ("gpt-ref", "gpt-small", "gpt-tiny", "gpt-medium")
"""The GPT shapes ``--model`` accepts (names of :data:`raggedfsdp.models.GPT_CONFIGS`)."""


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """One benchmark invocation.

    Attributes:
        model: a name of :data:`raggedfsdp.models.GPT_CONFIGS`.
        world: number of ranks (processes) to launch.
        steps: measured steps per system (the median is reported).
        warmup: unmeasured steps per system before them.
        batch_size: sequences per rank per step.
        systems: which of :data:`SYSTEMS` to run, in report order.
        seed: model initialisation and data seed (the same for every system).
        lr: AdamW learning rate.
        profile: run profiled steps (copy counts, collective bytes, time split).
        profile_rounds: profiled steps per system, interleaved; the fastest one is reported.
        memory: run the per-system memory phase in fresh processes.
        top_ops: how many operators the per-system profile lists by self CPU time.
        timeout: seconds one phase may take before its processes are killed.
        link_gbit: run the ranks in a network namespace whose loopback is limited to this many
            Gbit/s (:mod:`.slow_link`); ``None``: unthrottled.
        link_burst_kb: the token bucket's size in KiB (with ``link_gbit``): what the link
            lets through at once after an idle gap.
    """

    model: str = "gpt-ref"
    world: int = 2
    steps: int = 4
    warmup: int = 2
    batch_size: int = 4
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    seed: int = 0
    lr: float = 1e-4
    profile: bool = True
    profile_rounds: int = 2
    memory: bool = True
    top_ops: int = 12
    timeout: float = 1200.0
    link_gbit: float | None = None
    link_burst_kb: int = DEFAULT_BURST_KB

    def __post_init__(self) -> None:
        if self.model not in GPT_CONFIGS:
            raise ValueError(
                f"unknown bench model {self.model!r}: expected one of {', '.join(GPT_CONFIGS)}"
            )
        for name in ("world", "steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if self.profile_rounds < 1:
            raise ValueError(f"--profile-rounds must be >= 1, got {self.profile_rounds}")
        if self.link_gbit is not None and not self.link_gbit > 0:
            raise ValueError(f"--link-gbit must be > 0, got {self.link_gbit}")
        check_burst_kb(self.link_burst_kb)
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown or not self.systems:
            raise ValueError(
                f"unknown or empty --systems {','.join(unknown) or '(none)'}: expected a "
                f"comma-separated subset of {','.join(SYSTEMS)}"
            )


# ---------------------------------------------------------------------------------------------
# Command line.


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


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` arguments to ``parser``.

    One add_argument per flag; long by nature.
    """
    parser.add_argument(
        "--model",
        default="gpt-ref",
        choices=BENCH_MODELS,
        help="GPT shape (default: gpt-ref, the DESIGN.md reference model)",
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
    """The :class:`BenchOptions` of arguments parsed by a :func:`configure_parser` parser."""
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
