"""Facts about this process's host: which device it computes on, and its resident memory."""

from __future__ import annotations

import os
import resource
import sys

import torch
import torch.distributed as dist

__all__ = [
    "available_ram_bytes",
    "current_rss_bytes",
    "default_device",
    "local_device",
    "peak_rss_bytes",
    "synchronize",
]


def local_device(local_rank: int) -> torch.device:
    """The device of the worker with ``local_rank`` on its node, before any process group
    exists: that GPU when CUDA is present (made current), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def default_device() -> torch.device:
    """The device this rank computes on once the process group exists: its current GPU under
    NCCL (alone or beside Gloo, ``"cpu:gloo,cuda:nccl"``), else the CPU."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so timings measure work done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_rss_bytes() -> int:
    """The process's resident-set high-water mark (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def current_rss_bytes() -> int:
    """The process's resident set now (Linux); elsewhere its high-water mark."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def available_ram_bytes() -> int:
    """Memory the host can give new processes without swapping: Linux's ``MemAvailable``;
    elsewhere the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
