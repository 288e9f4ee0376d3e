"""Pipeline schedules by name: torch's class, the stages a rank holds, the micro-batches run.

Stated once for the job (``train --pp-schedule``) and the cost model (``plan --pp-schedule``).
Pure Python: the names of torch's classes (``torch.distributed.pipelining.schedules``), no import
of them, so a command's preflight refuses a bad option without loading torch's pipelining.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "NOT_WITH_PP",
    "PP_SCHEDULES",
    "PPSchedule",
    "check_schedule",
    "default_microbatches",
    "is_looped",
    "rounds",
    "schedule_class",
    "stage_indices",
    "stages_per_rank",
]

#: A schedule's name, as a type (the job's option and CLI choices): :data:`PP_SCHEDULES`' keys.
PPSchedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"]

#: ``--pp-schedule``: torch's schedule class and the stages each rank holds in the job. The
#: looped ones (torch's ``PipelineScheduleMulti``) take several: rank ``r`` holds stages ``r``,
#: ``r + pp``, ...; the job runs 2, ``plan --stages-per-rank`` costs any.
PP_SCHEDULES: dict[PPSchedule, tuple[str, int]] = {
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


def _known(schedule: str) -> tuple[str, int]:
    if schedule not in PP_SCHEDULES:
        raise ValueError(
            f"unknown pipeline schedule {schedule!r}; known: {', '.join(PP_SCHEDULES)}"
        )
    return PP_SCHEDULES[schedule]


def schedule_class(schedule: str) -> str:
    """The name of torch's class that runs ``schedule``."""
    return _known(schedule)[0]


def stages_per_rank(schedule: str) -> int:
    """Stages each pipeline rank holds under ``schedule`` in the job."""
    return _known(schedule)[1]


def is_looped(schedule: str) -> bool:
    """Whether ``schedule`` takes several stages per rank (torch's ``PipelineScheduleMulti``)."""
    return stages_per_rank(schedule) > 1


def default_microbatches(pp: int, schedule: str) -> int:
    """Micro-batches when none are given: one per stage of the pipeline."""
    return pp * stages_per_rank(schedule)


def stage_indices(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """The stages pipeline rank ``pp_rank`` of ``pp`` holds, in order."""
    return [pp_rank + k * pp for k in range(stages_per_rank(schedule))]


def rounds(pp: int, microbatches: int) -> int:
    """The rounds a looped schedule runs its micro-batches in (torch: ``number_of_rounds``)."""
    return max(1, microbatches // pp)


def check_schedule(
    pp: int, schedule: str, microbatches: int, local_stages: int | None = None
) -> None:
    """``ValueError`` naming the fault unless ``schedule`` runs ``microbatches`` micro-batches
    over ``pp`` ranks (with ``local_stages`` stages each, where given), by torch's own rules:
    1F1B keeps one micro-batch in flight per stage; the looped schedules run them in rounds of
    equal size (``max(1, m // pp)`` rounds); the others hold one stage per rank."""
    looped = is_looped(schedule)
    if local_stages is not None and not looped and local_stages != 1:
        raise ValueError(
            f"stages_per_rank: {schedule} runs one stage per rank, not {local_stages}; use "
            f"{' or '.join(s for s in PP_SCHEDULES if is_looped(s))} for several"
        )
    if schedule == "1f1b" and microbatches < pp:
        raise ValueError(
            f"microbatches: 1f1b over --pp {pp} needs at least {pp} micro-batches (one in "
            f"flight per stage), got {microbatches}"
        )
    count = rounds(pp, microbatches)
    if looped and microbatches % count:
        raise ValueError(
            f"microbatches: {schedule} runs its {microbatches} micro-batches in {count} rounds "
            f"of equal size over --pp {pp}; use at most {pp} or a multiple of {pp}"
        )
