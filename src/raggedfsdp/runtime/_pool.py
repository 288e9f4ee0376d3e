"""Scratch memory reused from one unit to the next within a backward pass.

A :class:`BufferPool` keeps the unsharded gradient buffers (and Gloo's receive buffers) units
release and hands them to the next request of the same size, instead of faulting fresh memory in
page by page; why only these, and how streams share them, is the comment at :class:`BufferPool`.
"""

from __future__ import annotations

from typing import Any

import torch

from ._metrics import RuntimeStats
from ._streams import Streams

__all__ = ["BufferPool"]

_Key = tuple[int, torch.dtype, torch.device]
#: a block given back, the event its last reader recorded then, and the stream it was allocated
#: on (``None`` and ``None`` without streams)
_Entry = tuple[torch.Tensor, Any, Any]


# Each unit's backward needs an unsharded gradient buffer, and on Gloo a receive buffer for its
# reduce-scatter; consecutive units of a model are mostly the same size. Allocating each afresh
# hands the memory back to the OS and faults it in again page by page (on CPU a 12 MiB buffer is
# 3,000 page faults, each zeroing a page the runtime then zeroes or overwrites anyway).
#
# Only memory that nothing outside the runtime keeps a reference to is pooled: the unsharded
# *parameters* cannot be, because autograd saves views of them whose storage must stay the same
# object from forward to backward (see [Note: freeing unsharded storage] in ``_dbuffer.py``). The
# pool is emptied at the end of every backward, so it holds nothing through forward, where the
# memory peak (the start of backward) is reached.
#
# With communication streams ([Note: streams and events] in ``_streams.py``) a block may be given
# back while a stream still reads it (the all-gather stream dequantizing from it, the reduce-scatter
# stream summing from it). So the pool records an event on the stream that gives it back (the last
# reader), and the next taker's stream waits for that event before it writes; a block leaves the
# pool for the allocator only once the stream it was allocated on, whose allocations may reuse its
# memory at once, has waited for it too.
class BufferPool:
    """Released 1-D blocks, by exact ``(numel, dtype, device)``; their bytes are counted as held
    unsharded memory in ``stats`` from allocation until :meth:`clear`. With ``retain=False``
    a released block is freed at once (every request allocates: ``group_level=False``), on an
    accelerator once its event allows. ``streams``: the root's (module doc), if any."""

    def __init__(
        self, stats: RuntimeStats, *, retain: bool = True, streams: Streams | None = None
    ) -> None:
        self.stats = stats
        self.retain = retain
        self.streams = streams
        self._free: dict[_Key, list[_Entry]] = {}
        #: the stream each block taken and not yet given back was allocated on, by id
        self._home: dict[int, Any] = {}
        #: ``retain=False`` blocks given back on an accelerator, until their memory may go
        self._releasing: list[_Entry] = []

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D block of ``numel`` elements, uninitialised: a released one if any, which the
        current stream waits for its last reader to be done with first."""
        self._release()
        entries = self._free.get((numel, dtype, device))
        if entries:
            block, event, home = entries.pop()
            if self.streams is not None:
                self.streams.wait(event)
        else:
            block = torch.empty(numel, dtype=dtype, device=device)
            self.stats.note_unsharded(_nbytes(block))
            home = None if self.streams is None else self.streams.current()
        self._home[id(block)] = home
        return block

    def give(self, block: torch.Tensor) -> None:
        """Return a block from :meth:`take`, from the stream that read it last (an event is
        recorded there); the caller keeps no view of it."""
        home = self._home.pop(id(block), None)
        event = None if self.streams is None else self.streams.record(label="pool")
        if not self.retain:
            self.stats.note_unsharded(-_nbytes(block))
            if event is not None and self.streams is not None and not self.streams.host:
                self._releasing.append((block, event, home))  # a stream may still read it
            return
        key = (block.numel(), block.dtype, block.device)
        self._free.setdefault(key, []).append((block, event, home))

    @property
    def held_bytes(self) -> int:
        """Bytes of released blocks waiting for reuse."""
        return sum(_nbytes(e[0]) for entries in self._free.values() for e in entries)

    def clear(self) -> None:
        """Free every released block (blocks still taken stay with their holders)."""
        self.stats.note_unsharded(-self.held_bytes)
        self._releasing.extend(e for entries in self._free.values() for e in entries)
        self._free.clear()
        self._release()

    def _release(self) -> None:
        """Let go of blocks given back, each once the stream it was allocated on has waited
        for its last reader: the allocator may hand its memory to that stream's next
        allocation at once."""
        if self.streams is not None:
            for _, event, home in self._releasing:
                self.streams.wait(event, home)
        self._releasing.clear()


def _nbytes(block: torch.Tensor) -> int:
    return block.numel() * block.element_size()
