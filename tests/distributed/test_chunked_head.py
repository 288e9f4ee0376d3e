"""torchtitan's chunked loss (``ChunkedLossWrapper``, its llama3 default; the steps in
tests/support/chunked_head.py): rf and FSDP2 in one launch (2 Gloo ranks), against one process
on the global batch."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

import raggedfsdp as rf
from chunked_head import Net, chunked_step, data, loss
from harness import run_distributed

WORLD, BATCH, CHUNKS = 2, 2, 4
IMPLS = {"rf": rf.fully_shard, "fsdp2": fsdp2_fully_shard}


def _cases(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    base = Net()
    count = BATCH * WORLD * 8  # the global token count divides every rank's sum
    reference = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for tokens, labels in data(2, BATCH * WORLD):
        (loss(reference.output(reference.hidden(tokens)), labels, count) * 1.0).backward()
        optimizer.step()
        optimizer.zero_grad()
    out: dict[str, Any] = {"reference": reference.state_dict(), "initial": base.state_dict()}
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    for impl, shard in IMPLS.items():
        model = copy.deepcopy(base)
        for block in model.blocks:
            shard(block)
        shard([model.norm, model.output])
        shard(model)
        for module in model.modules():  # torchtitan's: the loss is already divided globally
            if isinstance(module, torch.distributed.fsdp.FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # no PREMUL_SUM on Gloo
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for tokens, labels in data(2, BATCH * WORLD):
            chunked_step(model, tokens[mine], labels[mine], count, CHUNKS)
            optimizer.step()
            optimizer.zero_grad()
        full = StateDictOptions(full_state_dict=True)
        out[impl] = get_model_state_dict(model, options=full)
    return out


def test_the_head_called_alone_per_chunk_trains_as_one_process():
    for rank in run_distributed(_cases, WORLD):
        for impl in IMPLS:
            assert rank[impl].keys() == rank["reference"].keys()
            for key, value in rank["reference"].items():
                torch.testing.assert_close(
                    rank[impl][key], value, rtol=1e-5, atol=1e-6, msg=(impl, key)
                )
        # control: every parameter, the head's included, moved from its initial value
        for key, value in rank["initial"].items():
            assert not torch.allclose(rank["reference"][key], value), key
