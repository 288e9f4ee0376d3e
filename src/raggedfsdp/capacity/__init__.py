"""The cost model: what a plan costs each rank in memory, bytes and time per step, for
raggedfsdp and for FSDP2 on the same shapes, against a device preset. Pure Python over shapes
(models on the meta device), no process group.

The modules, bottom up: ``parallel`` (what each rank holds under tensor and expert
parallelism), ``shapes`` (what a model computes and keeps per token), ``hardware`` (device
presets), ``wire`` (what compressed communication moves), ``cost`` (bytes per
rank), ``steptime`` (time per step), ``parallel_comm`` (what tensor and expert parallelism
send), ``capacity`` (all of it at each world size: will it fit, and how fast; which ``(dp, tp,
ep)`` fits). ``report`` (the ``plan`` command's padding figures beside FSDP2 and FSDP1) is
imported on demand, so the training worker, which costs its own plan before it
starts, never loads it. What each system costed does differently (:class:`System`,
:data:`RAGGEDFSDP`, :data:`FSDP2`) and the degrees (:class:`ParallelDims`) are facts the
runtime shares: :mod:`raggedfsdp.facts`, re-exported here.
"""

from ..facts import ParallelDims
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
from .cost import MemoryBreakdown, StepShape, UnitBytes, memory_breakdown, unit_bytes
from .hardware import HARDWARE, Hardware, hardware
from .parallel import ModelSplit, UnsplittableModel, split_model
from .parallel_comm import ParallelBytes, parallel_bytes
from .shapes import ModelShape, model_shape
from .steptime import CollectiveBytes, StepTime, collective_bytes, step_time
from .wire import CODE_DTYPES, CompressionSpec

__all__ = [
    "CODE_DTYPES",
    "DEFAULT_RESERVE",
    "FSDP2",
    "HARDWARE",
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
    "search_mesh",
    "split_model",
    "step_time",
    "unit_bytes",
]
