"""Analysis of one profiled ``raggedfsdp bench`` step.

Copy-like operators counted by where they run, collective calls and bytes (as
:class:`raggedfsdp.runtime.RuntimeStats` counts them), and the step's main-thread time split by
kind.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .systems import Runner

__all__ = ["COPY_OPS", "FILL_OPS", "STEP_RANGE", "analyse_profile", "profile_step"]

#: Operators that copy tensor data. Counted per name wherever they occur; the per-step *total*
#: counts only the outermost ones (``aten::clone`` calls ``aten::copy_``: one copy, not two).
COPY_OPS = frozenset(
    {
        "aten::copy_",
        "aten::_copy_from",
        "aten::_copy_from_and_resize",
        "aten::clone",
        "aten::contiguous",
        "aten::_to_copy",
        "aten::cat",
        "aten::_cat",
        "aten::stack",
        "aten::_chunk_cat",
        "aten::chunk_cat",
        "aten::split_with_sizes_copy",
        "aten::narrow_copy",
        "aten::index_copy_",
        "aten::_foreach_copy_",
        "fsdp::all_gather_copy_in",
        "fsdp::split_with_sizes_copy",
        "fsdp::chunk_cat",
    }
)
#: Not copies, but whole-buffer writes worth seeing beside them.
FILL_OPS = frozenset({"aten::zero_", "aten::fill_"})

_COLLECTIVE_KINDS = {
    "c10d::_allgather_base_": "all_gather",
    "c10d::allgather_into_tensor_coalesced_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
}
#: raggedfsdp's ranges around its collectives; on Gloo they are point-to-point transfers
#: (collectives.py), whose sizes only Gloo's own ``gloo:send`` records carry.
_P2P_RANGES = {
    "raggedfsdp::all_gather": "all_gather",
    "raggedfsdp::reduce_scatter": "reduce_scatter",
    "raggedfsdp::quantized_all_gather": "all_gather",
    "raggedfsdp::quantized_reduce_scatter": "reduce_scatter",
}
#: The range around each benchmarked step (the memory phase finds its steps by it too).
STEP_RANGE = "bench::step"
_WAIT_RANGE = "bench::wait"


@contextlib.contextmanager
def _labelled_waits() -> Iterator[None]:
    """Label every ``Work.wait()`` issued from Python for the profiler (while profiling only).

    raggedfsdp and FSDP2 wait on their collectives through ``Work.wait()``; DDP waits inside its
    C++ reducer, which this cannot see (that time stays in the untracked remainder).
    """
    from torch.autograd.profiler import record_function

    work_cls = dist.Work
    original = work_cls.wait

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        with record_function(_WAIT_RANGE):
            return original(self, *args, **kwargs)

    try:
        work_cls.wait = wait  # type: ignore[method-assign]
    except (AttributeError, TypeError):  # a torch whose Work type is read-only
        yield
        return
    try:
        yield
    finally:
        work_cls.wait = original  # type: ignore[method-assign]


def profile_step(
    runner: Runner, batch: tuple[torch.Tensor, torch.Tensor], top: int
) -> dict[str, Any]:
    """One step of ``runner`` under ``torch.profiler``, analysed by :func:`analyse_profile`."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    with (
        _labelled_waits(),
        profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof,
        record_function(STEP_RANGE),
    ):
        runner.step(*batch)
    return analyse_profile(prof.events(), top, dist.get_world_size())


def analyse_profile(events: Sequence[Any], top: int, world: int) -> dict[str, Any]:
    """Copy counts, collective sizes and a split of the step's CPU time, from one step.

    ``events`` are the profiler's events of one step inside a :data:`STEP_RANGE` range; each
    part of the result comes from its own pass over them (cheap next to profiling the step).
    """
    step = next(e for e in events if e.name == STEP_RANGE)
    main = step.thread
    wall_us = step.time_range.elapsed_us()
    inside = [e for e in events if e.name not in (STEP_RANGE, "[memory]")]
    collectives = _c10d_collectives(inside, main)
    backend_ops = _backend_ops(inside)
    # Before the point-to-point collectives are added: they make no all-reduce records.
    _correct_all_reduce_bytes(collectives, backend_ops)
    _add_p2p_collectives(collectives, _p2p_transfers(inside, main), world)
    return {
        "wall_s": wall_us / 1e6,
        "copies": {**_outermost_copies(inside, main), "ops": _operator_counts(inside)},
        "collectives": {k: dict(v) for k, v in sorted(collectives.items())},
        "backend_ops": backend_ops,
        "time_split_s": _time_split(inside, main, wall_us),
        "comm_thread_s": _comm_thread_seconds(inside, main),
        "top_ops": _top_ops(inside, main, top),
    }


