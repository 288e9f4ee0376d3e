"""Run a function on W fresh processes joined by a process group, and collect what each returns.

For ``raggedfsdp bench``, the benchmarks and the multi-process tests: each rank runs ``fn(rank,
world_size, *args)`` in a fresh process with one compute thread and NCCL (a GPU per rank) or Gloo,
forked from a server that imported torch and raggedfsdp once. Results travel back through
``torch.save`` files, so they are judged even when Gloo aborts a process at exit (``os._exit``
skips that teardown). A rank's exception is raised here with its traceback; a rank that outruns
``timeout`` is killed and reported instead of hanging the caller.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["run_on_ranks"]


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    pg_timeout: float | None = None,
    env: dict[str, str] | None = None,
    backend: str | None = None,
    netns: str | None = None,
) -> list[Any]:
    """``[fn(rank, world_size, *args) for every rank]``, each run on its own process.

    ``fn`` must be importable by module and name (spawned processes import it). ``pg_timeout``
    (seconds) is the process group's collective timeout; ``env`` is added to each rank's
    environment; ``backend`` forces ``"gloo"``, ``"nccl"`` or a per-device pair such as
    ``"cpu:gloo,cuda:nccl"`` (default: NCCL when every rank can have its own GPU, else Gloo).
    ``netns`` names a network namespace (``ip netns add``) that every rank joins before the
    process group exists, so their traffic crosses its loopback (the slow-link bed of
    ``raggedfsdp bench --link-gbit``; needs root).
    """
    ctx = _forkserver()
    with tempfile.TemporaryDirectory(prefix="raggedfsdp-ranks-") as tmp:
        procs = [
            ctx.Process(
                target=_rank_entry,
                args=(fn, rank, world_size, args, tmp, env or {}, pg_timeout, backend, netns),
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results: list[Any] = []
        errors: list[str] = []
        for rank in range(world_size):
            path = Path(tmp) / f"rank{rank}.pt"
            if not path.exists():
                why = " (timed out)" if rank in hung else f" (exit code {procs[rank].exitcode})"
                errors.append(f"rank {rank}: no result{why}")
                continue
            # Not weights_only: a result is any picklable value, and this file crosses no trust
            # boundary (written by this process's own children into its private mkdtemp folder).
            record = torch.load(path, weights_only=False)
            if record["ok"]:
                results.append(record["value"])
            else:
                errors.append(f"rank {rank} raised:\n{record['error']}")
        if errors:
            raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed:\n" + "\n".join(errors))
        return results


def _forkserver() -> Any:
    """multiprocessing's forkserver context, its server importing raggedfsdp (and torch) once.

    A rank forked from it starts in milliseconds; a spawned interpreter pays seconds of imports
    per rank (the multi-process tests: 313 s -> 166 s on two cores). The server never
    initialises CUDA, so its children may."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["raggedfsdp"])
    return ctx


def _rank_entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple,
    tmp: str,
    env: dict[str, str],
    pg_timeout: float | None,
    backend: str | None,
    netns: str | None = None,
) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):  # already set once work ran
        torch.set_num_interop_threads(1)
    out = Path(tmp) / f"rank{rank}.pt"
    try:
        if netns is not None:
            _enter_netns(netns)
        if backend is None:
            enough = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
            backend = "nccl" if enough else "gloo"
        if "nccl" in backend:
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{tmp}/store",
            rank=rank,
            world_size=world_size,
            timeout=None if pg_timeout is None else datetime.timedelta(seconds=pg_timeout),
        )
        torch.save({"ok": True, "value": fn(rank, world_size, *args)}, out)
    except BaseException:  # every failure, assertion errors included, goes to the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            os._exit(0)


def _enter_netns(name: str) -> None:
    """Join network namespace ``name``; Gloo then talks over its loopback, the only device."""
    import ctypes

    clone_newnet = 0x40000000
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{name}") as f:
        if libc.setns(f.fileno(), clone_newnet) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"cannot join network namespace {name!r}: {os.strerror(errno)}")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
