"""What ``--lora-rank``, ``--base-weights`` and ``--nf4-block-size`` may go with (docs/lora.md)."""

from __future__ import annotations

from typing import Protocol

__all__ = ["LoRAOptions", "check_lora_options"]


class LoRAOptions(Protocol):
    """The options :func:`check_lora_options` reads (a :class:`~.config.TrainConfig`)."""

    lora_rank: int | None
    base_weights: str | None
    nf4_block_size: int
    optimizer: str
    tp: int
    ep: int
    compile: bool


def check_lora_options(cfg: LoRAOptions, *, compressed: bool) -> None:
    """``ValueError`` naming the option: ``--lora-rank`` below 1, ``--base-weights`` without
    it, an odd ``--nf4-block-size`` or one without NF4, and what the adapters or the NF4 base
    cannot go beside (``compressed``: a ``--compress-*`` option is on). The block against the
    model's linears: :func:`raggedfsdp.models.lora.apply_lora`, when the model is built (the
    launcher's meta model, before any worker starts)."""
    rank = cfg.lora_rank
    if rank is not None and (isinstance(rank, bool) or rank < 1):
        raise ValueError(f"lora_rank: must be an integer >= 1, got {rank!r}")
    if cfg.base_weights is not None and rank is None:
        raise ValueError(
            f"base_weights: --base-weights {cfg.base_weights} is the frozen base of LoRA "
            f"adapters; give --lora-rank R too"
        )
    if cfg.nf4_block_size != 64 and cfg.base_weights != "nf4":
        raise ValueError("nf4_block_size: only with --base-weights nf4")
    if cfg.nf4_block_size < 2 or cfg.nf4_block_size % 2:
        raise ValueError(
            f"nf4_block_size: must be even and >= 2 (two codes a byte), got {cfg.nf4_block_size}"
        )
    if rank is None:
        return
    if cfg.optimizer != "adamw":
        raise ValueError(f"optimizer: --lora-rank trains with adamw, not {cfg.optimizer}")
    if cfg.tp > 1 or cfg.ep > 1:
        raise ValueError(
            "lora_rank: --lora-rank with --tp / --ep is not supported; the adapters train "
            "beside FSDP alone"
        )
    if cfg.base_weights == "nf4":
        if cfg.compile:
            raise ValueError("compile: --compile with --base-weights nf4 is not supported")
        if compressed:
            raise ValueError(
                "compress_all_gather: --compress-* with --base-weights nf4: the NF4 base "
                "travels as its own codes already; drop the compression"
            )
