"""What one ``raggedfsdp bench`` invocation runs: the systems and the options.

Their flags are :mod:`raggedfsdp.cli.bench`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..models import GPT_CONFIGS
from .slow_link import DEFAULT_BURST_KB, check_burst_kb

__all__ = ["BENCH_MODELS", "DEFAULT_SYSTEMS", "SYSTEMS", "BenchOptions"]

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
        # tc takes a finite rate only (inf reached it, and failed inside it).
        if self.link_gbit is not None and not 0 < self.link_gbit < math.inf:
            raise ValueError(f"--link-gbit must be a finite rate > 0, got {self.link_gbit}")
        check_burst_kb(self.link_burst_kb)
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown or not self.systems:
            raise ValueError(
                f"unknown or empty --systems {','.join(unknown) or '(none)'}: expected a "
                f"comma-separated subset of {','.join(SYSTEMS)}"
            )
