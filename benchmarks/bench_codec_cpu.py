"""The CPU time of compressed communication's quantizing and dequantizing in a training step.

gpt-ref at W=2 (the slow-link benchmark's model, batch 4, fp32, AdamW), as the ``raggedfsdp-q``
system of ``raggedfsdp bench`` (fp8 all-gather, int8 reduce-scatter, the default policy's
256-element blocks), one thread per rank. The codec's ``quantize`` and ``dequantize`` are
wrapped to add up, per step, their calls, elements, minor page faults and the CPU time of the
calling thread (``time.thread_time``: unlike wall time, hardly moved by other processes' load,
so kernels can be compared on a shared machine). Also the compute thread's CPU time per step.
One warm-up step, then ``--steps`` measured; one JSON object per rank.

Usage::

    PYTHONPATH=src python3 benchmarks/bench_codec_cpu.py [--steps 3] [--system raggedfsdp-q]
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from raggedfsdp.spawn import run_on_ranks

_COUNTERS = ("calls", "elements", "page_faults", "cpu_s")


def _counted(fn: Callable[..., None], totals: dict[str, float]) -> Callable[..., None]:
    """``fn`` (its first argument a tensor), adding each call to ``totals``."""

    def wrapper(*args: Any, **kwargs: Any) -> None:
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        start = time.thread_time()
        fn(*args, **kwargs)
        totals["cpu_s"] += time.thread_time() - start
        totals["page_faults"] += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
        totals["calls"] += 1
        totals["elements"] += args[0].numel()

    return wrapper


def _rank(rank: int, world: int, system: str, steps: int) -> dict[str, Any]:
    from raggedfsdp.bench.options import BenchOptions
    from raggedfsdp.bench.systems import build, make_batches
    from raggedfsdp.runtime.compression import _codec

    torch.set_num_threads(1)
    totals = {kind: dict.fromkeys(_COUNTERS, 0.0) for kind in ("quantize", "dequantize")}
    _codec.quantize = _counted(_codec.quantize, totals["quantize"])  # type: ignore[assignment]
    _codec.dequantize = _counted(_codec.dequantize, totals["dequantize"])  # type: ignore[assignment]
    options = BenchOptions(model="gpt-ref", world=world, steps=steps, batch_size=4)
    runner = build(system, options, torch.device("cpu"))
    batches = make_batches(options, steps + 1, rank, world)
    runner.step(*batches[0])
    for counters in totals.values():
        counters.update(dict.fromkeys(_COUNTERS, 0.0))
    dist.barrier()
    thread = time.thread_time()
    for x, y in batches[1:]:
        runner.step(x, y)
    out: dict[str, Any] = {"rank": rank, "step_thread_cpu_s": (time.thread_time() - thread) / steps}
    for kind, counters in totals.items():
        per_step = {k: v / steps for k, v in counters.items()}
        per_step["ns_per_element"] = 1e9 * counters["cpu_s"] / max(1.0, counters["elements"])
        out[kind] = per_step
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="measured steps (default 3)")
    parser.add_argument(
        "--system", default="raggedfsdp-q", help="a raggedfsdp system of raggedfsdp bench"
    )
    args = parser.parse_args()
    results = run_on_ranks(_rank, 2, args.system, args.steps, backend="gloo", timeout=900)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
