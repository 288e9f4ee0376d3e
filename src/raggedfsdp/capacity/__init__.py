"""The cost model: what a plan costs each rank in memory, bytes and time per step.

For raggedfsdp and for FSDP2 on the same shapes, against a device preset; pure Python over shapes
(models on the meta device), no process group. ``report`` (the ``plan`` command's padding figures)
is imported on demand, so the training worker, which costs its own plan before it starts, never
loads it. What each system costed does differently (:class:`System`, :data:`RAGGEDFSDP`,
:data:`FSDP2`), the degrees (:class:`ParallelDims`) and the pipeline schedules
(:data:`PP_SCHEDULES`) are :mod:`raggedfsdp.facts`', re-exported.
"""

from ..facts import PP_SCHEDULES, ParallelDims
from ..facts.systems import FSDP2, RAGGEDFSDP, SYSTEMS, System
from .capacity import (
    DEFAULT_RESERVE,
    CapacityOptions,
    CapacityReport,
    MeshFit,
    MeshSearch,
    SystemCost,
    UnshardableWorld,
    WorldCapacity,
    capacity_report,
    plan_capacity,
    search_mesh,
)
from .cost import MemoryBreakdown, memory_breakdown
from .hardware import HARDWARE, Hardware, hardware
from .parallel import ModelSplit, UnsplittableModel, split_model
from .parallel_comm import ParallelBytes, parallel_bytes
from .pipeline import PipelinePlan, PipelineSearch, plan_pipeline, search_pipeline
from .schedules import PipelineSchedule
from .shapes import ModelShape, model_shape
from .stages import stage_layers
from .step_shape import StepShape
from .steptime import CollectiveBytes, StepTime, collective_bytes, step_time
from .units import UnitBytes, unit_bytes
from .wire import CODE_DTYPES, CompressionSpec

__all__ = [
    "CODE_DTYPES",
    "DEFAULT_RESERVE",
    "FSDP2",
    "HARDWARE",
    "PP_SCHEDULES",
    "RAGGEDFSDP",
    "SYSTEMS",
    "CapacityOptions",
    "CapacityReport",
    "CollectiveBytes",
    "CompressionSpec",
    "Hardware",
    "MemoryBreakdown",
    "MeshFit",
    "MeshSearch",
    "ModelShape",
    "ModelSplit",
    "ParallelBytes",
    "ParallelDims",
    "PipelinePlan",
    "PipelineSchedule",
    "PipelineSearch",
    "StepShape",
    "StepTime",
    "System",
    "SystemCost",
    "UnitBytes",
    "UnshardableWorld",
    "UnsplittableModel",
    "WorldCapacity",
    "capacity_report",
    "collective_bytes",
    "hardware",
    "memory_breakdown",
    "model_shape",
    "parallel_bytes",
    "plan_capacity",
    "plan_pipeline",
    "search_mesh",
    "search_pipeline",
    "split_model",
    "stage_layers",
    "step_time",
    "unit_bytes",
]
