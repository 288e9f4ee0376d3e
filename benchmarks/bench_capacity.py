"""The capacity planner's predictions against measurements on this machine (docs/capacity.md).

1. **memory**: ``raggedfsdp bench``'s memory phase (the profiler's allocation records; one fresh
   launch per run) at W = 2, 3, 4 for gpt-tiny and gpt-small with AdamW and AdamW8bit, against
   :func:`raggedfsdp.planner.cost.memory_breakdown`: persistent bytes and the tensor peak.
2. **step time**, unthrottled: ``raggedfsdp bench`` (raggedfsdp, FSDP2 and the compute floor,
   interleaved) at W=2; the compute efficiency of the ``cpu-gloo`` preset is fitted to the
   floor's median step and nothing else, then raggedfsdp's and FSDP2's steps are predicted.
3. **scale**: every zoo model planned and costed at W = 16,384 (wall clock).

    PYTHONPATH=src python benchmarks/bench_capacity.py [--quick] [--out docs/capacity.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from raggedfsdp.bench import run_bench
from raggedfsdp.bench.memory import memory_phase
from raggedfsdp.bench.options import BenchOptions
from raggedfsdp.bench.systems import build, raggedfsdp_with
from raggedfsdp.models import GPT, GPT_CONFIGS, MODEL_NAMES
from raggedfsdp.planner import ShardPlan, StructAwarePlanner
from raggedfsdp.planner.capacity import CapacityOptions, capacity_report
from raggedfsdp.planner.cost import (
    StepShape,
    UnitBytes,
    memory_breakdown,
    optimizer_state_bytes,
    unit_bytes,
)
from raggedfsdp.planner.hardware import HARDWARE, hardware
from raggedfsdp.planner.shapes import model_shape
from raggedfsdp.planner.steptime import step_time
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
    return module, plans, unit_bytes(plans, [True] * len(plans))


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


def step_times(model: str, world: int, steps: int) -> dict[str, Any]:
    """Measured medians of raggedfsdp, FSDP2 and the floor; the efficiency fitted to the floor;
    the predictions of the other two with it."""
    options = BenchOptions(
        model=model,
        world=world,
        steps=steps,
        warmup=2,
        batch_size=BATCH,
        systems=("raggedfsdp", "fsdp2", "floor"),
        profile=False,
        memory=False,
    )
    results = run_bench(options)
    measured = {name: s["step_s"] for name, s in results["systems"].items()}
    module, plans, units = _planned(model, "adamw", world)
    shape = model_shape(module)
    step = StepShape(batch=BATCH, seq_len=GPT_CONFIGS[model].seq_len, gloo=True)
    state = optimizer_state_bytes(plans, "adamw")
    # The floor: the whole model on one rank, no communication (W=1's plan).
    _, floor_plans, floor_units = _planned(model, "adamw", 1)
    floor_state = optimizer_state_bytes(floor_plans, "adamw")
    base = HARDWARE["cpu-gloo"]
    at_peak = step_time(
        shape,
        floor_units,
        step,
        hardware("cpu-gloo", efficiency=1.0),
        1,
        optimizer_bytes=floor_state,
    )
    # floor = compute / efficiency + optimizer: solve for the efficiency
    efficiency = at_peak.compute_s / (measured["floor"] - at_peak.optimizer_s)
    hw = hardware(base.name, efficiency=min(1.0, efficiency))
    out: dict[str, Any] = {
        "model": model,
        "world": world,
        "batch": BATCH,
        "measured_s": measured,
        "fitted_efficiency": efficiency,
        "command": results["command"],
    }
    for system in ("raggedfsdp", "fsdp2"):
        t = step_time(shape, units, step, hw, world, optimizer_bytes=state, system=system)
        out[system] = {
            **t.to_dict(),
            "measured_s": measured[system],
            "error": t.total_s / measured[system] - 1,
        }
    print(json.dumps(out, indent=1), flush=True)
    return out


def scale() -> dict[str, float]:
    seconds = {}
    for name in MODEL_NAMES:
        options = CapacityOptions(batch=1, seq_len=4096, checkpointing=True)
        report = capacity_report(name, [16384], HARDWARE["h100"], options, find_smallest=False)
        seconds[name] = report.worlds[0].plan_seconds
    print(seconds, flush=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="W=2 only, fewer steps")
    parser.add_argument("--out", default="docs/capacity.json")
    args = parser.parse_args()
    started = time.perf_counter()
    result = {
        "note": "this 2-core machine is shared with other engineers' work: timings are noisy",
        "memory": memory_grid((2,) if args.quick else (2, 3, 4)),
        "step_time": step_times("gpt-small", 2, 4 if args.quick else 8),
        "scale_seconds_at_16384": scale(),
    }
    result["wall_seconds"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
