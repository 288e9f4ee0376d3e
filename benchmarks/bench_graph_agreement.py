"""What the agreement at the start of backward costs a step (``runtime/_usage.py``).

gpt-ref (docs/design.md, "Benchmark protocol") on W Gloo ranks, AdamW, a static graph: rounds
alternate steps by default (the agreement on what each rank's backward runs and uses) and steps
with ``set_static_graph()`` (none), so both see the same machine; the medians, their ratio, and
the agreement's own time per step (its all-reduce, timed around it).

Usage::

    python benchmarks/bench_graph_agreement.py --world 2 --rounds 5 --steps 3 --out-json agree.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import raggedfsdp as rf
from raggedfsdp.models import GPT
from raggedfsdp.models.gpt import GPT_CONFIGS
from raggedfsdp.runtime import _root
from raggedfsdp.spawn import run_on_ranks


def _steps(rank: int, world: int, rounds: int, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    cfg = GPT_CONFIGS["gpt-ref"]
    torch.manual_seed(0)
    model = rf.FSDPBackend(GPT(cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    idx = torch.randint(cfg.vocab_size, (4, cfg.seq_len + 1), generator=gen)
    agree = _root.agree
    agreeing: list[float] = []

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return agree(*args, **kwargs)
        finally:
            agreeing.append(time.perf_counter() - start)

    def step() -> float:
        start = time.perf_counter()
        model(idx[:, :-1], idx[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    for _ in range(2):  # warm-up: lazy init, the order, the optimizer's state
        step()
    times: dict[str, list[float]] = {"with": [], "without": []}
    _root.agree = timed
    try:
        for _ in range(rounds):
            for mode in ("with", "without"):
                model.set_static_graph(mode == "without")
                times[mode] += [step() for _ in range(steps)]
    finally:
        _root.agree = agree
    return {"times": times, "agreement_s": agreeing}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per mode per round")
    parser.add_argument("--out-json", type=Path)
    args = parser.parse_args(argv)
    per_rank = run_on_ranks(
        _steps, args.world, args.rounds, args.steps, timeout=3600.0, backend="gloo"
    )
    # a step ends on every rank when the slowest does: rank 0's times stand for the step
    times = per_rank[0]["times"]
    result = {
        "world": args.world,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "median_with_s": statistics.median(times["with"]),
        "median_without_s": statistics.median(times["without"]),
        "median_agreement_s": statistics.median(per_rank[0]["agreement_s"]),
        "times": times,
    }
    result["ratio"] = result["median_with_s"] / result["median_without_s"]
    result["agreement_share"] = result["median_agreement_s"] / result["median_with_s"]
    print(
        f"gpt-ref, W={args.world}: step {result['median_with_s']:.3f} s with the agreement, "
        f"{result['median_without_s']:.3f} s static (ratio {result['ratio']:.4f}); the "
        f"agreement itself {1e3 * result['median_agreement_s']:.2f} ms "
        f"({100 * result['agreement_share']:.3f}% of a step)"
    )
    if args.out_json:
        args.out_json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
