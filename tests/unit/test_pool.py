"""BufferPool: blocks reused by exact size and counted as held memory until cleared."""

from __future__ import annotations

import torch

from raggedfsdp.runtime import RuntimeStats
from raggedfsdp.runtime._pool import BufferPool

CPU = torch.device("cpu")


def test_released_block_is_reused_for_the_same_size_only():
    stats = RuntimeStats()
    pool = BufferPool(stats)
    a = pool.take(1000, torch.float32, CPU)
    pool.give(a)
    b = pool.take(1000, torch.float32, CPU)
    assert b.data_ptr() == a.data_ptr()  # the same memory, not a fresh allocation
    c = pool.take(1000, torch.float32, CPU)  # b is taken: a second block
    assert c.data_ptr() != b.data_ptr()
    d = pool.take(1000, torch.bfloat16, CPU)  # another dtype never shares a block
    assert d.data_ptr() not in (b.data_ptr(), c.data_ptr())
    assert stats.unsharded_bytes == 4000 + 4000 + 2000
    assert stats.peak_unsharded_bytes == 10_000


def test_clear_frees_released_blocks_and_keeps_taken_ones_counted():
    stats = RuntimeStats()
    pool = BufferPool(stats)
    held = pool.take(256, torch.float32, CPU)
    pool.give(pool.take(512, torch.float32, CPU))
    assert pool.held_bytes == 2048
    pool.clear()
    assert pool.held_bytes == 0
    assert stats.unsharded_bytes == held.numel() * 4  # still taken
    pool.give(held)
    pool.clear()
    assert stats.unsharded_bytes == 0


def test_pool_without_retain_frees_every_block_at_once():
    stats = RuntimeStats()
    pool = BufferPool(stats, retain=False)
    pool.give(pool.take(100, torch.float32, CPU))
    assert pool.held_bytes == 0 and stats.unsharded_bytes == 0
    assert stats.peak_unsharded_bytes == 400
