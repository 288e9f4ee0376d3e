"""Shared pytest setup: one thread per process keeps multi-process tests fast on 2 cores, and
the shared test helpers get pytest's assertion messages too."""

import pytest
import torch

pytest.register_assert_rewrite("harness", "optim_grid", "launches")
torch.set_num_threads(1)


@pytest.fixture
def command(capsys):
    """``raggedfsdp ARGS`` in this process -> (status, stdout, stderr)."""
    from raggedfsdp import cli

    def run(*args: str) -> tuple[int, str, str]:
        status = cli.main(list(args))
        out, err = capsys.readouterr()
        return status, out, err

    return run