def _operator_counts(events: Sequence[Any]) -> dict[str, int]:
    """Every copy-like and fill operator by name, nested ones too, on every thread."""
    ops: Counter[str] = Counter(e.name for e in events if e.name in COPY_OPS or e.name in FILL_OPS)
    return dict(sorted(ops.items()))


def _outermost_copies(events: Sequence[Any], main: int) -> dict[str, Any]:
    """The outermost copy-like operators (none of their ancestors copies), by where they run
    (:func:`_copy_site`): their total, a count per site and, per site, a count per name."""
    copies: Counter[str] = Counter()
    by_name: dict[str, Counter[str]] = defaultdict(Counter)
    for e in events:
        if e.name not in COPY_OPS:
            continue
        chain = _ancestors(e)
        if any(a in COPY_OPS for a in chain):
            continue
        where = _copy_site(e.name, chain, e.thread == main)
        copies[where] += 1
        by_name[where][e.name] += 1
    return {
        "total": sum(copies.values()),
        "framework": copies["framework"],
        "backend": copies["backend"],
        "optimizer": copies["optimizer"],
        "by_name": {where: dict(sorted(c.items())) for where, c in sorted(by_name.items())},
    }


def _calls_and_bytes() -> dict[str, int]:
    """An empty tally of one kind of collective or backend operator."""
    return {"calls": 0, "bytes": 0}


def _c10d_collectives(events: Sequence[Any], main: int) -> dict[str, dict[str, int]]:
    """Calls of each kind of ``c10d::`` collective on the compute thread, with input bytes
    where the operator records shapes (all-gathers and reduce-scatters; all-reduces have none,
    see :func:`_correct_all_reduce_bytes`)."""
    out: dict[str, dict[str, int]] = defaultdict(_calls_and_bytes)
    for e in events:
        if e.thread != main:
            continue
        if e.name in _COLLECTIVE_KINDS:
            kind = _COLLECTIVE_KINDS[e.name]
            out[kind]["calls"] += 1
            out[kind]["bytes"] += _input_bytes(e, 1)
        elif e.name == "c10d::allreduce_":
            out["all_reduce"]["calls"] += 1
        elif e.name.startswith(("c10d::broadcast", "c10d::allgather_")):
            out[e.name.removeprefix("c10d::").rstrip("_")]["calls"] += 1
    return out


def _backend_ops(events: Sequence[Any]) -> dict[str, dict[str, int]]:
    """Calls and input bytes of each Gloo or NCCL operator (``gloo:*``, ``nccl:*``), on every
    thread, sorted by name."""
    out: dict[str, dict[str, int]] = defaultdict(_calls_and_bytes)
    for e in events:
        if e.name.startswith(("gloo:", "nccl:")):
            out[e.name]["calls"] += 1
            out[e.name]["bytes"] += _input_bytes(e, 0)
    return {k: dict(v) for k, v in sorted(out.items())}


def _correct_all_reduce_bytes(
    collectives: dict[str, dict[str, int]], backend_ops: dict[str, dict[str, int]]
) -> None:
    """Set the all-reduce bytes from the backend's all-reduce records, less the reduce-scatters'.

    Gloo runs its own reduce-scatter as an all-reduce of the full input; what remains of its
    all-reduce bytes are real all-reduces (DDP buckets, HSDP), whose c10d op records no shapes.
    """
    if "all_reduce" not in collectives:
        return
    rs_bytes = collectives.get("reduce_scatter", {"bytes": 0})["bytes"]
    total = sum(v["bytes"] for k, v in backend_ops.items() if k.endswith("all_reduce"))
    collectives["all_reduce"]["bytes"] = max(0, total - rs_bytes)


def _p2p_transfers(events: Sequence[Any], main: int) -> list[tuple[str, list[int]]]:
    """Each raggedfsdp collective range on the compute thread, in start order, as its kind and
    the bytes of the point-to-point sends Gloo records inside it (Gloo's send records have no
    parent: they are matched by start time)."""
    ranges = sorted(
        (e.time_range.start, e.time_range.end, _P2P_RANGES[e.name], [])
        for e in events
        if e.name in _P2P_RANGES and e.thread == main
    )
    for e in events:
        if e.name == "gloo:send" and e.thread == main:
            start = e.time_range.start
            for lo, hi, _, sends in ranges:
                if lo <= start <= hi:
                    sends.append(_input_bytes(e, 0))
    return [(kind, sends) for _, _, kind, sends in ranges]


