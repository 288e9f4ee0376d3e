"""Step time of the default run, eager vs ``--compile`` (docs/results/training.md).

Runs ``raggedfsdp train`` as ``make run`` does (the default model and options, W=2 on the CPU)
for ``--steps`` steps, alternately eager and with ``--compile``, ``--rounds`` times each; every
run's step time is the median of its ``step_s`` in metrics.jsonl after the first ``--skip``
steps (the compiled run's first steps include compiling). Prints each run's median, the median
over runs per mode, and the load average before and after (the machine may be shared).

Usage::

    python benchmarks/bench_compile.py --rounds 3 --steps 60 --skip 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _run(out: Path, steps: int, compiled: bool, extra: list[str]) -> list[float]:
    """One launch of the default run; its step times."""
    argv = [sys.executable, "-m", "raggedfsdp.cli", "train", f"--out={out}", f"--steps={steps}"]
    argv += ["--log-every=1", *(["--compile"] if compiled else []), *extra]
    subprocess.run(argv, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step_s"] for r in records if r.get("kind") == "train"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=10, help="first steps left out of a median")
    parser.add_argument("extra", nargs="*", help="more options for raggedfsdp train")
    args = parser.parse_args()
    medians: dict[str, list[float]] = {"eager": [], "compiled": []}
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            # Alternate which mode goes first, so a drift in the load favours neither.
            modes = ["eager", "compiled"] if k % 2 == 0 else ["compiled", "eager"]
            for mode in modes:
                out = Path(tmp) / f"{mode}_{k}"
                times = _run(out, args.steps, mode == "compiled", args.extra)[args.skip :]
                medians[mode].append(statistics.median(times))
                print(f"round {k} {mode:<9} median step {1e3 * medians[mode][-1]:.1f} ms")
    print(f"load average after: {os.getloadavg()}")
    for mode, values in medians.items():
        print(f"{mode:<9} median over runs {1e3 * statistics.median(values):.1f} ms")
    ratio = statistics.median(medians["compiled"]) / statistics.median(medians["eager"])
    print(f"compiled / eager: {ratio:.3f}")


if __name__ == "__main__":
    main()
