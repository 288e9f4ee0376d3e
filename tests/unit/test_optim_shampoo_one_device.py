"""Block Shampoo in one process: a layout that cuts a block is named, grafting gives each block
Adam's step length, the state dict keeps fp32 preconditioners, bad hyper-parameters are named.
(On shards of whole row-blocks at W = 1..4: tests/distributed/test_optim_shampoo.py.)"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch import nn

from fake_ranks import fake_world
from harness import sharded_param
from optim_grid import state_dict_round_trip
from raggedfsdp.layout import ShardLayout
from raggedfsdp.optim import Shampoo


def test_layout_cutting_a_block_is_named() -> None:
    # Blocks of 2 rows × 4 columns; rank 0 ends after 3 rows, inside block 1 (rows 2-3).
    layout = ShardLayout((8, 4), 4, ((0, 12), (12, 32)))
    with fake_world(0, 2):  # rank 0 of the layout's two
        param = sharded_param(layout.to_local(torch.zeros(8, 4), 0).clone(), layout, None)
        with pytest.raises(ValueError, match=r"'w'.*block 1 \(elements \[8, 16\)\).*unit is 4"):
            Shampoo([("w", param)], max_preconditioner_dim=2)


def test_grafting_gives_each_block_adams_step_length() -> None:
    """Per block, the update's Frobenius norm is lr · the Adam direction's norm."""
    gen = torch.Generator().manual_seed(3)
    param = nn.Parameter(torch.randn(6, 5, generator=gen))
    before = param.detach().clone()
    opt = Shampoo([param], lr=0.1, max_preconditioner_dim=4, epsilon=1e-6, precondition_frequency=1)
    param.grad = torch.randn(6, 5, generator=gen)
    opt.step()
    # At step 1 the bias-corrected Adam direction is g / (|g| + eps) elementwise.
    adam = param.grad / (param.grad.abs() + 1e-8)
    step = before - param.detach()
    for rows, cols in itertools.product((slice(0, 4), slice(4, 6)), (slice(0, 4), slice(4, 5))):
        expected = 0.1 * adam[rows, cols].norm()
        assert torch.allclose(step[rows, cols].norm(), expected, rtol=1e-5)
    assert not torch.allclose(step, 0.1 * adam, rtol=1e-3)  # the direction is not Adam's


def test_state_dict_round_trip_keeps_fp32_preconditioners() -> None:
    make = functools.partial(Shampoo, max_preconditioner_dim=4, precondition_frequency=1)
    state, equal_after_step = state_dict_round_trip(make, (6, 5), seed=4)
    assert all(m.dtype == torch.float32 for key in ("L", "R", "L_inv_root") for m in state[key])
    assert equal_after_step


def test_bad_hyper_parameters_are_named() -> None:
    param = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="max_preconditioner_dim"):
        Shampoo([param], max_preconditioner_dim=0)
    with pytest.raises(ValueError, match="betas"):
        Shampoo([param], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="start_preconditioning_step"):
        Shampoo([param], start_preconditioning_step=0)
