"""``raggedfsdp bench``: step time, copies, bytes and memory of raggedfsdp against FSDP2 and DDP.

This module drives the phases (timing, then memory, each in freshly spawned processes) and merges
what the ranks report into a JSON-ready dict, which :mod:`raggedfsdp.cli.bench` prints; the options,
systems, profile analysis and memory phase are :mod:`.options`, :mod:`.systems`, :mod:`.profile` and
:mod:`.memory`. The systems, the phases and how bytes are counted: [Note: the protocol] at
:func:`run_bench`.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from .._host import default_device
from ..models import GPT, GPT_CONFIGS
from ..spawn import run_on_ranks
from .memory import memory_phase
from .options import DEFAULT_SYSTEMS, SYSTEMS, BenchOptions
from .profile import profile_step
from .slow_link import DEFAULT_BURST_KB, throttled_loopback
from .systems import STEP_KEYS, build, make_batches

__all__ = ["run_bench"]


# ---------------------------------------------------------------------------------------------
# Driver (the parent process): launch the phases, merge what the ranks report.


# [Note: the protocol] (docs/design.md, "Benchmark protocol") Each system trains the same GPT from
# the same seed on the same batches, with ``torch.optim.AdamW`` in fp32, one thread per rank:
#
# - ``raggedfsdp``       ``FSDPBackend`` with zero copy (parameters and gradients are views of the
#   bucket buffers);
# - ``raggedfsdp-copy``  the same with ``DBufferConfig(zero_copy=False)`` (FSDP2-style copies);
# - ``fsdp2``            ``torch.distributed.fsdp.fully_shard`` on each block, then the root;
# - ``fsdp2-last``       the same with ``reshard_after_forward=False`` on the last block, as
#   torchtitan configures it (raggedfsdp keeps that unit unsharded by itself);
# - ``ddp``              ``DistributedDataParallel`` with its defaults;
# - ``floor``            every rank trains its own unsharded replica on its per-rank batch with no
#   communication at all. The ranks run it *concurrently*, so it sees the same core and
#   memory-bandwidth contention as the distributed systems: it is the limit a W-rank step can reach
#   on this machine.
#
# Phases, each in freshly spawned processes (one per rank):
#
# 1. **timing**: all selected systems live side by side in each rank process and run *interleaved*:
#    round ``k`` gives every system one step on batch ``k``, in an order rotated by ``k``, each step
#    starting at a barrier, so machine noise and thermal drift hit all systems alike. A step
#    (zero_grad, forward, backward, optimizer) is timed on every rank; its time is the slowest
#    rank's; the reported figure is the median over the measured rounds after the warm-ups (with the
#    best step and the median per-round ratio beside it, which resist noise from other work on a
#    shared machine). Then ``profile_rounds`` more steps of each system run under ``torch.profiler``
#    (not timed) to count copy-like operators, measure collective sizes and split the step's
#    main-thread time by kind.
# 2. **memory** (per system, a fresh process group each): the profiler's allocation tracking is on
#    from before the model is built, so the allocator's running total in its allocation records is
#    exactly the live tensor bytes this process allocated for that system alone; its maximum during
#    the last step is the tensor high-water mark, and what is live at that moment is listed by
#    allocation site. Peak RSS of the same fresh process is reported beside it. (Peak RSS of the
#    timing processes would mix all systems, so it is not used.) On CUDA the tensor figures are
#    ``torch.cuda`` allocator statistics instead.
#
# Collective bytes follow :class:`raggedfsdp.runtime.RuntimeStats`: per rank, what the rank feeds
# into the collective (all-gather: its shard; reduce-scatter: the whole unsharded gradient;
# all-reduce: the tensor). For every system they are read from the profiler (the ``c10d::`` operator
# input shapes; raggedfsdp's point-to-point collectives on Gloo from Gloo's ``gloo:send`` records);
# Gloo runs a reduce-scatter as a full all-reduce, so the all-reduce row counts only Gloo
# all-reduces that no reduce-scatter issued. raggedfsdp's own counters are reported beside them.
def run_bench(options: BenchOptions, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the benchmark and return its results as a JSON-ready dict.

    The timing phase (every system, interleaved), then, unless ``options.memory`` is off, one
    memory phase per system; ``log`` gets a line per phase.
    """
    started = time.perf_counter()
    note = _elapsed_log(log, started)
    note(
        f"timing: {', '.join(options.systems)} on {options.model}, W={options.world}, "
        f"{options.warmup} warm-up + {options.steps} measured steps each, interleaved"
    )
    load_before = _loadavg()
    # the timing phase only
    with throttled_loopback(options.link_gbit, options.link_burst_kb) as netns:
        ranks = run_on_ranks(
            _timing_phase, options.world, options, timeout=options.timeout, netns=netns
        )
    load_after = _loadavg()
    systems = _merge_timing(options, ranks)
    memory_note = _run_memory_phases(options, systems, note)
    _add_ratios(systems)
    return {
        "options": asdict(options),
        "command": _command_line(options),
        "environment": _environment(ranks[0], load_before, load_after),
        "model": _model_summary(options.model),
        "systems": systems,
        "targets": _targets(systems),
        "notes": _notes(options, memory_note),
        "wall_seconds": time.perf_counter() - started,
    }


