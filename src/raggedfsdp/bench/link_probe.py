"""What a link gives two ranks, measured: the slow-link bed's figures as the step-time model
takes them (:mod:`raggedfsdp.planner.hardware`: a bandwidth per rank per direction, and a fixed
cost per collective).

Two ranks exchange 4 MiB messages one way (rank 0 to rank 1) and both ways at once, as a
collective's transfers run, and time 50 one-element all-gathers back to back (the fixed cost
every collective pays whatever its size).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..spawn import run_on_ranks
from .slow_link import DEFAULT_BURST_KB, throttled_loopback

__all__ = ["probe_link"]

_MESSAGE_NUMEL, _COLLECTIVES, _ROUNDS = 1 << 20, 50, 6


def _probe(rank: int, world: int) -> dict[str, float]:
    torch.set_num_threads(1)
    send, receive = torch.zeros(_MESSAGE_NUMEL), torch.empty(_MESSAGE_NUMEL)
    peer = 1 - rank

    def one_way() -> None:
        work = dist.isend(send, peer) if rank == 0 else dist.irecv(receive, peer)
        work.wait()

    def both_ways() -> None:
        for work in [dist.isend(send, peer), dist.irecv(receive, peer)]:
            work.wait()

    ping, gathered = torch.zeros(1), torch.zeros(world)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(_COLLECTIVES):
        dist.all_gather_into_tensor(gathered, ping)
    out = {"collective_s": (time.perf_counter() - start) / _COLLECTIVES}
    for name, fn in (("one_way", one_way), ("both_ways", both_ways)):
        times = []
        for _ in range(_ROUNDS):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        # bytes per second per rank; the first round warms the connection up
        out[name] = send.numel() * send.element_size() / statistics.median(times[1:])
    return out


def probe_link(
    rate_gbit: float | None, burst_kb: int = DEFAULT_BURST_KB, *, timeout: float = 300.0
) -> dict[str, float]:
    """Two ranks on the bed at ``rate_gbit`` (``None``: plain loopback): ``one_way`` and
    ``both_ways`` in bytes/s per rank (the slowest rank's) and ``collective_s`` (the slowest
    rank's)."""
    with throttled_loopback(rate_gbit, burst_kb) as netns:
        ranks = run_on_ranks(_probe, 2, timeout=timeout, netns=netns)
    probe = {key: min(r[key] for r in ranks) for key in ranks[0]}
    probe["collective_s"] = max(r["collective_s"] for r in ranks)
    return probe
