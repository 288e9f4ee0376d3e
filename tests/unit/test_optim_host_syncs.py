"""Host syncs as a budget: a step of each raggedfsdp optimizer makes the host wait for the device
no more often than torch's AdamW on the same parameters (either foreach setting), counted on the
CPU by tests/support/host_syncs.py over 100 steps. Negative control: Shampoo recomputing its inverse
roots every step (the former default) exceeds the budget."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from host_syncs import SHAPES, make_params, mean, optimizers, syncs_per_step
from raggedfsdp.optim import AdamW8bit
from raggedfsdp.optim.adamw8bit import _SIGNED_MAP, _UNSIGNED_MAP

STEPS = 100  # Shampoo's default precondition_frequency: the window holds one recomputation
ADAMW = ("torch AdamW foreach=False", "torch AdamW foreach=True")


@pytest.fixture(scope="module")
def counts() -> dict[str, list[int]]:
    return {name: syncs_per_step(make, steps=STEPS) for name, make in optimizers().items()}


def _budget(counts: dict[str, list[int]]) -> float:
    return min(mean(counts[name]) for name in ADAMW)


def test_torch_adamw_reads_each_step_counter(counts) -> None:
    """The yardstick: one host read of each parameter's step (two with foreach)."""
    assert counts[ADAMW[0]] == [len(SHAPES)] * STEPS
    assert counts[ADAMW[1]] == [2 * len(SHAPES)] * STEPS


@pytest.mark.parametrize("name", ["rf Muon", "rf Shampoo", "rf AdamW8bit"])
def test_no_more_host_syncs_per_step_than_torch_adamw(counts, name: str) -> None:
    assert mean(counts[name]) <= _budget(counts), counts[name]


def test_shampoo_roots_every_step_exceed_the_budget(counts) -> None:
    """Negative control: the count does see the eigendecompositions."""
    assert mean(counts["rf Shampoo precondition_frequency=1"]) > _budget(counts)


def test_shampoo_recomputes_roots_every_precondition_frequency_steps_batched_per_size(
    counts,
) -> None:
    """Steps 2-101 with roots every 100 steps from step 100: one step pays one ``eigh`` per
    block size (sides 128, 64, 96 and 40), not two per block (six blocks)."""
    shampoo = counts["rf Shampoo"]
    sizes = {s for shape in SHAPES if len(shape) == 2 for s in shape}
    assert shampoo.index(max(shampoo)) == 100 - 2  # step 100, the 99th counted
    assert sorted(shampoo) == [min(shampoo)] * (STEPS - 1) + [min(shampoo) + len(sizes)]


class _MapCopies(TorchFunctionMode):
    """Counts ``.to()`` calls on AdamW8bit's two code maps."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        if func is torch.Tensor.to and any(args[0] is m for m in (_SIGNED_MAP, _UNSIGNED_MAP)):
            self.copies += 1
        return func(*args, **(kwargs or {}))


def test_adamw8bit_copies_its_code_maps_to_a_device_once() -> None:
    """On an accelerator each copy of a map is a blocking host-to-device copy, which the CPU
    count cannot see: after the first step (which makes the per-device maps) there are none;
    the former code made two per quantized parameter and step."""
    params = make_params()
    optimizer = AdamW8bit(params)
    copies = []
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape)
        with _MapCopies() as mode:
            optimizer.step()
        copies.append(mode.copies)
    assert copies[1:] == [0, 0], copies
