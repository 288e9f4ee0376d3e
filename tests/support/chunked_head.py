"""torchtitan's chunked loss (``ChunkedLossWrapper``, its llama3 default) on a small model: the
model's forward stops before the output head, which is sharded in one unit with the final norm
(``fully_shard([norm, output])``); the loss calls the head alone once per chunk of the hidden
states, with a backward after each (gradient sync off but for the last), then back-propagates
the gathered hidden-state gradient through the model. Shared by the tests that run it on rf and
FSDP2 (tests/distributed/test_chunked_head.py, test_mixed_precision_fsdp2.py)."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 11


class Net(nn.Module):
    def __init__(self, dim: int = 8, vocab: int = VOCAB) -> None:
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


def loss(logits: torch.Tensor, labels: torch.Tensor, count: int) -> torch.Tensor:
    """Cross entropy summed in fp32, divided by the global token count (torchtitan's)."""
    return (
        nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        / count
    )


def chunked_step(
    model: Net, tokens: torch.Tensor, labels: torch.Tensor, count: int, chunks: int
) -> None:
    """ChunkedLossWrapper's steps, on a sharded model: ``chunks`` backwards of the head alone
    (the last one syncing gradients), then the model's backward."""
    hidden = model(tokens)
    head = model.output
    pieces = [c.detach().requires_grad_() for c in hidden.chunk(chunks, dim=1)]
    head.set_reshard_after_forward(False)
    head.set_reshard_after_backward(False)
    head.set_requires_gradient_sync(False, recurse=False)
    head.unshard()
    grads = []
    for i, (piece, label) in enumerate(zip(pieces, labels.chunk(chunks, dim=1), strict=True)):
        if i == chunks - 1:
            head.set_requires_gradient_sync(True, recurse=False)
        loss(head(piece), label, count).backward()
        grads.append(piece.grad)
    head.set_reshard_after_forward(True)
    head.set_reshard_after_backward(True)
    head.reshard()
    hidden.backward(torch.cat(grads, dim=1).to(hidden.dtype))


def data(steps: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of ``rows`` sequences of 8 tokens, and their labels."""
    g = torch.Generator().manual_seed(5)
    return [
        (torch.randint(0, VOCAB, (rows, 8), generator=g),
         torch.randint(0, VOCAB, (rows, 8), generator=g))
        for _ in range(steps)
    ]  # fmt: skip
