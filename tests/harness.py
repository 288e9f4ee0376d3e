"""Multi-process tests run on real Gloo groups through :func:`raggedfsdp.spawn.run_on_ranks`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from raggedfsdp.spawn import run_on_ranks


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    pg_timeout: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` Gloo ranks; return their results.
    Gloo even on a GPU machine: the tests' tensors live on the CPU."""
    return run_on_ranks(
        fn, world_size, *args, timeout=timeout, pg_timeout=pg_timeout, env=env, backend="gloo"
    )
