"""A small nanoGPT-style decoder-only transformer.

Deliberately plain (pre-LayerNorm blocks, learned positions, causal
``scaled_dot_product_attention``, GELU MLP, no biases in Linear layers) so that sharding tests and
benchmarks exercise the FSDP machinery rather than exotic layers. Its initialisation is a contract a
shard-by-shard materialisation relies on: the comment at :func:`init_parameter_`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPT",
    "GPT_CONFIGS",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "GPTConfig",
    "init_parameter_",
]

INIT_STD = 0.02
"""Standard deviation of the normal init for Linear and Embedding weights (GPT-2's value)."""


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT` model.

    Attributes:
        vocab_size: number of token ids (256 for byte-level text).
        seq_len: maximum sequence length (size of the learned position table).
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide ``d_model``.
        d_model: residual stream width.
        mlp_ratio: MLP hidden width as a multiple of ``d_model``.
        tie_embeddings: share the token embedding with the output head.
    """

    vocab_size: int
    seq_len: int
    n_layer: int
    n_head: int
    d_model: int
    mlp_ratio: int = 4
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for field in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
            value = getattr(self, field)
            # bool is an int subclass; True as a layer count is almost surely a mistake.
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{field} must be a positive int, got {value!r}")
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} is not divisible by n_head={self.n_head}"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_head


GPT_CONFIGS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=2, d_model=64),
    "gpt-small": GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128),
    "gpt-medium": GPTConfig(vocab_size=256, seq_len=256, n_layer=6, n_head=6, d_model=384),
    # The benchmark reference model (docs/design.md, "Benchmark protocol").
    "gpt-ref": GPTConfig(vocab_size=8192, seq_len=256, n_layer=8, n_head=8, d_model=512),
}
"""Named GPT shapes used by tests, examples and the benchmark."""


# Parameter names GPT produces, optionally under a prefix (e.g. when wrapped in another module).
# Residual projections get GPT-2's depth-scaled std so the residual stream's variance does not
# grow with depth.
_RESIDUAL_RE = re.compile(r"(?:^|\.)blocks\.\d+\.(?:attn|mlp)\.proj\.weight$")
_NORMAL_RE = re.compile(
    r"(?:^|\.)(?:tok_emb\.weight|pos_emb\.weight|head\.weight"
    r"|blocks\.\d+\.attn\.[qkv]_proj\.weight|blocks\.\d+\.mlp\.fc\.weight)$"
)
_NORM_RE = re.compile(r"(?:^|\.)(?:ln_f|blocks\.\d+\.ln[12])\.(?P<kind>weight|bias)$")


# Initialisation contract:
#
# :meth:`GPT.init_weights` is *defined* as::
#
#     for name, param in model.named_parameters():
#         init_parameter_(name, param, model.cfg, generator=generator)
#
# so anybody who visits the same names, in the same order, with full-shaped tensors on the same
# device type and the same generator state, gets bit-identical values. This is what lets a
# meta-device model be materialised one parameter (or one shard) at a time: create the full tensor
# for the next name, call :func:`init_parameter_`, keep the local slice, drop the rest. Draws from
# the generator between two calls (or skipped names) shift every later value. With
# ``tie_embeddings`` the head weight *is* ``tok_emb.weight``; ``named_parameters()`` reports it
# once, under ``tok_emb.weight``, so ``head.weight`` is never visited.
#
# ``GPT(cfg)`` builds on the meta device, moves to the target device and then calls
# ``init_weights()``, so ``torch.manual_seed(s); GPT(cfg)`` draws exactly the same numbers as
# ``torch.manual_seed(s)`` followed by a shard-by-shard materialisation of ``GPT(cfg,
# device="meta")``.
@torch.no_grad()
def init_parameter_(
    name: str,
    tensor: torch.Tensor,
    cfg: GPTConfig,
    *,
    generator: torch.Generator | None = None,
) -> None:
    """Initialise one named GPT parameter in place, exactly as :meth:`GPT.init_weights` does.

    Args:
        name: the parameter's name as given by ``GPT.named_parameters()`` (a dotted prefix, as
            from an enclosing module, is allowed).
        tensor: the full-shaped tensor to fill (not a shard: the number of random draws depends
            on the shape).
        cfg: the model's config (the residual std depends on ``n_layer``).
        generator: random source; torch's default generator for the tensor's device when None.

    Rules: Linear and Embedding weights ~ N(0, 0.02); the attention and MLP output projections
    ~ N(0, 0.02 / sqrt(2 * n_layer)); LayerNorm weights = 1, biases = 0 (these draw nothing).

    Raises:
        ValueError: ``name`` is not a GPT parameter name.
    """
    if _RESIDUAL_RE.search(name):
        tensor.normal_(0.0, INIT_STD / math.sqrt(2 * cfg.n_layer), generator=generator)
    elif _NORMAL_RE.search(name):
        tensor.normal_(0.0, INIT_STD, generator=generator)
    elif match := _NORM_RE.search(name):
        if match.group("kind") == "weight":
            tensor.fill_(1.0)
        else:
            tensor.zero_()
    else:
        raise ValueError(f"init_parameter_: {name!r} is not a GPT parameter name")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention. Queries, keys and values have projections of their own
    (not one fused ``qkv``): tensor parallelism splits each by whole heads (``ColwiseParallel``
    gives a rank a contiguous run of rows, which in a fused matrix would mix queries with keys),
    and Muon orthogonalises each as the matrix it is. ``forward`` reads the head count from the
    width it gets, so a rank holding ``n_head / tp`` heads runs the same code."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # [B, T, C] -> [B, H, T, C/H], the layout scaled_dot_product_attention expects.
        q, k, v = (
            p(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """Two-layer GELU feed-forward network."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _meta_embedding(num: int, dim: int) -> nn.Embedding:
    """An embedding on meta without torch's init: ``normal_`` on meta runs a Python decomposition
    that loads ``torch._dynamo`` (0.4 s a process, every launch's three)."""
    return nn.Embedding.from_pretrained(torch.empty(num, dim, device="meta"), freeze=False)


class GPT(nn.Module):
    """nanoGPT-style decoder: token + learned position embeddings, blocks, LayerNorm, head.

    Args:
        cfg: the model shape.
        device: where to build the parameters. ``"meta"`` allocates nothing and skips
            initialisation (materialise with ``to_empty`` + :meth:`tie_weights` +
            :meth:`init_weights`, or shard by shard with :func:`init_parameter_`).
    """

    def __init__(self, cfg: GPTConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        target = torch.device(device) if device is not None else torch.device("cpu")
        # Build on meta first: torch's default per-layer inits would burn time and RNG draws that
        # init_weights overwrites anyway, and skipping them keeps the constructor's RNG use equal
        # to init_weights' alone (see the module docstring).
        with torch.device("meta"):
            self.tok_emb = _meta_embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = _meta_embedding(cfg.seq_len, cfg.d_model)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tie_weights()
        if target.type != "meta":
            self.to_empty(device=target)
            # to_empty replaces each module's parameter separately, which unties them.
            self.tie_weights()
            self.init_weights()

    def tie_weights(self) -> None:
        """Make ``head.weight`` the same Parameter as ``tok_emb.weight`` (if the config ties)."""
        if self.cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def init_weights(self, *, generator: torch.Generator | None = None) -> None:
        """(Re)initialise every parameter: :func:`init_parameter_` over ``named_parameters()``.

        Deterministic given the generator state (torch's default generator when None).
        """
        for name, param in self.named_parameters():
            init_parameter_(name, param, self.cfg, generator=generator)

    def block_list(self) -> list[nn.Module]:
        """The blocks in model order: all of them, or a pipeline stage's share (its ``blocks``
        then an ``nn.ModuleDict`` keyed by their indices, so their names stay the whole
        model's: :mod:`raggedfsdp.train.stages`)."""
        blocks = self.blocks
        return list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)

    def num_params(self) -> int:
        """Number of distinct parameter elements (a tied weight counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Run the model.

        Args:
            idx: token ids, int64 ``[B, T]`` with ``T <= cfg.seq_len`` (a pipeline stage
                after the first: the residual stream ``[B, T, d_model]``).
            targets: next-token ids ``[B, T]``, or None.

        Returns:
            logits ``[B, T, vocab_size]`` when ``targets`` is None, else the mean cross-entropy
            loss over all ``B * T`` positions (a scalar).
        """
        seq = idx.shape[1]
        if seq > self.cfg.seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds the model's seq_len={self.cfg.seq_len}"
            )
        # A pipeline stage lacks what another stage holds (None): the first takes token ids,
        # the others the residual stream; all but the last return it.
        if self.tok_emb is not None:
            pos = torch.arange(seq, device=idx.device)
            x = self.tok_emb(idx) + self.pos_emb(pos)
        else:
            x = idx
        for block in self.block_list():
            x = block(x)
        if self.head is None:
            return x
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
