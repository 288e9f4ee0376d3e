"""What ``--pp``, ``--pp-schedule`` and ``--microbatches`` may go with (docs/pipeline.md)."""

from __future__ import annotations

from typing import Protocol

from ..facts import NOT_WITH_PP, check_schedule

__all__ = ["PipelineOptions", "check_pipeline_options"]


class PipelineOptions(Protocol):
    """The options :func:`check_pipeline_options` reads (a :class:`~.config.TrainConfig`)."""

    pp: int
    pp_schedule: str
    microbatches: int | None
    pipeline_microbatches: int
    ep: int
    grad_accum: int
    vlm: bool
    hf_config: str | None
    error_feedback: bool
    lora_rank: int | None


def check_pipeline_options(cfg: PipelineOptions) -> None:
    """``ValueError`` naming the option: micro-batches below 1, what ``--pp`` does not take, and
    micro-batches its schedule cannot run (the layers: :func:`~.stages.check_pipeline`)."""
    if cfg.microbatches is not None and cfg.microbatches < 1:
        raise ValueError(f"microbatches: must be >= 1, got {cfg.microbatches}")
    if cfg.pp == 1:
        return
    given = {"ep": cfg.ep > 1, "grad_accum": cfg.grad_accum > 1, "hf_config": cfg.vlm}
    given["error_feedback"] = cfg.error_feedback
    for name in (n for n, on in given.items() if on):
        raise ValueError(f"{name}: {getattr(cfg, name)!r} with --pp: {NOT_WITH_PP[name]}")
    if cfg.lora_rank is not None:
        raise ValueError("lora_rank: --lora-rank with --pp is not supported yet")
    check_schedule(cfg.pp, cfg.pp_schedule, cfg.pipeline_microbatches)
