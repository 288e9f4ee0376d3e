"""Run a function on W real processes joined by a Gloo process group, and collect the results.

Each rank runs ``fn(rank, world_size, *args)`` in a fresh interpreter (spawn), with one thread
and a real ``torch.distributed`` Gloo group. Results travel back through ``torch.save`` files, so
they are judged even when Gloo aborts a process at exit after its work is done (a known Gloo
quirk). An exception on any rank is re-raised here with that rank's traceback; a rank that does
not finish within ``timeout`` seconds fails the call instead of hanging the suite.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple,
    tmp: str,
    env: dict,
    pg_timeout: float | None,
) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    import torch.distributed as dist

    out = Path(tmp) / f"result{rank}.pt"
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/store",
            rank=rank,
            world_size=world_size,
            timeout=None if pg_timeout is None else datetime.timedelta(seconds=pg_timeout),
        )
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "value": result}, out)
    except BaseException:  # report every failure, including assertion errors, to the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            os._exit(0)  # skip interpreter teardown, where Gloo sometimes aborts


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    pg_timeout: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` Gloo ranks; return their results.
    ``pg_timeout`` (seconds) is the process group's collective timeout."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_worker, args=(fn, r, world_size, args, tmp, env or {}, pg_timeout))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results: list[Any] = []
        errors: list[str] = []
        for r in range(world_size):
            path = Path(tmp) / f"result{r}.pt"
            if not path.exists():
                errors.append(f"rank {r}: no result" + (" (timed out)" if r in hung else ""))
                results.append(None)
                continue
            record = torch.load(path, weights_only=False)
            if record["ok"]:
                results.append(record["value"])
            else:
                errors.append(f"rank {r} raised:\n{record['error']}")
                results.append(None)
        if errors:
            raise AssertionError("\n".join(errors))
        return results
