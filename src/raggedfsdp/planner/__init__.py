"""The structure-aware planner: pure Python over shapes, no process group.

Offers :class:`StructAwarePlanner` (each parameter's unit, the plan of a bucket or a model),
the frozen :class:`ShardPlan` it returns, the provable lower bound
(:func:`shard_size_lower_bound`), and the one bucketing that the planner, the ``plan`` command,
``train --dry-run`` and the runtime share (:mod:`raggedfsdp.planner.bucketing`).
:mod:`raggedfsdp.planner.report` (the ``plan`` command's figures) is imported on demand.
"""

from ._plan import PlanEntry, ShardPlan
from ._planner import OPTIMIZER_TYPES, OptimizerType, StructAwarePlanner
from ._search import shard_size_lower_bound
from .bucketing import bucket_params, default_wrap_units, parse_buffer_size, split_by_bytes

__all__ = [
    "OPTIMIZER_TYPES",
    "OptimizerType",
    "PlanEntry",
    "ShardPlan",
    "StructAwarePlanner",
    "bucket_params",
    "default_wrap_units",
    "parse_buffer_size",
    "shard_size_lower_bound",
    "split_by_bytes",
]
