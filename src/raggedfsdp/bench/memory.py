"""The memory phase of ``raggedfsdp bench``: one system per fresh process group.

The profiler's allocation tracking is on from before the model is built, so its records hold every
tensor byte that system allocated; peak RSS of the same process is reported beside it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .._host import current_rss_bytes, default_device, peak_rss_bytes
from .profile import STEP_RANGE
from .systems import Runner, build, make_batches

if TYPE_CHECKING:
    from .options import BenchOptions

__all__ = ["memory_phase"]


def memory_phase(
    rank: int,
    world: int,
    options: BenchOptions,
    name: str,
    builder: Callable[[str, BenchOptions, torch.device], Runner] = build,
) -> dict[str, Any]:
    """Rank ``rank``'s tensor and RSS figures for system ``name``, built (by ``builder``: the
    bench's systems, or another optimizer or planner for the capacity planner's validation) and
    stepped twice here."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    device = default_device()
    batches = make_batches(options, 2, rank, world, device)
    dist.barrier()
    rss_before = current_rss_bytes()
    cuda_at_start = 0
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        runner = builder(name, options, device)
        built_stats = runner.stats() if runner.stats is not None else None
        for batch in batches:  # the last step has every state: grads, AdamW moments
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                cuda_at_start = torch.cuda.memory_allocated(device)
            with record_function(STEP_RANGE):
                runner.step(*batch)
    result = _allocation_profile(prof)
    if device.type == "cuda":  # the tensors live on the GPU: its allocator's own figures
        result["cpu_tensor_peak_bytes"] = result["tensor_peak_bytes"]
        result["tensor_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        result["tensor_at_step_start_bytes"] = cuda_at_start
    result.update(
        retained_original_param_bytes=runner.retained_original_bytes,
        rss_before_bytes=rss_before,
        peak_rss_bytes=peak_rss_bytes(),
        peak_rss_above_start_bytes=peak_rss_bytes() - rss_before,
    )
    if runner.stats is not None:
        stats = runner.stats()
        result["framework_persistent_bytes"] = int(stats["persistent_bytes"])
        result["framework_peak_unsharded_bytes"] = int(stats["peak_unsharded_bytes"])
        if built_stats is not None:
            result["framework_persistent_bytes_at_build"] = int(built_stats["persistent_bytes"])
    return result


def _allocation_profile(prof: Any, top: int = 10) -> dict[str, Any]:
    """Live CPU tensor bytes over time from the profiler's allocation records, and what is live
    at the last step's peak (by allocation site).

    Each record carries the allocator's running total of the bytes allocated since profiling
    began (and still live); in a fresh process that is every tensor this system allocated.
    """
    from torch._C._profiler import _EventType

    steps: list[tuple[int, int]] = []
    records: list[tuple[int, int, int, int, str]] = []  # (time, ptr, size, live after, site)
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            if f.device.type == "cpu":
                site = _allocation_site(node) if f.alloc_size > 0 else ""
                records.append((node.start_time_ns, f.ptr, f.alloc_size, f.total_allocated, site))
        elif node.name == STEP_RANGE:
            steps.append((node.start_time_ns, node.end_time_ns))
        stack.extend(node.children)
    records.sort(key=lambda r: r[0])
    start, end = max(steps)
    live: dict[int, tuple[int, str]] = {}
    at_start = peak = overall = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for when, ptr, size, total, site in records:
        if when < start:
            at_start = total
        if size > 0:
            live[ptr] = (size, site if when >= start else "(live before the step)")
        else:
            live.pop(ptr, None)
        overall = max(overall, total)
        if start <= when <= end and total > peak:
            peak, at_peak = total, dict(live)
    if peak < at_start:
        peak, at_peak = at_start, {}
    sites: Counter[str] = Counter()
    for size, site in at_peak.values():
        sites[site] += size
    return {
        "tensor_peak_bytes": peak,
        "tensor_at_step_start_bytes": at_start,
        "tensor_peak_incl_build_bytes": overall,
        "tensor_end_bytes": records[-1][3] if records else 0,
        "live_at_peak_by_site": [{"site": site, "bytes": n} for site, n in sites.most_common(top)],
    }


_ALLOCATOR_OPS = ("aten::empty", "aten::new_empty", "aten::resize_", "aten::zeros", "aten::ones")
_SCOPES = ("raggedfsdp::", "FSDP::", "Optimizer.", "autograd::engine", "DistributedDataParallel")


def _allocation_site(node: Any) -> str:
    """``op @ scope`` for an allocation: the operator that needed the memory and the framework
    range (or autograd node) it ran in."""
    chain = []
    parent = node.parent
    while parent is not None and parent.name != STEP_RANGE:
        chain.append(parent.name)
        parent = parent.parent
    chain = [n.removeprefix("autograd::engine::evaluate_function: ") for n in chain]
    op = next((n for n in chain if not n.startswith(_ALLOCATOR_OPS)), "(no operator)")
    scope = next((n for n in chain if n.startswith(_SCOPES) or "Backward" in n), "")
    scope = scope or (chain[-1] if chain else "")
    return op if scope in ("", op) else f"{op} @ {scope}"
