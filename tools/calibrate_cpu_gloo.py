"""Measure the figures of the ``cpu-gloo`` hardware preset on this machine.

One thread per rank, as ``raggedfsdp bench`` runs: the fp32 matmul rate of one core (the
"peak" the step-time model scales by its efficiency), the memory bandwidth of an in-place add
(the optimizer step is memory bound), and Gloo's loopback point-to-point bandwidth and latency
between two ranks (what raggedfsdp's Gloo all-gather and reduce-scatter are made of).

    PYTHONPATH=src python tools/calibrate_cpu_gloo.py

Prints one JSON object; the preset in ``raggedfsdp/capacity/hardware.py`` holds its figures.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch

from raggedfsdp.bench.link_probe import probe_link


def _median_seconds(fn: Callable[[], object], repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _compute_figures() -> dict[str, float]:
    torch.set_num_threads(1)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    matmul = _median_seconds(lambda: a @ b)
    x = torch.randn(16 << 20)
    add = _median_seconds(lambda: x.add_(1.0))
    return {
        "matmul_flops": 2 * 1024**3 / matmul,
        "memory_bytes_per_s": 2 * x.numel() * x.element_size() / add,  # read and write
    }


def main() -> None:
    result = _compute_figures()
    # a 64 MiB exchange both ways at once (as a collective's transfers run), median of 7; 200
    # one-element all-gathers (the fixed cost every bucket's collective pays, the model's
    # ring-step latency at W=2); a bare message's latency (half a ping-pong) for comparison
    link = probe_link(None, message_mib=64, repeats=200, rounds=8)
    result["gloo_collective_s"] = link["collective_s"]
    result["gloo_message_s"] = link["message_s"]
    result["gloo_bytes_per_s"] = link["both_ways"]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
