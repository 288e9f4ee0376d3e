"""Pieces the zoo's models share: the planning-only base and Hugging Face's layer parts."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["HFMLP", "HFDecoder", "MetaLinear", "PlanningOnly"]


class PlanningOnly(nn.Module):
    """Base for shape-only models: a forward that explains itself instead of failing obscurely."""

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise NotImplementedError(
            f"{type(self).__name__} is a shape-only model for sharding plans; it has no forward"
        )


class MetaLinear(nn.Linear):
    """``nn.Linear`` that skips its initialisation on the meta device (there is nothing to
    initialise there, and tens of thousands of experts would spend seconds doing it)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class HFMLP(nn.Module):
    """Hugging Face SwiGLU projections: ``down_proj(silu(gate_proj x) * up_proj x)``."""

    def __init__(self, hidden: int, inner: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = MetaLinear(hidden, inner, bias=bias)
        self.up_proj = MetaLinear(hidden, inner, bias=bias)
        self.down_proj = MetaLinear(inner, hidden, bias=bias)


class HFDecoder(nn.Module):
    """The ``model.`` part of a Hugging Face causal LM: embeddings, layers, final norm."""

    def __init__(self, vocab: int, hidden: int, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(layers)
        self.norm = nn.RMSNorm(hidden)
