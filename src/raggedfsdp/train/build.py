"""What a training run is made of, from its config: the planner, the sharded model, the optimizer,
the learning-rate schedule. Used by the job, by ``--dry-run`` and by the tests."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from .. import optim
from ..layout import RaggedShard, global_shape
from ..models import GPT, GPT_CONFIGS
from ..planner import StructAwarePlanner
from ..runtime import FSDPBackend, MixedPrecisionPolicy
from .config import TrainConfig

__all__ = [
    "BETAS",
    "apply_activation_checkpointing",
    "build_model",
    "build_optimizer",
    "build_planner",
    "lr_factor",
    "mp_policy",
    "optimizer_bytes",
]

#: Betas of every Adam-style update (nanoGPT's choice for small GPTs).
BETAS = (0.9, 0.95)


def build_planner(cfg: TrainConfig) -> StructAwarePlanner:
    """The shard planner: the user's block policy, plus the optimizer's and the compression's
    blocks kept whole."""
    options = (
        {"max_preconditioner_dim": cfg.max_preconditioner_dim} if cfg.optimizer == "shampoo" else {}
    )
    return StructAwarePlanner(
        optimizer_type=cfg.optimizer,
        shard_policy=RaggedShard(block_size=cfg.parsed_block_size()),
        compression=cfg.comm_compression(),
        **options,
    )


def mp_policy(cfg: TrainConfig) -> MixedPrecisionPolicy | None:
    if cfg.mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def apply_activation_checkpointing(model: GPT) -> None:
    """Recompute each block's activations in backward. The block's ``forward`` is replaced on the
    instance (not wrapped in another module), so parameter names - and checkpoints - do not
    change; the FSDP hooks of the block still run around it and unshard before recomputation."""
    from torch.utils.checkpoint import checkpoint

    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def build_model(cfg: TrainConfig, device: torch.device) -> GPT:
    """The same GPT on every rank (seeded by ``cfg.seed``), sharded by raggedfsdp. Needs the
    process group."""
    torch.manual_seed(cfg.seed)
    model = GPT(GPT_CONFIGS[cfg.model], device=device)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    FSDPBackend(model, planner=build_planner(cfg), mp_policy=mp_policy(cfg))
    return model


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer of ``--optimizer``, with weight decay on matrices only. Muon takes the
    blocks' matrices; embeddings and vectors go to its auxiliary AdamW. Every group records its
    peak learning rate as ``initial_lr`` (the schedule scales it)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if len(global_shape(p)) >= 2]
    vectors = [p for n, p in named if len(global_shape(p)) < 2]
    decay = {"params": matrices, "weight_decay": cfg.weight_decay}
    no_decay = {"params": vectors, "weight_decay": 0.0}
    optimizer: torch.optim.Optimizer
    if cfg.optimizer == "adamw":
        optimizer = torch.optim.AdamW([decay, no_decay], lr=cfg.lr, betas=BETAS)
    else:
        if cfg.optimizer == "muon":
            in_blocks = [
                p for n, p in named if n.startswith("blocks.") and len(global_shape(p)) >= 2
            ]
            embeddings = [
                p for n, p in named if not n.startswith("blocks.") and len(global_shape(p)) >= 2
            ]
            optimizer = optim.Muon(
                [
                    {"params": in_blocks},
                    {"params": embeddings, "use_muon": False, "weight_decay": cfg.weight_decay},
                    {"params": vectors, "use_muon": False, "weight_decay": 0.0},
                ],
                lr=cfg.muon_lr,
                weight_decay=cfg.weight_decay,
                adamw_lr=cfg.lr,
                adamw_betas=BETAS,
            )
        elif cfg.optimizer == "shampoo":
            optimizer = optim.Shampoo(
                [decay, no_decay],
                lr=cfg.lr,
                betas=BETAS,
                max_preconditioner_dim=cfg.max_preconditioner_dim,
            )
        else:
            optimizer = optim.AdamW8bit([decay, no_decay], lr=cfg.lr, betas=BETAS)
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"]
    return optimizer


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Learning-rate multiplier of step ``step`` (0-based): linear warm-up, then cosine decay to
    ``min_lr_ratio``. A function of the step alone, so resuming needs no scheduler state."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            values = value if isinstance(value, (list, tuple)) else [value]
            total += sum(v.numel() * v.element_size() for v in values if torch.is_tensor(v))
    return total
