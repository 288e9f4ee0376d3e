"""What the runtime measures about itself: bytes moved, time waiting, copies made, memory.

One :class:`RuntimeStats` is shared by every unit of a model (the root creates it); the
collectives and the copy sites add to it. ``model.stats()`` returns a snapshot as a plain dict and
``model.reset_stats()`` starts a new window (typically one optimizer step).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

__all__ = ["RuntimeStats"]


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