def _add_p2p_collectives(
    collectives: dict[str, dict[str, int]], transfers: list[tuple[str, list[int]]], world: int
) -> None:
    """Count each point-to-point collective that sent anything, and its bytes as
    :class:`raggedfsdp.runtime.RuntimeStats` counts them: an all-gather's input is the one shard
    sent to every peer; a reduce-scatter's is the whole gradient, of which the W-1 peers' chunks
    are sent."""
    for kind, sends in transfers:
        if not sends:
            continue
        collectives[kind]["calls"] += 1
        if kind == "all_gather":
            collectives[kind]["bytes"] += sends[0]
        else:
            collectives[kind]["bytes"] += sum(sends) * world // (world - 1)


def _time_split(events: Sequence[Any], main: int, wall_us: float) -> dict[str, float]:
    """Seconds of the compute thread's self time by kind (:func:`_time_kind`), sorted by kind,
    with the step's wall time that no event accounts for as ``untracked``."""
    split_us: Counter[str] = Counter()
    for e in events:
        if e.thread == main:
            split_us[_time_kind(e.name, _ancestors(e))] += e.self_cpu_time_total
    tracked = sum(split_us.values())
    split_us["untracked"] = max(0.0, wall_us - tracked)
    return {k: v / 1e6 for k, v in sorted(split_us.items())}


def _comm_thread_seconds(events: Sequence[Any], main: int) -> float:
    """Seconds of backend operators on the backend's own threads (includes waiting for peers)."""
    total_us = 0.0
    for e in events:
        if e.name.startswith(("gloo:", "nccl:")) and e.thread != main:
            total_us += e.cpu_time_total
    return total_us / 1e6


def _top_ops(events: Sequence[Any], main: int, top: int) -> list[dict[str, Any]]:
    """The ``top`` operators (or ranges) of the compute thread by total self CPU time."""
    self_us: Counter[str] = Counter()
    for e in events:
        if e.thread == main:
            self_us[e.name] += e.self_cpu_time_total
    return [{"name": name, "self_s": us / 1e6} for name, us in self_us.most_common(top)]


def _ancestors(event: Any) -> list[str]:
    """Names of the ranges and operators ``event`` runs inside, innermost first."""
    names = []
    parent = event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return names


def _copy_site(name: str, chain: list[str], on_main: bool) -> str:
    """Where a copy runs: ``backend`` (communication), ``optimizer`` or ``framework``."""
    if not on_main or any(_is_comm(a) for a in chain):
        return "backend"
    if any(a.startswith("Optimizer.") for a in chain):
        return "optimizer"
    return "framework"


def _is_comm(name: str) -> bool:
    """Whether ``name`` is a communication operator or a labelled ``Work.wait()``."""
    return name == _WAIT_RANGE or name.startswith(("c10d::", "gloo:", "nccl:"))


def _time_kind(name: str, chain: list[str]) -> str:
    """Which part of a step an event's self time belongs to."""
    names = [name, *chain]
    if _WAIT_RANGE in names:
        return "comm_wait"
    if any(n.startswith(("c10d::", "gloo:", "nccl:")) for n in names):
        return "comm_issue"
    if any(n.startswith("Optimizer.") for n in names):
        return "optimizer"
    if any(n in COPY_OPS for n in names):
        return "copies"
    if name in FILL_OPS:
        return "fills"
    if name.startswith(("aten::", "autograd::", "torch::")) or "Backward" in name:
        return "compute"
    return "framework_ranges"  # self time of user ranges (FSDP::*, raggedfsdp::*, DDP)


def _input_bytes(event: Any, index: int) -> int:
    """Bytes of input ``index`` of ``event`` from its recorded shape and dtype (0 if none)."""
    shapes = getattr(event, "input_shapes", None) or []
    if index >= len(shapes) or not isinstance(shapes[index], list | tuple):
        return 0
    dtypes = getattr(event, "input_dtypes", None) or []
    size = _dtype_size(dtypes[index] if index < len(dtypes) else "float")
    return math.prod(shapes[index]) * size


_DTYPE_SIZES = {
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "long int": 8,
    "int": 4,
    "unsigned char": 1,
    "signed char": 1,
    "bool": 1,
}


def _dtype_size(name: str) -> int:
    """Bytes per element of a profiler dtype name (4 for names it does not know)."""
    return _DTYPE_SIZES.get(name, 4)
