"""The capacity planner's predictions against measurements here (docs/results/capacity.md).

1. **memory**: ``raggedfsdp bench``'s memory phase (the profiler's allocation records; one fresh
   launch per run) at W = 2, 3, 4 for gpt-tiny and gpt-small with AdamW and AdamW8bit, against
   :func:`raggedfsdp.capacity.cost.memory_breakdown`: persistent bytes and the tensor peak.
2. **step time**: ``raggedfsdp bench`` (raggedfsdp, FSDP2 and the compute floor, interleaved)
   at W=2, unthrottled and on the slow-link bed at 0.25, 1 and 2.5 Gbit/s (``--rates``). Two
   things are calibrated before, neither on the validated step times: the compute efficiency of
   the ``cpu-gloo`` preset, fitted to the first run's floor, and each system's own CPU work per
   step (``host_overhead_s``), its step at W = 1 (no communication) minus the model's there,
   from one W = 1 run of the systems and the floor. The link's CPU per byte on the bed
   (``link_cpu_s_per_byte``) is the link probe's at that rate minus its unthrottled one, probed
   right after each run's bench. The bed's bucket is ``--burst-kb`` (default
   32 KiB: a steady rate, as the model has) and shared by the ranks, so each gets ``RATE / W``.
   Two predictions per run: the preset with that per-rank rate as its link (``--link-gbit``),
   and the link as a probe measures it on the bed at that rate (with the host's own speed, the
   part of a collective that takes the cores, as a probe measures it on plain loopback).
3. **scale**: every zoo model planned and costed at W = 16,384 (wall clock).

    PYTHONPATH=src python benchmarks/bench_capacity.py [--quick] [--step-time-only] [--steps 4]
        [--rates none,0.25,1,2.5] [--burst-kb 32] [--out docs/results/capacity.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from raggedfsdp.bench import run_bench
from raggedfsdp.bench.link_probe import probe_link
from raggedfsdp.bench.memory import memory_phase
from raggedfsdp.bench.options import BenchOptions
from raggedfsdp.bench.slow_link import per_rank_gbit
from raggedfsdp.bench.systems import build, raggedfsdp_with
from raggedfsdp.capacity.capacity import CapacityOptions, capacity_report
from raggedfsdp.capacity.cost import (
    StepShape,
    UnitBytes,
    memory_breakdown,
    optimizer_state_bytes,
    unit_bytes,
)
from raggedfsdp.capacity.hardware import HARDWARE, hardware
from raggedfsdp.capacity.shapes import model_shape
from raggedfsdp.capacity.steptime import collective_bytes, step_time
from raggedfsdp.models import GPT, GPT_CONFIGS, MODEL_NAMES
from raggedfsdp.planner import ShardPlan, StructAwarePlanner
from raggedfsdp.spawn import run_on_ranks

BATCH = 2


def _measure(rank: int, world: int, model: str, optimizer: str) -> dict[str, int]:
    torch.set_num_threads(1)
    options = BenchOptions(model=model, world=world, batch_size=BATCH, systems=("raggedfsdp",))
    builder = build if optimizer == "adamw" else raggedfsdp_with(optimizer)
    result = memory_phase(rank, world, options, "raggedfsdp", builder)
    return {k: v for k, v in result.items() if isinstance(v, int)}


def _planned(
    model: str, optimizer: str, world: int
) -> tuple[GPT, list[ShardPlan], list[UnitBytes]]:
    module = GPT(GPT_CONFIGS[model], device="meta")
    planner = StructAwarePlanner(optimizer_type=None if optimizer == "adamw" else optimizer)  # type: ignore[arg-type]
    plans = planner.plan_model(module, world)
    return module, plans, unit_bytes(plans)


def memory_grid(worlds: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    for world in worlds:
        for model in ("gpt-tiny", "gpt-small"):
            for optimizer in ("adamw", "adamw8bit"):
                measured = run_on_ranks(_measure, world, model, optimizer, timeout=900)
                module, plans, units = _planned(model, optimizer, world)
                step = StepShape(batch=BATCH, seq_len=GPT_CONFIGS[model].seq_len, gloo=True)
                for rank, got in enumerate(measured):
                    state = optimizer_state_bytes(plans, optimizer, rank=rank)
                    want = memory_breakdown(
                        model_shape(module), units, step, state, world_size=world
                    )
                    rows.append(
                        {
                            "world": world,
                            "model": model,
                            "optimizer": optimizer,
                            "rank": rank,
                            "persistent_predicted": want.persistent,
                            "persistent_measured": got["tensor_at_step_start_bytes"],
                            "peak_predicted": want.peak,
                            "peak_measured": got["tensor_peak_bytes"],
                            "peak_error": want.peak / got["tensor_peak_bytes"] - 1,
                            "phase": want.phase,
                        }
                    )
                print(rows[-1], flush=True)
    return rows


def _bench(model: str, world: int, steps: int, systems: tuple[str, ...], **kw: Any) -> Any:
    options = BenchOptions(
        model=model,
        world=world,
        steps=steps,
        batch_size=BATCH,
        systems=systems,
        profile=False,
        memory=False,
        **kw,
    )
    results = run_bench(options)
    return {name: s["step_s"] for name, s in results["systems"].items()}, results["command"]


def _fit_efficiency(model: str, floor_s: float) -> float:
    """floor = compute / efficiency + optimizer (the W=1 plan: no communication): solved for
    the ``cpu-gloo`` preset's efficiency."""
    module, floor_plans, floor_units = _planned(model, "adamw", 1)
    step = StepShape(batch=BATCH, seq_len=GPT_CONFIGS[model].seq_len, gloo=True)
    at_peak = step_time(
        model_shape(module),
        floor_units,
        step,
        hardware("cpu-gloo", efficiency=1.0),
        1,
        optimizer_bytes=optimizer_state_bytes(floor_plans, "adamw"),
    )
    return at_peak.compute_s / (floor_s - at_peak.optimizer_s)


