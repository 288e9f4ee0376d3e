"""Every pipelining schedule of the installed torch with raggedfsdp and with FSDP2 units inside the
stages, against one process on the global batch.

4 Gloo ranks, a mesh (pp=2, dp=2); the small decoder of the tests (``tests/support/
pipeline_cases.py``: uneven widths, cut torchtitan's way), 2 SGD steps of 4 micro-batches, under
torchtitan's settings (no reshard after forward, the loss scaled per micro-batch,
``scale_grads=False``) and torch's defaults. For each run: the largest difference of any parameter
from one process's, and for raggedfsdp the collectives of the second step per bucket (the first
also runs torch's metadata inference) and the median step time.

Usage::

    PYTHONPATH=src python experiments/pipeline_schedules.py --json docs/results/pipeline.json
    PYTHONPATH=src python experiments/pipeline_schedules.py --layers 8 \
        --json docs/results/pipeline_8_layers.json

prints a markdown table (the ones in docs/results/pipeline.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
import pipeline_cases
from pipeline_cases import (
    DP,
    PP,
    SCHEDULES,
    batches,
    build,
    full_params,
    max_difference,
    reference,
    step,
)
from raggedfsdp.spawn import run_on_ranks

SETTINGS = ("torchtitan", "torch defaults")


def _run(impl: str, schedule: str, titan: bool, mesh: Any) -> dict[str, Any]:
    parts, run, mine, stages = build(impl, schedule, mesh, titan=titan)
    opt = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=0.5)
    seconds, counts = [], []
    for x, y in batches():
        for part in parts if impl == "rf" else []:
            part.reset_stats()
        start = time.perf_counter()
        step(run, mine, stages, mesh, x, y)
        seconds.append(time.perf_counter() - start)
        if impl == "rf":
            stats = [part.stats() for part in parts]
            buckets = sum(len(part.shard_plans()) for part in parts)
            counts.append(
                {
                    "reduce_scatters_per_bucket": sum(s["reduce_scatter_calls"] for s in stats)
                    / buckets,
                    "all_gathers_per_bucket": sum(s["all_gather_calls"] for s in stats) / buckets,
                }
            )
        opt.step()
        opt.zero_grad()
    return {"params": full_params(parts), "counts": counts, "seconds": seconds}


def _on_rank(rank: int, world: int, layers: int) -> dict[Any, Any]:
    torch.set_num_threads(1)
    pipeline_cases.LAYERS = layers
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    return {
        (impl, schedule, setting): _run(impl, schedule, setting == "torchtitan", mesh)
        for schedule in SCHEDULES
        for setting in SETTINGS
        for impl in ("rf", "torch")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument(
        "--layers", type=int, default=pipeline_cases.LAYERS, help="blocks, split evenly"
    )
    args = parser.parse_args()
    pipeline_cases.LAYERS = args.layers  # the tests' model, deeper (read at each call)
    per_rank = run_on_ranks(_on_rank, PP * DP, args.layers, backend="gloo", timeout=1800)
    want = reference()[0]
    rows = []
    for impl, schedule, setting in per_rank[0]:
        if impl != "rf":
            continue
        row: dict[str, Any] = {"schedule": schedule, "settings": setting}
        for who in ("rf", "torch"):
            params: dict[str, torch.Tensor] = {}
            for rank in per_rank:
                params.update(rank[who, schedule, setting]["params"])
            row[f"{who}_max_difference"] = max_difference(params, want)
        ours = per_rank[0]["rf", schedule, setting]
        row.update(ours["counts"][-1])
        row["rf_step_seconds"] = statistics.median(ours["seconds"][1:])
        row["torch_step_seconds"] = statistics.median(
            per_rank[0]["torch", schedule, setting]["seconds"][1:]
        )
        rows.append(row)
    print(
        "| schedule | settings | raggedfsdp: max diff. | FSDP2: max diff. | reduce-scatters "
        "/ bucket / step | all-gathers / bucket / step |\n| --- | --- | --- | --- | --- | --- |"
    )
    for r in rows:
        print(
            f"| {r['schedule']} | {r['settings']} | {r['rf_max_difference']:.1e} | "
            f"{r['torch_max_difference']:.1e} | {r['reduce_scatters_per_bucket']:g} | "
            f"{r['all_gathers_per_bucket']:g} |"
        )
    if args.json:
        record = {"torch": torch.__version__, "layers": args.layers, "runs": rows}
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
