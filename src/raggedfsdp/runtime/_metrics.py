"""What the runtime measures about itself: bytes moved, time waiting, copies made, memory, and
(for tests and benchmarks) the host synchronisations it makes.

One :class:`RuntimeStats` is shared by every unit of a model (the root creates it); the
collectives and the copy sites add to it. ``model.stats()`` returns a snapshot as a plain dict and
``model.reset_stats()`` starts a new window (typically one optimizer step).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncCounter", "RuntimeStats"]


@dataclass
class RuntimeStats:
    """Counters since the last reset. Bytes are per rank: what this rank sends into a
    collective's input (all-gather: its shard; reduce-scatter: the whole unsharded gradient;
    compressed: their messages of codes and scales)."""

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
    #: seconds the compute thread spent blocked in ``Work.wait()`` (exposed communication)
    comm_wait_seconds: float = 0.0
    #: copies the framework made (casts under mixed precision; copy-in/out without zero copy)
    copies: int = 0
    copy_bytes: int = 0
    #: unsharded parameter and gradient bytes the framework holds now, and its high-water mark
    unsharded_bytes: int = 0
    peak_unsharded_bytes: int = 0

    def reset(self) -> None:
        """Start a new window; what is allocated now stays counted (it is still held)."""
        held = self.unsharded_bytes
        for name, value in asdict(RuntimeStats()).items():
            setattr(self, name, value)
        self.unsharded_bytes = self.peak_unsharded_bytes = held

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
        start = time.perf_counter()
        try:
            yield
        finally:
            self.comm_wait_seconds += time.perf_counter() - start

    def snapshot(self) -> dict[str, float]:
        return asdict(self)


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
