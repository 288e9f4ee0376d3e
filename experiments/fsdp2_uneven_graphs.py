"""FSDP2 and raggedfsdp on ranks whose graphs differ, each case in a launch of its own.

    python experiments/fsdp2_uneven_graphs.py [--world 2] [--timeout 90] [--out FILE.json]

The cases of ``tests/support/uneven_cases.py`` (a vision tower run only where a batch has an
image, experts some ranks' tokens skip, a block run twice on one rank, a block whose input needs no
gradient on one rank, a block run again later on every rank, all at once) and a block run again
later on rank 0 only: W Gloo ranks train the model 4 AdamW steps with torch's ``fully_shard`` and
with raggedfsdp's (the same units), each against one process on the global batch. Outcome per
case and implementation: ``right`` (every parameter within 1e-5 of one process), ``wrong`` (with
the largest difference), ``raised`` (the first rank's error), ``hung`` (killed after
``--timeout`` seconds) or ``aborted`` (a rank's exit code). Prints a Markdown table and writes
every outcome to ``--out``. The test suite runs raggedfsdp's side (test_uneven_graphs.py);
FSDP2's aborts and hangs would take a launch down, so they are measured here.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

import raggedfsdp as rf
from raggedfsdp.spawn import run_on_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from uneven_cases import CASES, Net, Plan, train, units

IMPLS: dict[str, Callable[..., Any]] = {"fsdp2": fsdp2_fully_shard, "raggedfsdp": rf.fully_shard}
#: the cases above, and the block run again later on rank 0 alone (raggedfsdp: one error)
PLANS: dict[str, Callable[[int, int, int], Plan]] = {
    **CASES,
    "again on rank 0 only": lambda r, w, s: Plan(True, 1, [[0, 1], [0, 1]], again=r == 0),
}


def _case(rank: int, world: int, impl: str, case: str) -> float:
    """The largest difference from one process of a case's parameters after training."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = Net()
    want = train(copy.deepcopy(base), PLANS[case], -1, world)["params"]
    model = copy.deepcopy(base)
    for unit in units(model):
        IMPLS[impl](unit)
    IMPLS[impl](model)
    got = train(model, PLANS[case], rank, world)["params"]
    return max(float(((got[k] - v).abs() / (v.abs() + 1e-3)).max()) for k, v in want.items())


def _outcome(impl: str, case: str, world: int, timeout: float) -> dict[str, Any]:
    try:
        errors = run_on_ranks(_case, world, impl, case, timeout=timeout)
    except RuntimeError as failure:
        text = str(failure)
        if "(timed out)" in text:
            return {"outcome": "hung", "detail": f"killed after {timeout:.0f} s"}
        if match := re.search(r"rank (\d+): no result \(exit code (-?\d+)\)", text):
            return {"outcome": "aborted", "detail": f"rank {match[1]} exit code {match[2]}"}
        raised = [line for line in text.splitlines() if re.match(r"^\w*(Error|Exception)", line)]
        return {"outcome": "raised", "detail": (raised or text.splitlines()[-1:])[-1][:160]}
    worst = max(errors)
    return {"outcome": "right" if worst <= 1e-5 else "wrong", "detail": f"max rel {worst:.1e}"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=90.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    results = {
        case: {impl: _outcome(impl, case, args.world, args.timeout) for impl in IMPLS}
        for case in PLANS
    }
    print(f"| case (W = {args.world}) | FSDP2 | raggedfsdp |\n| --- | --- | --- |")
    for case, row in results.items():
        cells = [f"{r['outcome']} ({r['detail']})" for r in row.values()]
        print(f"| {case} | {' | '.join(cells)} |")
    if args.out is not None:
        info = {"torch": torch.__version__, "world": args.world, "timeout_s": args.timeout}
        args.out.write_text(json.dumps({**info, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
