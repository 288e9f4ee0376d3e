"""Measure the figures of the ``cpu-gloo`` hardware preset on this machine.

One thread per rank, as ``raggedfsdp bench`` runs: the fp32 matmul rate of one core (the
"peak" the step-time model scales by its efficiency), the memory bandwidth of an in-place add
(the optimizer step is memory bound), and Gloo's loopback point-to-point bandwidth and latency
between two ranks (what raggedfsdp's Gloo all-gather and reduce-scatter are made of).

    PYTHONPATH=src python benchmarks/calibrate_cpu_gloo.py

Prints one JSON object; the preset in ``raggedfsdp/planner/hardware.py`` holds its figures.
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from raggedfsdp.spawn import run_on_ranks


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


def _p2p(rank: int, world: int) -> dict[str, float]:
    """Between ranks 0 and 1: the fixed cost of one collective (a one-element all-gather, 200
    back to back: what every bucket's collective pays whatever its size, the model's ring-step
    latency at W=2), one small message's latency (half a ping-pong round trip) for comparison,
    and the bandwidth of a 64 MiB exchange in both directions at once (as a collective's
    transfers run)."""
    torch.set_num_threads(1)
    peer = 1 - rank
    ping, gathered = torch.zeros(1), torch.zeros(world)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(200):
        dist.all_gather_into_tensor(gathered, ping)
    collective = (time.perf_counter() - start) / 200
    dist.barrier()
    start = time.perf_counter()
    for _ in range(200):
        if rank == 0:
            dist.send(ping, peer)
            dist.recv(ping, peer)
        else:
            dist.recv(ping, peer)
            dist.send(ping, peer)
    message = (time.perf_counter() - start) / 400
    send, receive = torch.zeros(16 << 20), torch.empty(16 << 20)
    dist.barrier()
    seconds = _median_seconds(functools.partial(_exchange, send, receive, peer))
    return {
        "collective_s": collective,
        "message_s": message,
        "bytes_per_s": send.numel() * 4 / seconds,
    }


def _exchange(send: torch.Tensor, receive: torch.Tensor, peer: int) -> None:
    works = [dist.isend(send, peer), dist.irecv(receive, peer)]
    for work in works:
        work.wait()


def main() -> None:
    result = _compute_figures()
    ranks = run_on_ranks(_p2p, 2, timeout=300)
    result["gloo_collective_s"] = max(r["collective_s"] for r in ranks)
    result["gloo_message_s"] = max(r["message_s"] for r in ranks)
    result["gloo_bytes_per_s"] = min(r["bytes_per_s"] for r in ranks)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
