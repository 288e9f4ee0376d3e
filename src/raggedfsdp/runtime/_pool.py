"""Scratch memory reused from one unit to the next within a backward pass.

Each unit's backward needs an unsharded gradient buffer, and on Gloo a receive buffer for its
reduce-scatter; consecutive units of a model are mostly the same size. Allocating each afresh
hands the memory back to the OS and faults it in again page by page (on CPU a 12 MiB buffer is
3,000 page faults, each zeroing a page the runtime then zeroes or overwrites anyway). A
:class:`BufferPool` keeps released blocks and hands them to the next request of the same size.

Only memory that nothing outside the runtime keeps a reference to is pooled: the unsharded
*parameters* cannot be, because autograd saves views of them whose storage must stay the same
object from forward to backward (see [Note: freeing unsharded storage] in ``_dbuffer.py``). The
pool is emptied at the end of every backward, so it holds nothing through forward, where the
memory peak (the start of backward) is reached.
"""

from __future__ import annotations

import torch

from ._metrics import RuntimeStats

__all__ = ["BufferPool"]

_Key = tuple[int, torch.dtype, torch.device]


class BufferPool:
    """Released 1-D blocks, by exact ``(numel, dtype, device)``; their bytes are counted as held
    unsharded memory in ``stats`` from allocation until :meth:`clear`. With ``retain=False``
    a released block is freed at once (every request allocates: ``group_level=False``)."""

    def __init__(self, stats: RuntimeStats, *, retain: bool = True) -> None:
        self.stats = stats
        self.retain = retain
        self._free: dict[_Key, list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D block of ``numel`` elements, uninitialised: a released one if any."""
        blocks = self._free.get((numel, dtype, device))
        if blocks:
            return blocks.pop()
        block = torch.empty(numel, dtype=dtype, device=device)
        self.stats.note_unsharded(_nbytes(block))
        return block

    def give(self, block: torch.Tensor) -> None:
        """Return a block from :meth:`take`; the caller keeps no view of it."""
        if not self.retain:
            self.stats.note_unsharded(-_nbytes(block))
            return
        self._free.setdefault((block.numel(), block.dtype, block.device), []).append(block)

    @property
    def held_bytes(self) -> int:
        """Bytes of released blocks waiting for reuse."""
        return sum(_nbytes(b) for blocks in self._free.values() for b in blocks)

    def clear(self) -> None:
        """Free every released block (blocks still taken stay with their holders)."""
        self.stats.note_unsharded(-self.held_bytes)
        self._free.clear()


def _nbytes(block: torch.Tensor) -> int:
    return block.numel() * block.element_size()
