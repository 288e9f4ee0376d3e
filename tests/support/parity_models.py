"""Small models with awkward shapes, and a single-process reference trainer, for parity tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB, DIM, HIDDEN = 37, 24, 40


class Block(nn.Module):
    def __init__(self, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.activation_checkpointing = activation_checkpointing

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.ln(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing:
            return x + checkpoint(self._mlp, x, use_reentrant=False)
        return x + self._mlp(x)


class OddModel(nn.Module):
    """Rows not divisible by W (37, 40), a parameter with fewer rows than ranks (``tiny``), a
    tied embedding/head, a frozen parameter and LayerNorms."""

    def __init__(self, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.tiny = nn.Parameter(torch.randn(1, DIM) * 0.1)
        self.blocks = nn.ModuleList(Block(activation_checkpointing) for _ in range(2))
        self.frozen = nn.Linear(DIM, DIM, bias=False)
        self.frozen.weight.requires_grad_(False)
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.tiny
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(self.frozen(x)))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def make_batches(steps: int, global_batch: int, seq: int = 6, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, VOCAB, (global_batch, seq), generator=g),
            torch.randint(0, VOCAB, (global_batch, seq), generator=g),
        )
        for _ in range(steps)
    ]


def train_reference(model: nn.Module, batches: list, lr: float = 1e-2) -> dict[str, torch.Tensor]:
    """One process on the global batch: the result every world size must reproduce."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for idx, targets in batches:
        opt.zero_grad()
        model(idx, targets).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
