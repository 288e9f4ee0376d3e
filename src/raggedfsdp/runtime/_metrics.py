"""What the runtime measures about itself: bytes moved, time waiting, copies made, memory, syncs.

One :class:`RuntimeStats` is shared by every unit of a model (the root creates it); the collectives
and the copy sites add to it. ``model.stats()`` returns a snapshot as a plain dict and
``model.reset_stats()`` starts a new window (typically one optimizer step). :class:`HostSyncCounter`
counts host synchronisations, for tests and benchmarks. Waits on an accelerator are timed as
:class:`_EventTimes` says ([Note: timing waits on an accelerator]).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import InitVar, asdict, dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncCounter", "RuntimeStats"]


# [Note: timing waits on an accelerator] On the CPU (Gloo) ``Work.wait()`` blocks the compute thread
# until the transfer is done, so ``perf_counter`` around it is the exposed communication. On a GPU
# (NCCL) ``wait()`` only makes the compute stream wait for the collective's stream and returns at
# once: timed on the host it would read ~0 and the compute would absorb all the communication. There
# the wait is timed on the device: an event recorded on the compute stream before ``wait()`` and one
# after, with nothing queued between them, so their distance is how long the compute stream stalled
# on the collective. Reading an event's time needs it to have happened, which would make the host
# wait for the device at every ``wait()``; the pairs are kept and read when the stats are
# (``snapshot``), where the step has synchronised anyway.
class _EventTimes:
    """Waits timed by events on an accelerator's current stream, resolved only when read
    ([Note: timing waits on an accelerator])."""

    def __init__(self, make_event: Callable[[], Any]) -> None:
        self._make_event = make_event  # () -> an event with record/synchronize/elapsed_time
        #: (before, after) of each wait since the last read, in the order they ran
        self._pending: list[tuple[Any, Any]] = []

    def record(self) -> Any:
        """An event recorded now on the current stream."""
        event = self._make_event()
        event.record()
        return event

    def add(self, before: Any, after: Any) -> None:
        self._pending.append((before, after))

    def seconds(self) -> float:
        """The waits' device time since the last read (waits for their events to happen)."""
        pending, self._pending = self._pending, []
        total_ms = 0.0
        for before, after in pending:
            after.synchronize()  # at once unless the stream is still behind
            total_ms += before.elapsed_time(after)
        return total_ms / 1000

    def clear(self) -> None:
        self._pending = []


def _device_event(device: torch.device) -> Callable[[], Any]:
    """Timing events on ``device`` (made when a wait is timed, so stats for an accelerator can
    exist where there is none: tests pass ``make_event``)."""
    return lambda: torch.Event(device=device, enable_timing=True)


