"""Multi-process tests run on real Gloo groups through :func:`raggedfsdp.spawn.run_on_ranks`."""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh

from raggedfsdp.layout import ShardLayout
from raggedfsdp.spawn import run_on_ranks
from raggedfsdp.tensor import RaggedTensor

# The process group a grid case runs on: None for the default group.
Group = dist.ProcessGroup | None
# What a world grid holds: per world size W, the results of ranks 0..W-1 in rank order.
Grid = dict[int, list[Any]]


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


def run_world_grid(
    cases: Callable[[int, int, Group], Any],
    worlds: Sequence[int],
    *,
    as_launches: bool = False,
    timeout: float = 300.0,
) -> Grid:
    """Run ``cases(rank, w, group)`` for every world size ``w`` in ``worlds`` on the group of
    ranks [0, w), all within ONE launch of ``max(worlds)`` ranks (starting ranks is the slow part);
    returns the :data:`Grid` of their results. ``cases`` must be importable by module and name.

    With ``as_launches``, each world size runs as if it were a launch of its own: ranks [0, w)
    leave the default process group they had and make a new one of ``w`` ranks (``group`` is
    then None), so that code which works over the whole world (``fully_shard`` without a mesh,
    DCP, torch's FSDP2) sees exactly ``w`` ranks. The sizes run in the order given; a rank waits
    for the ranks before it to finish the previous sizes."""
    with tempfile.TemporaryDirectory(prefix="raggedfsdp-grid-") as stores:
        per_rank = run_distributed(
            _world_grid_on_rank,
            max(worlds),
            cases,
            tuple(worlds),
            stores if as_launches else None,
            timeout,
            timeout=timeout,
        )
    return {w: [results[w] for results in per_rank[:w]] for w in worlds}


def _world_grid_on_rank(
    rank: int,
    world: int,
    cases: Callable[[int, int, Group], Any],
    worlds: tuple[int, ...],
    stores: str | None = None,
    timeout: float = 300.0,
) -> dict[int, Any]:
    """Returns this rank's results of ``cases`` by world size, for the sizes it takes part in."""
    if stores is not None:  # as launches: a default group per size, met in a store of its own
        # A rank leaves a group only once every rank is done with it (a barrier first): Gloo
        # fails a peer that still sends to, or is still connecting to, a rank that left.
        dist.barrier()
        results = {}
        for w in worlds:
            if rank < w:
                dist.destroy_process_group()
                store = dist.FileStore(os.path.join(stores, f"world-{w}"), w)
                wait = datetime.timedelta(seconds=timeout)
                dist.init_process_group("gloo", store=store, rank=rank, world_size=w, timeout=wait)
                results[w] = cases(rank, w, None)
                dist.barrier()
        return results
    # new_group is collective over the whole launch, so every rank makes every group, in the same
    # order. The full launch is the default group (None); W = 1 needs none, as a one-rank layout
    # never communicates.
    groups = {w: dist.new_group(list(range(w))) if 1 < w < world else None for w in worlds}
    return {w: cases(rank, w, group) for w, group in groups.items() if rank < w}


def world_grid_fixture(
    cases: Callable[[int, int, Group], Any],
    worlds: Sequence[int],
    *,
    as_launches: bool = False,
    timeout: float = 300.0,
) -> Callable[[], Grid]:
    """Returns a module-scoped fixture named ``grid``, to bind at module level under that name,
    whose value is :func:`run_world_grid` of ``cases`` and ``worlds`` (and ``as_launches``): one
    launch per test module, shared by all its tests."""

    @pytest.fixture(scope="module", name="grid")
    def grid() -> Grid:
        return run_world_grid(cases, worlds, as_launches=as_launches, timeout=timeout)

    return grid


def sharded_param(piece: torch.Tensor, layout: ShardLayout, group: Group) -> nn.Parameter:
    """``piece``, this rank's piece of a tensor placed by ``layout`` over ``group``, as a sharded
    parameter (a RaggedTensor). ``group`` None is the default group (for W = 1 inside a larger
    launch too: a one-rank layout never communicates, so the other ranks are never asked)."""
    mesh = DeviceMesh.from_group(dist.group.WORLD if group is None else group, "cpu")
    return nn.Parameter(RaggedTensor.from_piece(piece, layout, mesh))


def assert_no_failures(grid: Grid, world: int) -> None:
    """Asserts that every rank of world size ``world`` reported an empty ``"failures"`` list; the
    message names the first rank that did not and its first five failures."""
    for rank, result in enumerate(grid[world]):
        failures = result["failures"]
        assert failures == [], f"W={world} rank {rank}: {failures[:5]}"


def assert_close_dicts(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, atol: float = 1e-5
) -> None:
    """The same keys, and every tensor within ``rtol=1e-5`` and ``atol`` of ``want``'s (the
    key in the message of the first that is not)."""
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=atol, msg=key)


@contextlib.contextmanager
def patched(owner: Any, **attributes: Any) -> Iterator[None]:
    """``owner``'s ``attributes`` (methods of a class, functions of a module) replaced inside the
    block, put back after it."""
    saved = {name: getattr(owner, name) for name in attributes}
    for name, value in attributes.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(owner, name, value)


def error_message(fn: Callable[[], object]) -> str:
    """The message of the ``ValueError``, ``TypeError`` or ``RuntimeError`` that ``fn()`` raises
    on this rank (or ``AssertionError``, where FSDP2's callers expect one: applying fully_shard
    twice, deepcopy), or ``"no error"`` (ranks collect these for the tests of bad input)."""
    try:
        fn()
    except (ValueError, TypeError, RuntimeError, AssertionError) as e:
        return str(e)
    return "no error"


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of a sharded ``model``, by torch's DSD: a collective."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def drawn(name: str, full: torch.Tensor) -> None:
    """An ``init_fn`` for ``rf.init_sharded_``: standard normal values."""
    full.normal_()


def drawn_whole(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """What ``rf.init_sharded_(sharded, drawn)`` after ``torch.manual_seed(seed)`` must give:
    the state of ``model``, unsharded, each parameter drawn in ``named_parameters()`` order."""
    torch.manual_seed(seed)
    for name, param in model.named_parameters():
        drawn(name, param.data)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
