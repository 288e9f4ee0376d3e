"""Shared pytest setup: the tiers, the support modules, one thread per process, the corpus.

A test's tier is the folder it lives in, and its markers come from there:

- ``tests/unit/``: pure logic in this process (no process group, or a group of one made here):
  marker ``unit``; ``make test-fast`` runs this tier.
- ``tests/distributed/``: real multi-process Gloo groups (tests/support/harness.py, one launch of
  ranks per module or grid): markers ``distributed`` and ``slow``.
- ``tests/e2e/``: whole jobs in subprocesses (``raggedfsdp train`` through torchrun, the CLI in a
  fresh interpreter, elastic membership, preemption): markers ``e2e`` and ``slow``.
- ``tests/support/``: what the tests share (harness, launches, parity models, scripts run on
  ranks, recorded JSON), importable by module name from any tier and from spawned ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
# Spawned ranks inherit sys.path, so they import the support modules by the same names.
sys.path.insert(0, str(TESTS / "support"))

pytest.register_assert_rewrite("harness", "optim_grid", "launches")
torch.set_num_threads(1)

#: The tiers, by folder: the markers each sets.
TIERS = {"unit": ("unit",), "distributed": ("distributed", "slow"), "e2e": ("e2e", "slow")}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    outside = set()
    for item in items:
        path = item.path.resolve()
        parts = path.relative_to(TESTS).parts if path.is_relative_to(TESTS) else ()
        if len(parts) < 2 or parts[0] not in TIERS:
            outside.add(item.nodeid.split("::")[0])
            continue
        for marker in TIERS[parts[0]]:
            item.add_marker(marker)
    if outside:
        raise pytest.UsageError(
            "test files live in a tier's folder (tests/unit, tests/distributed, tests/e2e; see "
            f"tests/conftest.py), not: {', '.join(sorted(outside))}"
        )


@pytest.fixture
def command(capsys):
    """``raggedfsdp ARGS`` in this process -> (status, stdout, stderr)."""
    from raggedfsdp import cli

    def run(*args: str) -> tuple[int, str, str]:
        status = cli.main(list(args))
        out, err = capsys.readouterr()
        return status, out, err

    return run


@pytest.fixture
def group_of_one():
    """A process group of this process alone (Gloo), for the test's duration."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A corpus file of 400 KB of the standard library's sources (its first 40 modules): fast to
    load, plenty for the few steps a test trains; written once per session."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = b"\n".join(p.read_bytes() for p in sorted(stdlib.glob("*.py"))[:40])
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(data[:400_000])
    return path