@dataclass
class RuntimeStats:
    """Counters since the last reset. Bytes are per rank: what this rank sends into a
    collective's input (all-gather: its shard; reduce-scatter: the whole unsharded gradient;
    compressed: their messages of codes and scales).

    ``device`` is the compute device: on an accelerator the waits are timed by events and its
    peak memory is reset with the window; ``make_event`` makes those events (default:
    ``torch.Event`` on ``device``)."""

    all_gather_calls: int = 0
    all_gather_bytes: int = 0
    reduce_scatter_calls: int = 0
    reduce_scatter_bytes: int = 0
    #: what the all-gathers and reduce-scatters would have moved uncompressed (equal to the
    #: bytes above without compression): the compression ratio is bytes / uncompressed bytes
    all_gather_uncompressed_bytes: int = 0
    reduce_scatter_uncompressed_bytes: int = 0
    all_reduce_calls: int = 0
    all_reduce_bytes: int = 0
    #: the start of backward's all-reduces of what each rank's backward runs and uses
    #: (``_usage.py``): a few bytes per unit and parameter, not counted in the bytes above
    usage_all_reduces: int = 0
    #: units whose forward (backward) this rank skipped while another ran it, whose collectives
    #: it did without compute ([Note: ranks whose graphs differ] in ``_sequence.py``)
    forward_catch_ups: int = 0
    backward_catch_ups: int = 0
    #: seconds the compute was blocked on collectives (exposed communication): on the CPU the
    #: thread in ``Work.wait()``, on an accelerator its compute stream ([Note: timing waits on
    #: an accelerator])
    comm_wait_seconds: float = 0.0
    #: copies the framework made (casts under mixed precision; copy-in/out without zero copy)
    copies: int = 0
    copy_bytes: int = 0
    #: unsharded parameter and gradient bytes the framework holds now, and its high-water mark
    unsharded_bytes: int = 0
    peak_unsharded_bytes: int = 0
    #: ``reshard_after_forward=N`` (``_reshard_to.py``): the pieces kept from forward for
    #: backward, held now (counted in ``unsharded_bytes`` too), and backward's all-gathers of
    #: them within groups of N ranks (counted in the all-gathers above too)
    post_forward_bytes: int = 0
    post_forward_all_gather_calls: int = 0
    post_forward_all_gather_bytes: int = 0
    device: InitVar[torch.device | str | None] = None
    make_event: InitVar[Callable[[], Any] | None] = None

    def __post_init__(
        self, device: torch.device | str | None, make_event: Callable[[], Any] | None
    ) -> None:
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        #: None on the CPU (waits timed on the host)
        self._events: _EventTimes | None = None
        if self._device.type not in ("cpu", "meta"):
            self._events = _EventTimes(make_event or _device_event(self._device))

    @property
    def on_device(self) -> bool:
        """Whether waits are timed on an accelerator's stream (else on the host's clock)."""
        return self._events is not None

    def reset(self) -> None:
        """Start a new window; what is allocated now stays counted (it is still held). On CUDA
        the device's peak memory restarts from what is allocated now too."""
        held, kept = self.unsharded_bytes, self.post_forward_bytes
        for name, value in asdict(RuntimeStats()).items():
            setattr(self, name, value)
        self.unsharded_bytes = self.peak_unsharded_bytes = held
        self.post_forward_bytes = kept
        if self._events is not None:
            self._events.clear()
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)

    def note_all_gather(self, nbytes: int, uncompressed_bytes: int) -> None:
        """One all-gather into which this rank sent ``nbytes`` (``uncompressed_bytes`` without
        compression)."""
        self.all_gather_calls += 1
        self.all_gather_bytes += nbytes
        self.all_gather_uncompressed_bytes += uncompressed_bytes

    def note_reduce_scatter(self, nbytes: int, uncompressed_bytes: int) -> None:
        """One reduce-scatter into which this rank sent ``nbytes`` (``uncompressed_bytes``
        without compression)."""
        self.reduce_scatter_calls += 1
        self.reduce_scatter_bytes += nbytes
        self.reduce_scatter_uncompressed_bytes += uncompressed_bytes

    def note_unsharded(self, delta: int) -> None:
        self.unsharded_bytes += delta
        self.peak_unsharded_bytes = max(self.peak_unsharded_bytes, self.unsharded_bytes)

    def add_copy(self, tensor: torch.Tensor) -> None:
        self.copies += 1
        self.copy_bytes += tensor.numel() * tensor.element_size()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a collective's ``wait()``: its exposed time goes to ``comm_wait_seconds``."""
        if self._events is None:
            start = time.perf_counter()
            try:
                yield
            finally:
                self.comm_wait_seconds += time.perf_counter() - start
            return
        before = self._events.record()
        try:
            yield
        finally:
            self._events.add(before, self._events.record())

    def snapshot(self) -> dict[str, float]:
        """The counters as a dict (the waits timed on an accelerator read now), and on CUDA
        ``cuda_max_allocated_bytes``: the device's peak since the last :meth:`reset`."""
        if self._events is not None:
            self.comm_wait_seconds += self._events.seconds()
        out: dict[str, float] = asdict(self)
        if self._device.type == "cuda":
            out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(self._device)
        return out


# -- host synchronisations ----------------------------------------------------------------------

_aten = torch.ops.aten
#: Ops that hand a tensor's value to Python (``item()``, ``bool()``, ``int()``, ``float()`` all
#: reach ``_local_scalar_dense``; ``is_nonzero`` and ``equal`` return a Python bool): on an
#: accelerator the host waits for every queued kernel first.
_VALUE_READS = frozenset({_aten._local_scalar_dense, _aten.is_nonzero, _aten.equal, _aten.item})
#: Ops whose output size depends on the values, so an accelerator's host must read a count back
#: before it can allocate the output.
_DATA_DEPENDENT = frozenset(
    {
        _aten.nonzero,
        _aten.masked_select,
        _aten.unique_dim,
        _aten._unique2,
        _aten.unique_consecutive,
    }
)


class HostSyncCounter(TorchDispatchMode):
    """Counts, while active, the ATen ops that make the host wait for an accelerator: value
    reads (:data:`_VALUE_READS`), data-dependent output sizes (:data:`_DATA_DEPENDENT`, and
    ``repeat_interleave`` by a tensor of counts without ``output_size``), and copies from an
    accelerator to the CPU (``_to_copy`` / ``copy_``). It runs on CPU too, where none of these
    waits for anything, so a test on this machine counts what a GPU would pay: a copy from a
    device tensor cannot happen on CPU, and ``Tensor.tolist()`` on a CPU tensor reads memory
    without an op (on a GPU it copies to the CPU first, and is counted). ``counts`` is by op
    name; ``total`` their sum."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if _synchronises(func, args, kwargs):
            self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **kwargs)


def _synchronises(func: Any, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether the op ``func(*args, **kwargs)`` makes the host wait for an accelerator."""
    packet = func.overloadpacket
    if packet in _VALUE_READS or packet in _DATA_DEPENDENT:
        return True
    if packet is _aten.repeat_interleave:
        counts = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(counts, torch.Tensor) and kwargs.get("output_size") is None
    if packet is _aten._to_copy:
        target = kwargs.get("device")
        return target is not None and torch.device(target).type == "cpu" and _on_device(args[0])
    if packet is _aten.copy_:
        return args[0].device.type == "cpu" and _on_device(args[1])
    return False


def _on_device(tensor: Any) -> bool:
    """A tensor in accelerator memory (not the CPU's, not meta)."""
    return isinstance(tensor, torch.Tensor) and tensor.device.type not in ("cpu", "meta")