def _predict(
    model: str, world: int, system: str, overhead_s: float = 0.0, **figures: float
) -> dict[str, float]:
    """The model's step time on ``cpu-gloo`` with ``figures`` replaced and ``overhead_s`` of
    the system's own CPU work added, and its communication split into all-gather,
    reduce-scatter and FSDP2's buffer copies."""
    module, plans, units = _planned(model, "adamw", world)
    step = StepShape(batch=BATCH, seq_len=GPT_CONFIGS[model].seq_len, gloo=True)
    hw = hardware("cpu-gloo", **figures)
    state = optimizer_state_bytes(plans, "adamw")
    t = step_time(
        model_shape(module),
        units,
        step,
        hw,
        world,
        optimizer_bytes=state,
        system=system,
        host_overhead_s=overhead_s,
    )
    moved = collective_bytes(units, step, world, system)
    hop, bw = hw.hop_latency_s(world), hw.link_bytes_per_s(world)
    ag = (world - 1) * (moved.all_gather_calls * hop + moved.all_gather_bytes / bw)
    rs_shard = moved.reduce_scatter_bytes / world
    rs = (world - 1) * (moved.reduce_scatter_calls * hop + rs_shard / bw)
    return {
        **t.to_dict(),
        "all_gather_s": ag,
        "reduce_scatter_s": rs,
        "copies_s": t.comm_s - ag - rs,
        "link_bytes_per_s": bw,
        "latency_s": hop,
        "wire_bytes": moved.wire_bytes,
    }


def host_overheads(model: str, steps: int) -> dict[str, Any]:
    """Each system's CPU work per step that the model does not derive, from one W = 1 run
    (nothing to communicate): its measured step minus the model's, with the efficiency fitted
    to that run's floor (so raggedfsdp's is its step minus the floor; FSDP2's also leaves out
    the buffer copies the model gives it)."""
    systems = ("raggedfsdp", "fsdp2", "floor")
    measured, command = _bench(model, 1, steps, systems, warmup=2)
    fitted = {"efficiency": min(1.0, _fit_efficiency(model, measured["floor"]))}
    overhead = {
        system: max(0.0, measured[system] - _predict(model, 1, system, **fitted)["total_s"])
        for system in ("raggedfsdp", "fsdp2")
    }
    print(json.dumps({"w1": measured, "host_overhead_s": overhead}), flush=True)
    return {"command": command, "measured_s": measured, "host_overhead_s": overhead}