def _elapsed_log(log: Callable[[str], None] | None, started: float) -> Callable[[str], None]:
    """``log`` with the seconds since ``started`` before each message (a no-op without one)."""

    def note(message: str) -> None:
        if log is not None:
            log(f"{time.perf_counter() - started:6.1f}s  {message}")

    return note


def _run_memory_phases(
    options: BenchOptions, systems: dict[str, Any], note: Callable[[str], None]
) -> str | None:
    """Each system's memory phase in fresh processes, merged into its entry of ``systems``;
    returns the note to report when the phase is skipped."""
    if not options.memory:
        return "memory phase skipped (--no-memory)"
    for name in options.systems:
        note(f"memory: {name} in fresh processes")
        mem = run_on_ranks(memory_phase, options.world, options, name, timeout=options.timeout)
        systems[name]["memory"] = _merge_memory(mem)
    return None


def _environment(
    rank0: dict[str, Any], load_before: list[float] | None, load_after: list[float] | None
) -> dict[str, Any]:
    """The software and machine the benchmark ran on, with the load around the timing phase."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "backend": rank0["backend"],
        "device": rank0["device"],
        "threads_per_rank": rank0["threads"],
        "loadavg_before_timing": load_before,
        "loadavg_after_timing": load_after,
    }


def _model_summary(name: str) -> dict[str, Any]:
    """The GPT shape ``name``: its parameter count and dimensions."""
    cfg = GPT_CONFIGS[name]
    return {
        "name": name,
        "params": _num_params(name),
        "d_model": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "vocab_size": cfg.vocab_size,
        "seq_len": cfg.seq_len,
    }


def _command_line(options: BenchOptions) -> str:
    """The ``raggedfsdp bench`` command that reruns the timed part of ``options``."""
    parts = [
        "raggedfsdp bench",
        f"--model {options.model}",
        f"--world {options.world}",
        f"--steps {options.steps}",
        f"--warmup {options.warmup}",
        f"--batch-size {options.batch_size}",
    ]
    if options.systems != DEFAULT_SYSTEMS:
        parts.append(f"--systems {','.join(options.systems)}")
    if options.link_gbit is not None:
        parts.append(f"--link-gbit {options.link_gbit:g}")
        if options.link_burst_kb != DEFAULT_BURST_KB:
            parts.append(f"--link-burst-kb {options.link_burst_kb}")
    if options.seed:
        parts.append(f"--seed {options.seed}")
    return " ".join(parts)


def _notes(options: BenchOptions, memory_note: str | None) -> list[str]:
    """What the reported figures mean, one note each, then ``memory_note`` if any."""
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
    if options.link_gbit is not None:
        notes.append(
            f"link: the timing phase's ranks talked over a loopback rate-limited to "
            f"{options.link_gbit:g} Gbit/s with {options.link_burst_kb} KiB bursts (tc tbf in a "
            f"network namespace), shared by all ranks: each gets the rate / W when all send "
            f"at once; memory phases unthrottled"
        )
    if memory_note:
        notes.append(memory_note)
    return notes


def _loadavg() -> list[float] | None:
    """1, 5 and 15-minute load averages: other work on the machine shows up here."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _num_params(name: str) -> int:
    """Parameters of GPT shape ``name`` (built on the meta device: no memory)."""
    return GPT(GPT_CONFIGS[name], device="meta").num_params()


