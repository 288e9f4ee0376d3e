"""The structure-aware planner: pure Python over shapes, no process group.

Offers :class:`StructAwarePlanner` (each parameter's unit, the plan of a bucket or a model),
the frozen :class:`ShardPlan` it returns, the provable lower bound
(:func:`shard_size_lower_bound`), and the one bucketing that the planner, the ``plan`` command,
``train --dry-run`` and the runtime share (:mod:`raggedfsdp.planner.bucketing`).
:mod:`raggedfsdp.planner.report` (the ``plan`` command's figures) is imported on demand.
"""

from ._placement import shard_size_lower_bound
from ._plan import PlanEntry, ShardPlan
from ._planner import OPTIMIZER_TYPES, OptimizerType, StructAwarePlanner
from .bucketing import (
    Bucket,
    WrapPolicy,
    model_buckets,
    parse_buffer_size,
    post_order,
    split_by_bytes,
    unit_buckets,
    wrap_units,
)

__all__ = [
    "OPTIMIZER_TYPES",
    "Bucket",
    "OptimizerType",
    "PlanEntry",
    "ShardPlan",
    "StructAwarePlanner",
    "WrapPolicy",
    "model_buckets",
    "parse_buffer_size",
    "post_order",
    "shard_size_lower_bound",
    "split_by_bytes",
    "unit_buckets",
    "wrap_units",
]
