"""Facts about this process's host: which device it computes on, and its resident memory."""

from __future__ import annotations

import os
import resource
import sys

import torch
import torch.distributed as dist

__all__ = [
    "available_ram_bytes",
    "backend_for",
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


def backend_for(group: dist.ProcessGroup | None, device_type: str) -> str:
    """The backend that carries ``device_type``'s tensors in ``group`` (``None``: the default
    group): its one backend, or the one it pairs with that device type (``"cpu:gloo,cuda:nccl"``,
    torch's default and what CPU offload needs); ``""`` when it pairs none with it."""
    name = str(dist.get_backend(group))
    if ":" not in name:
        return name
    return dict(pair.split(":", 1) for pair in name.split(",")).get(device_type, "")


def default_device() -> torch.device:
    """The device this rank computes on once the process group exists: its current GPU when
    NCCL carries CUDA tensors (alone or beside Gloo), else the CPU."""
    if dist.is_initialized() and backend_for(None, "cuda") == "nccl":
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