def step_times(
    model: str, world: int, steps: int, rates: tuple[float | None, ...], burst_kb: int
) -> Any:
    """Measured medians of raggedfsdp and FSDP2 at each link rate (``None``: unthrottled),
    against the model's prediction with the efficiency fitted once, to the first run's floor
    (every run also times the floor, to show how far the machine drifted), with and without
    the two CPU terms measured apart: the systems' host overheads at W = 1 and the bed's CPU
    per byte."""
    runs = []
    efficiency = None
    calibration = host_overheads(model, steps)
    calibration["unthrottled_probe"] = base = probe_link(None)
    calibration["unthrottled_cpu_s_per_byte"] = base_cpu = base["cpu_s_per_byte"]
    for rate in rates:
        systems = ("raggedfsdp", "fsdp2", "floor")
        link = {} if rate is None else {"link_gbit": rate, "link_burst_kb": burst_kb}
        measured, command = _bench(model, world, steps, systems, warmup=2, **link)
        if efficiency is None:
            efficiency = _fit_efficiency(model, measured["floor"])
        run: dict[str, Any] = {"link_gbit": rate, "command": command, "measured_s": measured}
        run["link_probe"] = probe = probe_link(rate, burst_kb)
        fitted = {"efficiency": min(1.0, efficiency)}
        plain = dict(fitted)  # the model without the two CPU terms measured apart
        if rate is not None:  # what the bed's packets cost the host beyond plain loopback
            fitted["link_cpu_s_per_byte"] = max(0.0, probe["cpu_s_per_byte"] - base_cpu)
        # the preset, with the bed's rate as the planner's --link-gbit: what each of the W
        # ranks gets when all send at once (the bed's bucket is shared: rate / W)
        per_rank = {} if rate is None else {"link_gbit": per_rank_gbit(rate, world)}
        preset = {**fitted, **per_rank}
        # the link as probed on the bed (both directions at once, one collective's fixed cost),
        # and the host's own speed as probed on plain loopback: on a host backend ``intra_*``
        # is the part of a collective that takes the cores, not the slower link
        probed = {**fitted, "inter_bytes_per_s": probe["both_ways"],
                  "inter_latency_s": probe["collective_s"], "intra_bytes_per_s":
                  base["both_ways"], "intra_latency_s": base["collective_s"]}  # fmt: skip
        for system in ("raggedfsdp", "fsdp2"):
            run[system] = {"measured_s": measured[system]}
            overhead = calibration["host_overhead_s"][system]
            for name, figures, extra in (
                ("preset", preset, overhead),
                ("probed_link", probed, overhead),
                ("preset_without_cpu_terms", {**plain, **per_rank}, 0.0),
            ):
                want = _predict(model, world, system, extra, **figures)
                want["ratio"] = want["total_s"] / measured[system]
                run[system][name] = want
        print(json.dumps(run, indent=1), flush=True)
        runs.append(run)
    return {"model": model, "world": world, "batch": BATCH, "burst_kb": burst_kb,
            "fitted_efficiency": efficiency, "w1_calibration": calibration,
            "runs": runs}  # fmt: skip


def scale() -> dict[str, float]:
    seconds = {}
    for name in MODEL_NAMES:
        options = CapacityOptions(batch=1, seq_len=4096, checkpointing=True)
        report = capacity_report(name, [16384], HARDWARE["h100"], options, find_smallest=False)
        seconds[name] = report.worlds[0].plan_seconds
    print(seconds, flush=True)
    return seconds


def _rate(text: str) -> float | None:
    return None if text == "none" else float(text)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="W=2 only, fewer steps")
    parser.add_argument(
        "--step-time-only",
        action="store_true",
        help="only the step-time validation; replaces its entry of --out, keeps the rest",
    )
    parser.add_argument(
        "--rates",
        default="none,0.25,1,2.5",
        help="link rates in Gbit/s for the step-time validation ('none': unthrottled)",
    )
    parser.add_argument("--steps", type=int, default=4, help="measured steps per system")
    parser.add_argument(
        "--burst-kb",
        type=int,
        default=32,
        help="the bed's token bucket for the step-time validation, KiB (a steady rate: the "
        "model has no burst; raggedfsdp bench's default is 256)",
    )
    parser.add_argument("--out", default="docs/results/capacity.json")
    args = parser.parse_args()
    started = time.perf_counter()
    rates = tuple(_rate(r.strip()) for r in args.rates.split(","))
    out = Path(args.out)
    result: dict[str, Any] = (
        json.loads(out.read_text()) if args.step_time_only and out.exists() else {}
    )
    result["note"] = "this 2-core machine is shared with other engineers' work: timings are noisy"
    if not args.step_time_only:
        result["memory"] = memory_grid((2,) if args.quick else (2, 3, 4))
    result["step_time"] = step_times("gpt-small", 2, args.steps, rates, args.burst_kb)
    if not args.step_time_only:
        result["scale_seconds_at_16384"] = scale()
    result["wall_seconds"] = time.perf_counter() - started
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