def _merge_timing(options: BenchOptions, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per system: slowest-rank step times per round, medians, the profile of rank 0."""
    systems = {name: _system_entry(options, name, ranks) for name in options.systems}
    _add_beyond_floor(systems)
    return systems


def _system_entry(options: BenchOptions, name: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's figures: its step times, its own counters and rank 0's profile."""
    per_rank = [r["records"][name] for r in ranks]
    entry: dict[str, Any] = {
        "label": SYSTEMS[name],
        **_step_figures(_slowest_rank_steps(per_rank), options.warmup),
        "losses_rank0": [rec["loss"] for rec in per_rank[0]],
    }
    stats = _runtime_stats(per_rank, options.warmup)
    if stats is not None:
        entry["runtime_stats"] = stats
    profile = ranks[0]["profiles"].get(name)
    if profile is not None:  # the same dicts: what is added to "copies" shows in the profile too
        entry["profile"] = profile
        entry["copies"] = profile["copies"]
        entry["collectives"] = profile["collectives"]
    return entry


def _slowest_rank_steps(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, float]]:
    """Per round, each step figure of :data:`STEP_KEYS` at its maximum over ranks."""
    rounds = len(per_rank[0])
    return [{key: max(rec[i][key] for rec in per_rank) for key in STEP_KEYS} for i in range(rounds)]


def _step_figures(steps: list[dict[str, float]], warmup: int) -> dict[str, Any]:
    """Medians over the measured rounds (those after ``warmup``), the best step and the spread."""
    measured = steps[warmup:]
    totals = [s["total"] for s in measured]
    med = {key: statistics.median(s[key] for s in measured) for key in steps[0]}
    return {
        "step_s": med["total"],
        "phases_s": {k: med[k] for k in ("fwd", "bwd", "opt")},
        "page_faults_per_step": med["page_faults"],
        "runqueue_s": med["runqueue"],
        "cpu_s": med["cpu"],
        "main_cpu_s": med["main_cpu"],
        "best_step_s": min(totals),
        "step_times_s": totals,
        "warmup_times_s": [s["total"] for s in steps[:warmup]],
        "spread": (max(totals) - min(totals)) / med["total"],
    }


def _runtime_stats(per_rank: list[list[dict[str, Any]]], warmup: int) -> dict[str, float] | None:
    """The system's own counters (raggedfsdp's), median over ranks and measured rounds; None
    for a system without them."""
    rounds = len(per_rank[0])
    stats = [rec[i].get("stats") for rec in per_rank for i in range(warmup, rounds)]
    if not stats or stats[0] is None:
        return None
    return _median_stats([s for s in stats if s is not None])


def _add_beyond_floor(systems: dict[str, Any]) -> None:
    """Add to each profiled system its framework copies beyond the floor's (if it was run)."""
    floor = systems.get("floor", {}).get("profile")
    if floor is None:
        return
    for entry in systems.values():
        if "copies" in entry:
            entry["copies"]["beyond_floor"] = (
                entry["copies"]["framework"] - floor["copies"]["framework"]
            )


def _median_stats(stats: list[dict[str, float]]) -> dict[str, float]:
    """The median of each counter over ``stats``."""
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
    """Add each system's step-time ratios to FSDP2 and to the floor (None where not run)."""
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
# Phase 1: interleaved timing, then one profiled step per system.


def _timing_phase(rank: int, world: int, options: BenchOptions) -> dict[str, Any]:
    """Rank ``rank``'s timed steps of every system, interleaved, then its profiled steps."""
    device = default_device()
    runners = {name: build(name, options, device) for name in options.systems}
    rounds = options.warmup + options.steps
    batches = make_batches(options, rounds + 1, rank, world, device)
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
            profile = profile_step(runners[name], batches[rounds], options.top_ops)
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
