"""The structure-aware planner: pure Python over shapes, no process group.

Offers :class:`StructAwarePlanner` (each parameter's unit, the plan of a bucket or a model), the
frozen :class:`ShardPlan` it returns, the provable lower bound (:func:`shard_size_lower_bound`),
the one bucketing the planner, the ``plan`` command, ``train --dry-run`` and the runtime share, and
each parameter's quantization block. What a plan costs is :mod:`raggedfsdp.capacity`'s.
"""

from ._placement import shard_size_lower_bound
from ._plan import PlanEntry, ShardPlan
from ._planner import OPTIMIZER_TYPES, OptimizerType, StructAwarePlanner
from .bucketing import (
    Bucket,
    LocalPiece,
    WrapPolicy,
    model_buckets,
    parse_buffer_size,
    post_order,
    split_by_bytes,
    unit_buckets,
    wrap_units,
)
from .quant_blocks import MessageLayout, QuantBlock, quant_block
from .subclass_blocks import block_layout, block_numel_of, register_block_numel

__all__ = [
    "OPTIMIZER_TYPES",
    "Bucket",
    "LocalPiece",
    "MessageLayout",
    "OptimizerType",
    "PlanEntry",
    "QuantBlock",
    "ShardPlan",
    "StructAwarePlanner",
    "WrapPolicy",
    "block_layout",
    "block_numel_of",
    "model_buckets",
    "parse_buffer_size",
    "post_order",
    "quant_block",
    "register_block_numel",
    "shard_size_lower_bound",
    "split_by_bytes",
    "unit_buckets",
    "wrap_units",
]
