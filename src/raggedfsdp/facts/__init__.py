"""Facts that the runtime, the cost model, the models and the job share, each stated once.

The parallel degrees of a run (:class:`ParallelDims`, :mod:`.degrees`), tensor parallelism's split
by module name (:mod:`.tp_plan`), where a tensor- or expert-parallel split may cut a parameter
(:mod:`.cuts`), a VLM's vision side (:mod:`.vision`), the pipeline schedules by name
(:mod:`.schedules`), and what raggedfsdp and FSDP2 do with a
unit's bytes (:mod:`.systems`, which ``tests/distributed/test_facts_conformance.py`` holds against
the runtime). Pure Python over shapes, on ``layout`` and under everything that shares these facts.
"""

from .cuts import check_cut, chunk_cuts, first_cut_inside_block
from .degrees import ParallelDims
from .schedules import (
    NOT_WITH_PP,
    PP_SCHEDULES,
    PPSchedule,
    check_schedule,
    default_microbatches,
    is_looped,
    rounds,
    schedule_class,
    stage_indices,
    stages_per_rank,
)
from .systems import (
    FSDP2,
    RAGGEDFSDP,
    STORAGE_ALIGN,
    SYSTEMS,
    GlooReduceScatter,
    HostCopies,
    Staging,
    Stream,
    System,
    as_system,
    storage_aligned,
)
from .tp_plan import FUSED_EXPERTS, PER_HEAD, TOKEN_EMBEDDING, TP_PLAN, TPStyle, tp_dim, tp_style
from .vision import VISION_MODULES, is_vision

__all__ = [
    "FSDP2",
    "FUSED_EXPERTS",
    "NOT_WITH_PP",
    "PER_HEAD",
    "PP_SCHEDULES",
    "RAGGEDFSDP",
    "STORAGE_ALIGN",
    "SYSTEMS",
    "TOKEN_EMBEDDING",
    "TP_PLAN",
    "VISION_MODULES",
    "GlooReduceScatter",
    "HostCopies",
    "PPSchedule",
    "ParallelDims",
    "Staging",
    "Stream",
    "System",
    "TPStyle",
    "as_system",
    "check_cut",
    "check_schedule",
    "chunk_cuts",
    "default_microbatches",
    "first_cut_inside_block",
    "is_looped",
    "is_vision",
    "rounds",
    "schedule_class",
    "stage_indices",
    "stages_per_rank",
    "storage_aligned",
    "tp_dim",
    "tp_style",
]
