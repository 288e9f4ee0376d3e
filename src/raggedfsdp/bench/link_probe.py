"""What a link gives two ranks, measured, as the step-time model takes a link's figures.

A bandwidth per rank per direction, a fixed cost per collective, a bare message's latency, and the
CPU per byte sent (:mod:`raggedfsdp.capacity.hardware`); ``tools/calibrate_cpu_gloo.py`` takes the
``cpu-gloo`` preset's link figures from it. What is timed, and why the CPU: the comment at
:func:`probe_link`.
"""

from __future__ import annotations

import functools
import resource
import statistics
import time

import torch
import torch.distributed as dist

from ..spawn import run_on_ranks
from .slow_link import DEFAULT_BURST_KB, throttled_loopback

__all__ = ["probe_link"]


def _probe(rank: int, world: int, numel: int, repeats: int, rounds: int) -> dict[str, float]:
    """This rank's figures (:func:`probe_link`); ranks 0 and 1."""
    torch.set_num_threads(1)
    send, receive = torch.zeros(numel), torch.empty(numel)
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
    for _ in range(repeats):
        dist.all_gather_into_tensor(gathered, ping)
    out = {"collective_s": (time.perf_counter() - start) / repeats}
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):  # ping-pong: two messages per round trip
        for sends in (rank == 0, rank != 0):
            (dist.send if sends else dist.recv)(ping, peer)
    out["message_s"] = (time.perf_counter() - start) / (2 * repeats)
    nbytes = send.numel() * send.element_size()
    for name, fn in (("one_way", one_way), ("both_ways", both_ways)):
        times, cpu = [], 0.0
        for round_ in range(rounds):
            dist.barrier()
            start, busy = time.perf_counter(), _cpu_s()
            fn()
            times.append(time.perf_counter() - start)
            cpu += _cpu_s() - busy if round_ else 0.0
        # bytes per second per rank; the first round warms the connection up
        out[name] = nbytes / statistics.median(times[1:])
    out["cpu_s_per_byte"] = cpu / (nbytes * (rounds - 1))  # both ways: the last loop's
    return out


def _cpu_s() -> float:
    """This process's CPU seconds so far, all threads, user and kernel."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# Two ranks exchange messages (4 MiB by default) one way (rank 0 to rank 1) and both ways at once,
# as a collective's transfers run, time one-element all-gathers back to back (the fixed cost every
# collective pays whatever its size) and ping-pong one element (a bare message's latency). Both
# ways, it also takes each rank's CPU time (its threads', the kernel's work done on their behalf
# included) per byte it sends: on a throttled link the kernel's per-packet work costs several times
# what the same bytes cost on plain loopback, and that CPU is taken from the compute a collective
# overlaps (:attr:`raggedfsdp.capacity.hardware.Hardware.link_cpu_s_per_byte`).
def probe_link(
    rate_gbit: float | None,
    burst_kb: int = DEFAULT_BURST_KB,
    *,
    message_mib: int = 4,
    repeats: int = 50,
    rounds: int = 6,
    timeout: float = 300.0,
) -> dict[str, float]:
    """Two ranks on the bed at ``rate_gbit`` (``None``: plain loopback): ``one_way`` and
    ``both_ways`` in bytes/s per rank over messages of ``message_mib`` (the median of
    ``rounds`` but the first; the slowest rank's), ``collective_s`` and ``message_s`` over
    ``repeats`` (the slowest rank's), and ``cpu_s_per_byte`` both ways (the ranks' mean)."""
    probe = functools.partial(_probe, numel=message_mib << 18, repeats=repeats, rounds=rounds)
    with throttled_loopback(rate_gbit, burst_kb) as netns:
        ranks = run_on_ranks(probe, 2, timeout=timeout, netns=netns)
    out = {key: min(r[key] for r in ranks) for key in ranks[0]}
    for key in ("collective_s", "message_s"):
        out[key] = max(r[key] for r in ranks)
    out["cpu_s_per_byte"] = statistics.fmean(r["cpu_s_per_byte"] for r in ranks)
    return out
