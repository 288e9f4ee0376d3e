"""``raggedfsdp bench``: step time, copies, bytes and memory of raggedfsdp against FSDP2 and DDP.

[Note: the protocol] (DESIGN.md, "Benchmark protocol") Every system trains the same GPT from the
same seed on the same batches, with ``torch.optim.AdamW`` in fp32, one thread per rank:

- ``raggedfsdp``       ``FSDPBackend`` with zero copy (parameters and gradients are views of the
                       bucket buffers);
- ``raggedfsdp-copy``  the same with ``DBufferConfig(zero_copy=False)`` (FSDP2-style copies);
- ``fsdp2``            ``torch.distributed.fsdp.fully_shard`` on each block, then the root;
- ``ddp``              ``DistributedDataParallel`` with its defaults;
- ``floor``            every rank trains its own unsharded replica on its per-rank batch with no
                       communication at all. The ranks run it *concurrently*, so it sees the same
                       core and memory-bandwidth contention as the distributed systems: it is the
                       limit a W-rank step can reach on this machine.

Phases, each in freshly spawned processes (one per rank):

1. **timing**: all selected systems live side by side in each rank process and run
   *interleaved*: round ``k`` gives every system one step on batch ``k``, in an order rotated by
   ``k``, each step starting at a barrier, so machine noise and thermal drift hit all systems
   alike. A step (zero_grad, forward, backward, optimizer) is timed on every rank; its time is the
   slowest rank's; the reported figure is the median over the measured rounds after the warm-ups
   (with the best step and the median per-round ratio beside it, which resist noise from other
   work on a shared machine). Then ``profile_rounds`` more steps of each system run under
   ``torch.profiler`` (not timed) to count copy-like operators, measure collective sizes and
   split the step's main-thread time by kind.
2. **memory** (per system, a fresh process group each): the profiler's allocation tracking is on
   from before the model is built, so the allocator's running total in its allocation records is
   exactly the live tensor bytes this process allocated for that system alone; its maximum
   during the last step is the tensor high-water mark, and what is live at that moment is
   listed by allocation site. Peak RSS of the same fresh process is reported beside it. (Peak
   RSS of the timing processes would mix all systems, so it is not used.) On CUDA the tensor
   figures are ``torch.cuda`` allocator statistics instead.

Collective bytes follow :class:`raggedfsdp.metrics.RuntimeStats`: per rank, what the rank feeds
into the collective (all-gather: its shard; reduce-scatter: the whole unsharded gradient;
all-reduce: the tensor). For every system they are read from the profiler (the ``c10d::`` operator
input shapes; raggedfsdp's point-to-point collectives on Gloo from Gloo's ``gloo:send`` records);
Gloo runs a reduce-scatter as a full all-reduce, so the all-reduce row counts only Gloo
all-reduces that no reduce-scatter issued. raggedfsdp's own counters are reported beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
import weakref
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .bench_report import render, render_markdown
from .spawn import run_on_ranks

__all__ = [
    "SYSTEMS",
    "BenchOptions",
    "configure_parser",
    "options_from_args",
    "render",
    "render_markdown",
    "run",
    "run_bench",
]

SYSTEMS: dict[str, str] = {
    "raggedfsdp": "raggedfsdp (zero copy)",
    "raggedfsdp-copy": "raggedfsdp (zero_copy=False)",
    "fsdp2": "PyTorch FSDP2 (fully_shard)",
    "ddp": "DDP",
    "floor": "compute floor (no comm)",
}
"""Every system the bench knows, in report order."""

BENCH_MODELS = ("gpt-ref", "gpt-small", "gpt-tiny", "gpt-medium")

#: Operators that copy tensor data. Counted per name wherever they occur; the per-step *total*
#: counts only the outermost ones (``aten::clone`` calls ``aten::copy_``: one copy, not two).
COPY_OPS = frozenset(
    {
        "aten::copy_",
        "aten::_copy_from",
        "aten::_copy_from_and_resize",
        "aten::clone",
        "aten::contiguous",
        "aten::_to_copy",
        "aten::cat",
        "aten::_cat",
        "aten::stack",
        "aten::_chunk_cat",
        "aten::chunk_cat",
        "aten::split_with_sizes_copy",
        "aten::narrow_copy",
        "aten::index_copy_",
        "aten::_foreach_copy_",
        "fsdp::all_gather_copy_in",
        "fsdp::split_with_sizes_copy",
        "fsdp::chunk_cat",
    }
)
#: Not copies, but whole-buffer writes worth seeing beside them.
FILL_OPS = frozenset({"aten::zero_", "aten::fill_"})

_COLLECTIVE_KINDS = {
    "c10d::_allgather_base_": "all_gather",
    "c10d::allgather_into_tensor_coalesced_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
}
#: raggedfsdp's ranges around its collectives; on Gloo they are point-to-point transfers
#: (collectives.py), whose sizes only Gloo's own ``gloo:send`` records carry.
_P2P_RANGES = {
    "raggedfsdp::all_gather": "all_gather",
    "raggedfsdp::reduce_scatter": "reduce_scatter",
}
_STEP_RANGE = "bench::step"
_WAIT_RANGE = "bench::wait"


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
    """

    model: str = "gpt-ref"
    world: int = 2
    steps: int = 4
    warmup: int = 2
    batch_size: int = 4
    systems: tuple[str, ...] = tuple(SYSTEMS)
    seed: int = 0
    lr: float = 1e-4
    profile: bool = True
    profile_rounds: int = 2
    memory: bool = True
    top_ops: int = 12
    timeout: float = 1200.0

    def __post_init__(self) -> None:
        from .models import GPT_CONFIGS

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
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown systems {','.join(unknown) or '(none)'}: expected a comma-separated subset "
            f"of {','.join(SYSTEMS)}"
        )
    return tuple(s for s in SYSTEMS if s in names)  # report order, no duplicates


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` arguments to ``parser``."""
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
        default=tuple(SYSTEMS),
        metavar="S[,S...]",
        help=f"systems to run (default: all of {','.join(SYSTEMS)})",
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
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def options_from_args(args: argparse.Namespace) -> BenchOptions:
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
    )


def run(args: argparse.Namespace) -> int:
    """Run ``raggedfsdp bench``; returns the exit status."""
    options = options_from_args(args)
    results = run_bench(options, log=None if args.json else _stderr_log)
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        render(results, sys.stdout)
    return 0


def _stderr_log(message: str) -> None:
    sys.stderr.write(f"[bench] {message}\n")
    sys.stderr.flush()


# ---------------------------------------------------------------------------------------------
# Driver (the parent process): launch the phases, merge what the ranks report.


def run_bench(options: BenchOptions, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the benchmark and return its results as a JSON-ready dict."""
    started = time.perf_counter()

    def note(message: str) -> None:
        if log is not None:
            log(f"{time.perf_counter() - started:6.1f}s  {message}")

    note(
        f"timing: {', '.join(options.systems)} on {options.model}, W={options.world}, "
        f"{options.warmup} warm-up + {options.steps} measured steps each, interleaved"
    )
    load_before = _loadavg()
    ranks = run_on_ranks(_timing_phase, options.world, options, timeout=options.timeout)
    load_after = _loadavg()
    systems = _merge_timing(options, ranks)
    memory_note = None
    if options.memory:
        for name in options.systems:
            note(f"memory: {name} in fresh processes")
            mem = run_on_ranks(_memory_phase, options.world, options, name, timeout=options.timeout)
            systems[name]["memory"] = _merge_memory(mem)
    else:
        memory_note = "memory phase skipped (--no-memory)"
    _add_ratios(systems)
    cfg = _gpt_config(options.model)
    backend = ranks[0]["backend"]
    return {
        "options": asdict(options),
        "command": _command_line(options),
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "backend": backend,
            "device": ranks[0]["device"],
            "threads_per_rank": ranks[0]["threads"],
            "loadavg_before_timing": load_before,
            "loadavg_after_timing": load_after,
        },
        "model": {
            "name": options.model,
            "params": _num_params(options.model),
            "d_model": cfg.d_model,
            "n_layer": cfg.n_layer,
            "n_head": cfg.n_head,
            "vocab_size": cfg.vocab_size,
            "seq_len": cfg.seq_len,
        },
        "systems": systems,
        "targets": _targets(systems),
        "notes": _notes(options, memory_note),
        "wall_seconds": time.perf_counter() - started,
    }


def _command_line(options: BenchOptions) -> str:
    parts = [
        "raggedfsdp bench",
        f"--model {options.model}",
        f"--world {options.world}",
        f"--steps {options.steps}",
        f"--warmup {options.warmup}",
        f"--batch-size {options.batch_size}",
    ]
    if options.systems != tuple(SYSTEMS):
        parts.append(f"--systems {','.join(options.systems)}")
    if options.seed:
        parts.append(f"--seed {options.seed}")
    return " ".join(parts)


def _notes(options: BenchOptions, memory_note: str | None) -> list[str]:
    notes = [
        "step time: median over measured rounds of the slowest rank's step (zero_grad + forward "
        "+ backward + AdamW step), systems interleaved round by round",
        "floor: every rank trains an unsharded replica on its per-rank batch with no "
        "communication, concurrently (same contention as the distributed systems)",
        "best: the fastest measured step; per-round: median over rounds of the ratio of steps "
        "run back to back (both resist noise from other work on the machine better than the "
        "median; see runqueue s: time the compute thread was runnable but had no CPU)",
        "CPU s: CPU seconds per step of the whole rank process (compute thread + Gloo threads) "
        "and of the compute thread alone, max over ranks: hardly moved by other work on the "
        "machine; on 2 cores for 2 ranks, Gloo's CPU work cannot hide behind compute",
        "copy ops: outermost copy-like operators in one profiled step; 'backend' = inside a "
        "c10d/Gloo operator, on a Gloo thread, or inside Work.wait(); 'beyond floor' = "
        "'framework' minus the floor's (copies the model itself makes)",
        "collective bytes: per rank, input of the collective, from the profiler's c10d operator "
        "shapes (raggedfsdp on Gloo: its point-to-point transfers, from Gloo's send records); "
        "Gloo's own reduce-scatter (FSDP2's) is a full all-reduce + clone + copy",
        "memory: fresh processes per system; tensor high-water = max of the profiler's running "
        "allocation sum (all tensors this system allocated, from model construction on) during "
        "the last step; peak RSS includes the Python/torch runtime and the profiler's records",
    ]
    if memory_note:
        notes.append(memory_note)
    return notes


def _loadavg() -> list[float] | None:
    """1, 5 and 15-minute load averages: other work on the machine shows up here."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _gpt_config(name: str):
    from .models import GPT_CONFIGS

    return GPT_CONFIGS[name]


def _num_params(name: str) -> int:
    from .models import GPT

    return GPT(_gpt_config(name), device="meta").num_params()


def _merge_timing(options: BenchOptions, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per system: slowest-rank step times per round, medians, the profile of rank 0."""
    out: dict[str, Any] = {}
    for name in options.systems:
        per_rank = [r["records"][name] for r in ranks]
        rounds = len(per_rank[0])
        steps = [
            {key: max(rec[i][key] for rec in per_rank) for key in _STEP_KEYS} for i in range(rounds)
        ]
        measured = steps[options.warmup :]
        med = {key: statistics.median(s[key] for s in measured) for key in steps[0]}
        entry: dict[str, Any] = {
            "label": SYSTEMS[name],
            "step_s": med["total"],
            "phases_s": {k: med[k] for k in ("fwd", "bwd", "opt")},
            "page_faults_per_step": med["page_faults"],
            "runqueue_s": med["runqueue"],
            "cpu_s": med["cpu"],
            "main_cpu_s": med["main_cpu"],
            "best_step_s": min(s["total"] for s in measured),
            "step_times_s": [s["total"] for s in measured],
            "warmup_times_s": [s["total"] for s in steps[: options.warmup]],
            "spread": (max(s["total"] for s in measured) - min(s["total"] for s in measured))
            / med["total"],
            "losses_rank0": [rec["loss"] for rec in per_rank[0]],
        }
        stats = [rec[i].get("stats") for rec in per_rank for i in range(options.warmup, rounds)]
        if stats and stats[0] is not None:
            entry["runtime_stats"] = _median_stats([s for s in stats if s is not None])
        profile = ranks[0]["profiles"].get(name)
        if profile is not None:
            entry["profile"] = profile
            entry["copies"] = profile["copies"]
            entry["collectives"] = profile["collectives"]
        out[name] = entry
    floor = out.get("floor", {}).get("profile")
    for entry in out.values():
        if floor is not None and "copies" in entry:
            entry["copies"]["beyond_floor"] = (
                entry["copies"]["framework"] - floor["copies"]["framework"]
            )
    return out


def _median_stats(stats: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(s[key] for s in stats) for key in stats[0]}


def _merge_memory(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-rank memory figures and their maximum over ranks."""
    keys = [k for k in ranks[0] if isinstance(ranks[0][k], int | float)]
    return {"per_rank": ranks, **{f"max_{k}": max(r[k] for r in ranks) for k in keys}}


#: The issue's targets for raggedfsdp (zero copy) against FSDP2.
STEP_RATIO_TARGET = 0.90


def _targets(systems: dict[str, Any]) -> dict[str, Any]:
    """raggedfsdp against FSDP2: step-time ratio <= 0.90 and peak tensor memory per rank <=."""
    ours, fsdp2 = systems.get("raggedfsdp"), systems.get("fsdp2")
    if ours is None or fsdp2 is None:
        return {}
    out: dict[str, Any] = {
        "step_ratio": {
            "value": ours["vs_fsdp2"],
            "best_value": ours["best_vs_fsdp2"],
            "paired_value": ours["paired_vs_fsdp2"],
            "target": STEP_RATIO_TARGET,
            "met": ours["vs_fsdp2"] <= STEP_RATIO_TARGET,
        }
    }
    if "memory" in ours and "memory" in fsdp2:
        mine = ours["memory"]["max_tensor_peak_bytes"]
        theirs = fsdp2["memory"]["max_tensor_peak_bytes"]
        out["peak_memory"] = {
            "value_bytes": mine,
            "fsdp2_bytes": theirs,
            "ratio": mine / theirs if theirs else None,
            "met": mine <= theirs,
        }
    return out


def _add_ratios(systems: dict[str, Any]) -> None:
    for ref in ("fsdp2", "floor"):
        median = systems.get(ref, {}).get("step_s")
        best = systems.get(ref, {}).get("best_step_s")
        rounds = systems.get(ref, {}).get("step_times_s")
        for entry in systems.values():
            entry[f"vs_{ref}"] = entry["step_s"] / median if median else None
            entry[f"best_vs_{ref}"] = entry["best_step_s"] / best if best else None
            # Round k of every system ran within seconds of each other: the median of the
            # per-round ratios cancels noise that drifts slower than a round.
            entry[f"paired_vs_{ref}"] = (
                statistics.median(a / b for a, b in zip(entry["step_times_s"], rounds, strict=True))
                if rounds
                else None
            )


# ---------------------------------------------------------------------------------------------
# One system on one rank.


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Runner:
    """A model, its optimizer and how to read its own counters."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    stats: Callable[[], dict[str, float]] | None = None
    reset_stats: Callable[[], None] | None = None
    #: bytes of full original parameters still alive after wrapping (not the trained ones)
    retained_original_bytes: int = 0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        """One training step; wall times of its phases."""
        if self.reset_stats is not None:
            self.reset_stats()
        _sync(self.device)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        waited = _runqueue_seconds()
        cpu, main_cpu = _process_cpu_seconds(), time.thread_time()
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(x, y)
        _sync(self.device)
        t1 = time.perf_counter()
        loss.backward()
        _sync(self.device)
        t2 = time.perf_counter()
        self.optimizer.step()
        _sync(self.device)
        t3 = time.perf_counter()
        return {
            "total": t3 - t0,
            "fwd": t1 - t0,
            "bwd": t2 - t1,
            "opt": t3 - t2,
            # first touches of fresh pages: allocator churn (freed and re-mapped buffers)
            "page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
            # time this thread was runnable but not running: contention (others' or our own
            # communication threads) stretching the step
            "runqueue": _runqueue_seconds() - waited,
            # CPU seconds the step burnt: the whole process (compute thread plus the
            # communication backend's threads) and the compute thread alone
            "cpu": _process_cpu_seconds() - cpu,
            "main_cpu": time.thread_time() - main_cpu,
            "loss": float(loss.detach()),
            "stats": self.stats() if self.stats is not None else None,
        }


_STEP_KEYS = ("total", "fwd", "bwd", "opt", "page_faults", "runqueue", "cpu", "main_cpu")


def _process_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _runqueue_seconds() -> float:
    """Seconds the calling thread has spent runnable but waiting for a CPU (Linux schedstat)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _build(name: str, options: BenchOptions, device: torch.device) -> _Runner:
    """Build ``name``'s model from the shared seed and wrap it."""
    from .models import GPT

    torch.manual_seed(options.seed)
    model = GPT(_gpt_config(options.model), device=device)
    originals = [weakref.ref(p) for p in model.parameters()]
    stats = reset = None
    if name in ("raggedfsdp", "raggedfsdp-copy"):
        from .backend import FSDPBackend
        from .dbuffer import DBufferConfig

        FSDPBackend(model, dbuffer_config=DBufferConfig(zero_copy=name == "raggedfsdp"))
        stats, reset = model.stats, model.reset_stats  # type: ignore[attr-defined]
    elif name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.blocks:  # type: ignore[attr-defined]
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    elif name != "floor":
        raise ValueError(f"unknown system {name!r}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.lr)
    gc.collect()
    # Bytes of the model's own (unwrapped, full) parameters that wrapping left alive: the
    # parameters themselves for DDP and the floor; for a sharded system, memory it should free.
    alive = [p for p in (ref() for ref in originals) if p is not None]
    own = {id(p) for p in model.parameters()}
    retained = sum(p.numel() * p.element_size() for p in alive if id(p) not in own)
    return _Runner(name, model, optimizer, device, stats, reset, retained)


def _batches(options: BenchOptions, count: int, rank: int, world: int, device: torch.device):
    """Per-rank batches 0..count-1 of a random token stream; the same for every system."""
    from .data import sample_batch

    cfg = _gpt_config(options.model)
    gen = torch.Generator().manual_seed(options.seed)
    tokens = torch.randint(0, cfg.vocab_size, (1 << 20,), generator=gen, dtype=torch.int64)
    out = []
    for step in range(count):
        x, y = sample_batch(
            tokens,
            step,
            seq_len=cfg.seq_len,
            batch_size=options.batch_size * world,
            seed=options.seed,
            rank=rank,
            world_size=world,
        )
        out.append((x.to(device), y.to(device)))
    return out


# ---------------------------------------------------------------------------------------------
# Phase 1: interleaved timing, then one profiled step per system.


def _timing_phase(rank: int, world: int, options: BenchOptions) -> dict[str, Any]:
    device = _device()
    runners = {name: _build(name, options, device) for name in options.systems}
    rounds = options.warmup + options.steps
    batches = _batches(options, rounds + 1, rank, world, device)
    records: dict[str, list[dict[str, Any]]] = {name: [] for name in options.systems}
    order = list(options.systems)
    for k in range(rounds):
        shift = k % len(order)
        for name in order[shift:] + order[:shift]:  # rotate so no system always goes first
            dist.barrier()
            records[name].append(runners[name].step(*batches[k]))
    profiles: dict[str, Any] = {}
    for _ in range(options.profile_rounds if options.profile else 0):
        for name in options.systems:  # counts are the same every round; keep the fastest split
            dist.barrier()
            profile = _profile_step(runners[name], batches[rounds], options.top_ops)
            walls = [*profiles.get(name, {}).get("walls_s", []), profile["wall_s"]]
            if name not in profiles or profile["wall_s"] < profiles[name]["wall_s"]:
                profiles[name] = profile
            profiles[name]["walls_s"] = walls
    return {
        "records": records,
        "profiles": profiles,
        "backend": dist.get_backend(),
        "device": str(device),
        "threads": torch.get_num_threads(),
    }


@contextlib.contextmanager
def _labelled_waits() -> Iterator[None]:
    """Label every ``Work.wait()`` issued from Python for the profiler (while profiling only).

    raggedfsdp and FSDP2 wait on their collectives through ``Work.wait()``; DDP waits inside its
    C++ reducer, which this cannot see (that time stays in the untracked remainder).
    """
    from torch.autograd.profiler import record_function

    work_cls = dist.Work
    original = work_cls.wait

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        with record_function(_WAIT_RANGE):
            return original(self, *args, **kwargs)

    try:
        work_cls.wait = wait  # type: ignore[method-assign]
    except (AttributeError, TypeError):  # a torch whose Work type is read-only
        yield
        return
    try:
        yield
    finally:
        work_cls.wait = original  # type: ignore[method-assign]


def _profile_step(runner: _Runner, batch: tuple[torch.Tensor, torch.Tensor], top: int):
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    with (
        _labelled_waits(),
        profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof,
        record_function(_STEP_RANGE),
    ):
        runner.step(*batch)
    return _analyse_profile(prof.events(), top, dist.get_world_size())


def _analyse_profile(events: Sequence[Any], top: int, world: int) -> dict[str, Any]:
    """Copy counts, collective sizes and a split of the step's CPU time, from one step."""
    step = next(e for e in events if e.name == _STEP_RANGE)
    main = step.thread
    wall_us = step.time_range.elapsed_us()
    # Each raggedfsdp collective range on the compute thread, with the bytes of the point-to-point
    # sends Gloo records inside it (its send records have no parent; match them by start time).
    p2p_ranges = sorted(
        (e.time_range.start, e.time_range.end, _P2P_RANGES[e.name], [])
        for e in events
        if e.name in _P2P_RANGES and e.thread == main
    )

    ops: Counter[str] = Counter()  # every copy-like (and fill) operator, nested ones too
    copies = Counter()  # outermost copy-like operators by where they run
    copies_by_name: dict[str, Counter[str]] = defaultdict(Counter)
    collectives: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "bytes": 0})
    gloo: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "bytes": 0})
    split_us: Counter[str] = Counter()
    self_us: Counter[str] = Counter()
    comm_thread_us = 0.0
    for e in events:
        if e.name == _STEP_RANGE or e.name == "[memory]":
            continue
        chain = _ancestors(e)
        on_main = e.thread == main
        if e.name in COPY_OPS or e.name in FILL_OPS:
            ops[e.name] += 1
        if e.name in COPY_OPS and not any(a in COPY_OPS for a in chain):
            where = _copy_site(e.name, chain, on_main)
            copies[where] += 1
            copies_by_name[where][e.name] += 1
        if e.name in _COLLECTIVE_KINDS and on_main:
            kind = _COLLECTIVE_KINDS[e.name]
            collectives[kind]["calls"] += 1
            collectives[kind]["bytes"] += _input_bytes(e, 1)
        elif e.name == "c10d::allreduce_" and on_main:
            collectives["all_reduce"]["calls"] += 1
        elif e.name.startswith(("c10d::broadcast", "c10d::allgather_")) and on_main:
            collectives[e.name.removeprefix("c10d::").rstrip("_")]["calls"] += 1
        if e.name == "gloo:send" and on_main:
            start = e.time_range.start
            for lo, hi, _, sends in p2p_ranges:
                if lo <= start <= hi:
                    sends.append(_input_bytes(e, 0))
        if e.name.startswith(("gloo:", "nccl:")):
            gloo[e.name]["calls"] += 1
            gloo[e.name]["bytes"] += _input_bytes(e, 0)
            if not on_main:  # duration on the backend's threads (includes waiting for peers)
                comm_thread_us += e.cpu_time_total
        if on_main:
            self_us[e.name] += e.self_cpu_time_total
            split_us[_time_kind(e.name, chain)] += e.self_cpu_time_total
    # As RuntimeStats counts them: an all-gather's input is the one shard sent to every peer; a
    # reduce-scatter's is the whole gradient, of which the W-1 peers' chunks are sent.
    for _, _, kind, sends in p2p_ranges:
        if sends:
            collectives[kind]["calls"] += 1
            if kind == "all_gather":
                collectives[kind]["bytes"] += sends[0]
            else:
                collectives[kind]["bytes"] += sum(sends) * world // (world - 1)
    # Gloo runs a reduce-scatter as an all-reduce of the full input; what remains of its
    # all-reduce bytes are real all-reduces (DDP buckets, HSDP), whose c10d op records no shapes.
    if "all_reduce" in collectives:
        rs_bytes = collectives.get("reduce_scatter", {"bytes": 0})["bytes"]
        total = sum(v["bytes"] for k, v in gloo.items() if k.endswith("all_reduce"))
        collectives["all_reduce"]["bytes"] = max(0, total - rs_bytes)
    tracked = sum(split_us.values())
    split_us["untracked"] = max(0.0, wall_us - tracked)
    copy_ops = {
        "total": sum(copies.values()),
        "framework": copies["framework"],
        "backend": copies["backend"],
        "optimizer": copies["optimizer"],
        "by_name": {where: dict(sorted(c.items())) for where, c in sorted(copies_by_name.items())},
        "ops": dict(sorted(ops.items())),
    }
    return {
        "wall_s": wall_us / 1e6,
        "copies": copy_ops,
        "collectives": {k: dict(v) for k, v in sorted(collectives.items())},
        "backend_ops": {k: dict(v) for k, v in sorted(gloo.items())},
        "time_split_s": {k: v / 1e6 for k, v in sorted(split_us.items())},
        "comm_thread_s": comm_thread_us / 1e6,
        "top_ops": [{"name": name, "self_s": us / 1e6} for name, us in self_us.most_common(top)],
    }


def _ancestors(event: Any) -> list[str]:
    names = []
    parent = event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return names


def _copy_site(name: str, chain: list[str], on_main: bool) -> str:
    if not on_main or any(_is_comm(a) for a in chain):
        return "backend"
    if any(a.startswith("Optimizer.") for a in chain):
        return "optimizer"
    return "framework"


def _is_comm(name: str) -> bool:
    return name == _WAIT_RANGE or name.startswith(("c10d::", "gloo:", "nccl:"))


def _time_kind(name: str, chain: list[str]) -> str:
    """Which part of a step an event's self time belongs to."""
    names = [name, *chain]
    if _WAIT_RANGE in names:
        return "comm_wait"
    if any(n.startswith(("c10d::", "gloo:", "nccl:")) for n in names):
        return "comm_issue"
    if any(n.startswith("Optimizer.") for n in names):
        return "optimizer"
    if any(n in COPY_OPS for n in names):
        return "copies"
    if name in FILL_OPS:
        return "fills"
    if name.startswith(("aten::", "autograd::", "torch::")) or "Backward" in name:
        return "compute"
    return "framework_ranges"  # self time of user ranges (FSDP::*, raggedfsdp::*, DDP)


def _input_bytes(event: Any, index: int) -> int:
    shapes = getattr(event, "input_shapes", None) or []
    if index >= len(shapes) or not isinstance(shapes[index], list | tuple):
        return 0
    dtypes = getattr(event, "input_dtypes", None) or []
    size = _dtype_size(dtypes[index] if index < len(dtypes) else "float")
    return math.prod(shapes[index]) * size


_DTYPE_SIZES = {
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "long int": 8,
    "int": 4,
    "unsigned char": 1,
    "signed char": 1,
    "bool": 1,
}


def _dtype_size(name: str) -> int:
    return _DTYPE_SIZES.get(name, 4)


# ---------------------------------------------------------------------------------------------
# Phase 2: one system per fresh process group; allocation tracking from before construction.


def _current_rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: fall back to the high-water mark
        return _peak_rss()


def _peak_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _memory_phase(rank: int, world: int, options: BenchOptions, name: str) -> dict[str, Any]:
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    device = _device()
    batches = _batches(options, 2, rank, world, device)
    dist.barrier()
    rss_before = _current_rss()
    cuda_at_start = 0
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        runner = _build(name, options, device)
        built_stats = runner.stats() if runner.stats is not None else None
        for batch in batches:  # the last step has every state: grads, AdamW moments
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                cuda_at_start = torch.cuda.memory_allocated(device)
            with record_function(_STEP_RANGE):
                runner.step(*batch)
    result = _allocation_profile(prof)
    if device.type == "cuda":  # the tensors live on the GPU: its allocator's own figures
        result["cpu_tensor_peak_bytes"] = result["tensor_peak_bytes"]
        result["tensor_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        result["tensor_at_step_start_bytes"] = cuda_at_start
    result.update(
        retained_original_param_bytes=runner.retained_original_bytes,
        rss_before_bytes=rss_before,
        peak_rss_bytes=_peak_rss(),
        peak_rss_above_start_bytes=_peak_rss() - rss_before,
    )
    if runner.stats is not None:
        stats = runner.stats()
        result["framework_persistent_bytes"] = int(stats["persistent_bytes"])
        result["framework_peak_unsharded_bytes"] = int(stats["peak_unsharded_bytes"])
        if built_stats is not None:
            result["framework_persistent_bytes_at_build"] = int(built_stats["persistent_bytes"])
    return result


def _allocation_profile(prof: Any, top: int = 10) -> dict[str, Any]:
    """Live CPU tensor bytes over time from the profiler's allocation records, and what is live
    at the last step's peak (by allocation site).

    Each record carries the allocator's running total of the bytes allocated since profiling
    began (and still live); in a fresh process that is every tensor this system allocated.
    """
    from torch._C._profiler import _EventType

    steps: list[tuple[int, int]] = []
    records: list[tuple[int, int, int, int, str]] = []  # (time, ptr, size, live after, site)
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            if f.device.type == "cpu":
                site = _allocation_site(node) if f.alloc_size > 0 else ""
                records.append((node.start_time_ns, f.ptr, f.alloc_size, f.total_allocated, site))
        elif node.name == _STEP_RANGE:
            steps.append((node.start_time_ns, node.end_time_ns))
        stack.extend(node.children)
    records.sort(key=lambda r: r[0])
    start, end = max(steps)
    live: dict[int, tuple[int, str]] = {}
    at_start = peak = overall = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for when, ptr, size, total, site in records:
        if when < start:
            at_start = total
        if size > 0:
            live[ptr] = (size, site if when >= start else "(live before the step)")
        else:
            live.pop(ptr, None)
        overall = max(overall, total)
        if start <= when <= end and total > peak:
            peak, at_peak = total, dict(live)
    if peak < at_start:
        peak, at_peak = at_start, {}
    sites: Counter[str] = Counter()
    for size, site in at_peak.values():
        sites[site] += size
    return {
        "tensor_peak_bytes": peak,
        "tensor_at_step_start_bytes": at_start,
        "tensor_peak_incl_build_bytes": overall,
        "tensor_end_bytes": records[-1][3] if records else 0,
        "live_at_peak_by_site": [{"site": site, "bytes": n} for site, n in sites.most_common(top)],
    }


_ALLOCATOR_OPS = ("aten::empty", "aten::new_empty", "aten::resize_", "aten::zeros", "aten::ones")
_SCOPES = ("raggedfsdp::", "FSDP::", "Optimizer.", "autograd::engine", "DistributedDataParallel")


def _allocation_site(node: Any) -> str:
    """``op @ scope`` for an allocation: the operator that needed the memory and the framework
    range (or autograd node) it ran in."""
    chain = []
    parent = node.parent
    while parent is not None and parent.name != _STEP_RANGE:
        chain.append(parent.name)
        parent = parent.parent
    chain = [n.removeprefix("autograd::engine::evaluate_function: ") for n in chain]
    op = next((n for n in chain if not n.startswith(_ALLOCATOR_OPS)), "(no operator)")
    scope = next((n for n in chain if n.startswith(_SCOPES) or "Backward" in n), "")
    scope = scope or (chain[-1] if chain else "")
    return op if scope in ("", op) else f"{op} @ {scope}"
