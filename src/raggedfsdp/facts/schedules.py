"""Pipeline schedules by name: torch's class, the stages a rank holds, the micro-batches run.

Stated once for the job's options (``--pp-schedule``) and its checks. Pure Python: the names of
torch's classes (``torch.distributed.pipelining.schedules``), no import of them, so a command's
preflight refuses a bad option without loading torch's pipelining.
"""

from __future__ import annotations

__all__ = [
    "NOT_WITH_PP",
    "PP_SCHEDULES",
    "check_schedule",
    "default_microbatches",
    "stage_indices",
    "stages_per_rank",
]

#: ``--pp-schedule``: torch's schedule class and the stages each rank holds (the interleaved
#: ones loop: rank ``r`` holds stages ``r`` and ``r + pp``).
PP_SCHEDULES: dict[str, tuple[str, int]] = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2),
    "zero-bubble": ("ScheduleInterleavedZeroBubble", 2),
}

#: The job's options ``--pp`` does not take yet, and why.
NOT_WITH_PP = {
    "ep": "pipeline stages run beside FSDP and tensor parallelism, not expert parallelism yet",
    "grad_accum": "--pp splits each step into --microbatches; leave --grad-accum at 1",
    "hf_config": "the job cannot cut a vision-language model into pipeline stages yet",
    "error_feedback": "a stage's error-feedback residuals are not checkpointed yet",
}


def stages_per_rank(schedule: str) -> int:
    """Stages each pipeline rank holds under ``schedule``."""
    return PP_SCHEDULES[schedule][1]


def default_microbatches(pp: int, schedule: str) -> int:
    """Micro-batches when none are given: one per stage of the pipeline."""
    return pp * stages_per_rank(schedule)


def stage_indices(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """The stages pipeline rank ``pp_rank`` of ``pp`` holds, in order."""
    return [pp_rank + k * pp for k in range(stages_per_rank(schedule))]


def check_schedule(pp: int, schedule: str, microbatches: int) -> None:
    """``ValueError`` naming the fault unless ``schedule`` runs ``microbatches`` micro-batches
    over ``pp`` ranks, by torch's own rules: 1F1B keeps one micro-batch in flight per stage; the
    interleaved schedules run them in rounds of equal size (``max(1, m // pp)`` rounds)."""
    if schedule == "1f1b" and microbatches < pp:
        raise ValueError(
            f"microbatches: 1f1b over --pp {pp} needs at least {pp} micro-batches (one in "
            f"flight per stage), got {microbatches}"
        )
    rounds = max(1, microbatches // pp)
    if stages_per_rank(schedule) > 1 and microbatches % rounds:
        raise ValueError(
            f"microbatches: {schedule} runs its {microbatches} micro-batches in {rounds} rounds "
            f"of equal size over --pp {pp}; use at most {pp} or a multiple of {pp}"
        )
