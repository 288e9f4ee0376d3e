"""torchtitan's chunked loss (``ChunkedLossWrapper``, its llama3 default): the model's forward
stops before the output head, which is sharded in one unit with the final norm
(``fully_shard([norm, output])``); the loss then calls the head alone once per chunk of the
hidden states, with a backward after each (gradient sync off but for the last), and finally
back-propagates the gathered hidden-state gradient through the model. rf and FSDP2 in one
launch (2 Gloo ranks), against one process on the global batch."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

import raggedfsdp as rf
from harness import run_distributed

WORLD, BATCH, CHUNKS = 2, 2, 4
IMPLS = {"rf": rf.fully_shard, "fsdp2": fsdp2_fully_shard}


class Net(nn.Module):
    def __init__(self, dim: int = 8, vocab: int = 11) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.norm(h)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # the head skipped, as torchtitan's
        return self.hidden(tokens)


def _loss(logits: torch.Tensor, labels: torch.Tensor, count: int) -> torch.Tensor:
    return (
        nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / count
    )


def _chunked_step(model: Net, tokens: torch.Tensor, labels: torch.Tensor, count: int) -> None:
    """ChunkedLossWrapper's steps, on a sharded model."""
    hidden = model(tokens)
    head = model.output
    chunks = [c.detach().requires_grad_() for c in hidden.chunk(CHUNKS, dim=1)]
    head.set_reshard_after_forward(False)
    head.set_reshard_after_backward(False)
    head.set_requires_gradient_sync(False, recurse=False)
    head.unshard()
    grads = []
    for i, (chunk, label) in enumerate(zip(chunks, labels.chunk(CHUNKS, dim=1), strict=True)):
        if i == CHUNKS - 1:
            head.set_requires_gradient_sync(True, recurse=False)
        _loss(head(chunk), label, count).backward()
        grads.append(chunk.grad)
    head.set_reshard_after_forward(True)
    head.set_reshard_after_backward(True)
    head.reshard()
    hidden.backward(torch.cat(grads, dim=1))


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [
        (torch.randint(0, 11, (BATCH * WORLD, 8), generator=g),
         torch.randint(0, 11, (BATCH * WORLD, 8), generator=g))
        for _ in range(steps)
    ]  # fmt: skip


def _cases(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    base = Net()
    count = BATCH * WORLD * 8  # the global token count divides every rank's sum
    reference = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for tokens, labels in _data(2):
        (_loss(reference.output(reference.hidden(tokens)), labels, count) * 1.0).backward()
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
        for tokens, labels in _data(2):
            _chunked_step(model, tokens[mine], labels[mine], count)
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
