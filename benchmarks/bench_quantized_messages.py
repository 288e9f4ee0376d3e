"""One message per rank (codes, then scales) or two (codes; scales) for a compressed all-gather:
what the second message costs, on loopback and on a rate-limited link.

The bucket is one block of gpt-ref (d=512: 12 x 512^2 parameters) at W=2 with the default
policy's 256-element blocks: 1.5 M one-byte codes and 6 K fp32 scales per rank. Each variant
moves the same bytes point to point as the runtime does on Gloo (``isend``/``irecv`` to the
peer); the median of 20 exchanges after 3 warm-ups is reported, variants interleaved.

Usage (root, for the throttled rates)::

    PYTHONPATH=src python3 benchmarks/bench_quantized_messages.py --rates none,1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from raggedfsdp.bench.slow_link import throttled_loopback
from raggedfsdp.spawn import run_on_ranks

CODES = 12 * 512 * 512 // 2  # one rank's shard of a gpt-ref block, one byte per element
SCALES = -(-CODES // 256)


def _exchange(buffers: list[tuple[torch.Tensor, torch.Tensor]], peer: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    works = []
    for send, recv in buffers:
        works += [dist.isend(send, peer), dist.irecv(recv, peer)]
    for work in works:
        work.wait()
    return time.perf_counter() - start


def _rank(rank: int, world: int, rounds: int) -> dict[str, float]:
    peer = 1 - rank
    size = CODES + 4 * SCALES
    one = [(torch.zeros(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8))]
    two = [
        (torch.zeros(CODES, dtype=torch.uint8), torch.empty(CODES, dtype=torch.uint8)),
        (torch.zeros(SCALES), torch.empty(SCALES)),
    ]
    times: dict[str, list[float]] = {"one message": [], "two messages": []}
    for i in range(rounds + 3):
        for name, buffers in (("one message", one), ("two messages", two))[:: 1 - 2 * (i % 2)]:
            elapsed = _exchange(buffers, peer)
            if i >= 3:
                times[name].append(elapsed)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="none,1")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    print("| link | one message | two messages |\n| --- | --- | --- |")
    for text in args.rates.split(","):
        rate = None if text == "none" else float(text)
        with throttled_loopback(rate) as netns:
            result = run_on_ranks(_rank, 2, args.rounds, netns=netns, backend="gloo")[0]
        link = "unthrottled" if rate is None else f"{rate:g} Gbit/s"
        one, two = result["one message"], result["two messages"]
        print(f"| {link} | {one * 1e3:.2f} ms | {two * 1e3:.2f} ms ({two / one:.3f}x) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
