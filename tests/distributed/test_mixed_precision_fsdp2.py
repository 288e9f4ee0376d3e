"""bf16 mixed precision gives FSDP2's gradients bit for bit: rf and FSDP2 in one launch (2 Gloo
ranks), every gradient compared with ``torch.equal`` after the backward(s) of one step.

The case that used to part them: backwards that do not reduce (``no_sync``: gradient
accumulation, and torchtitan's chunked loss, whose head runs one backward per chunk). With
``reduce_dtype=fp32`` FSDP2 sums those backwards' bf16 gradients in fp32
(``unsharded_accumulated_grad``); rf summed them in bf16, rounding at each addition, and
torchtitan's llama3 debug model in bf16 drifted from FSDP2 (docs/results/frameworks.md). The
negative control runs rf as it was (the gradients left to accumulate in bf16) and sees the
difference in exactly the cases that accumulate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

import raggedfsdp as rf
from chunked_head import Net, chunked_step, data, loss
from harness import run_distributed
from raggedfsdp.runtime._comm import CastReduceScatter, ReduceScatter

WORLD, BATCH, MICRO, CHUNKS = 2, 2, 3, 4
BF16, FP32 = torch.bfloat16, torch.float32
IMPLS: dict[str, Callable[..., Any]] = {"rf": rf.fully_shard, "fsdp2": fsdp2_fully_shard}

#: case -> (param_dtype, reduce_dtype, how the step runs)
CASES = {
    "one_backward": (BF16, FP32, "one"),
    "no_sync": (BF16, FP32, "micro"),
    "no_sync_bf16_reduce": (BF16, None, "micro"),
    "chunked_head": (BF16, FP32, "chunked"),
    # no param_dtype, reduce in fp32: rf's one unit holds an fp32 and a bf16 bucket, and only
    # the bf16 one sums in fp32 (FSDP2 wants one dtype a unit: a unit per layer there)
    "mixed_dtypes": (None, FP32, "micro"),
}
#: the cases whose backwards do not all reduce in a wider dtype: where the control must differ
ACCUMULATE_WIDE = {"no_sync", "chunked_head", "mixed_dtypes"}


class MixedNet(Net):
    """Net with its second block in bf16 (and the hidden state cast for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks[1].to(BF16)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + torch.tanh(self.blocks[0](h))
        return self.norm(h + torch.tanh(self.blocks[1](h.to(BF16))).float())


def _shard(impl: str, model: Net, policy: MixedPrecisionPolicy, mixed: bool) -> None:
    """torchtitan's units (blocks, ``[norm, output]``, root), and its gradient division off
    with sums (the loss is divided by the global token count)."""
    shard = IMPLS[impl]
    units: list[nn.Module | list[nn.Module]] = [*model.blocks, [model.norm, model.output]]
    if mixed and impl == "rf":
        units = [[model.norm, model.output]]  # both blocks in the root: two dtypes in one unit
    for unit in units:
        shard(unit, mp_policy=policy)
    shard(model, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, torch.distributed.fsdp.FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # no PREMUL_SUM on Gloo


def _gradients(rank: int, impl: str, case: str) -> dict[str, torch.Tensor]:
    """The full gradients after one step's backward(s) of ``case``."""
    param_dtype, reduce_dtype, how = CASES[case]
    torch.manual_seed(0)
    model = MixedNet() if case == "mixed_dtypes" else Net()
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    _shard(impl, model, policy, mixed=case == "mixed_dtypes")
    micro = MICRO if how == "micro" else 1
    count = micro * BATCH * WORLD * 8  # the global token count of the step
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    for k, (tokens, labels) in enumerate(data(micro, BATCH * WORLD)):
        if how == "chunked":
            chunked_step(model, tokens[mine], labels[mine], count, CHUNKS)
            continue
        model.set_requires_gradient_sync(k == micro - 1)
        loss(model.output(model(tokens[mine])), labels[mine], count).backward()
    return {name: p.grad.full_tensor() for name, p in model.named_parameters()}


def _cases(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in CASES:
        out[case] = {impl: _gradients(rank, impl, case) for impl in IMPLS}
    # control: rf as it was, every backward's gradients left in the block, summed in bf16
    with mock.patch.object(CastReduceScatter, "accumulate", ReduceScatter.accumulate):
        out["control"] = {case: _gradients(rank, "rf", case) for case in CASES}
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_cases, WORLD)


def _unequal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    assert got.keys() == want.keys()
    assert all(got[name].dtype == want[name].dtype for name in want)
    return [name for name in want if not torch.equal(got[name], want[name])]


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_equal_fsdp2_bit_for_bit(ranks, case):
    for rank in ranks:
        grads = rank[case]
        assert _unequal(grads["rf"], grads["fsdp2"]) == [], case
        assert all(g.abs().sum() > 0 for g in grads["fsdp2"].values())  # every one reached


def test_control_bf16_accumulation_differs_from_fsdp2(ranks):
    """Without the fp32 sum, the cases that accumulate differ from FSDP2 (the accumulated
    parameters: the head's in the chunked loss, every one under no_sync); the others do not."""
    for rank in ranks:
        for case in CASES:
            unequal = _unequal(rank["control"][case], rank[case]["fsdp2"])
            if case not in ACCUMULATE_WIDE:
                assert unequal == [], case
            elif case == "chunked_head":
                assert set(unequal) == {"output.weight", "output.bias"}, unequal
            else:
                assert unequal, case
