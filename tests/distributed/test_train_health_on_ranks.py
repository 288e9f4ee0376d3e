"""The job's health checks on real Gloo ranks: what refuses to checkpoint non-finite weights
sees one rank's Inf as every rank's verdict. (The job's guards in real launches:
tests/e2e/test_train_guards.py.)"""

from __future__ import annotations

import torch

from harness import run_distributed


def _finite_on_ranks(rank: int, world: int) -> list[bool]:
    from raggedfsdp.train.health import all_finite

    good = [torch.ones(3), torch.zeros(0)]
    bad = [torch.ones(3), torch.tensor([float("inf") if rank == 1 else 0.0])]
    return [all_finite(good), all_finite(bad)]


def test_non_finite_weights_are_seen_by_every_rank() -> None:
    """What refuses to checkpoint non-finite weights: one rank's Inf is every rank's verdict."""
    assert run_distributed(_finite_on_ranks, 2) == [[True, False], [True, False]]
