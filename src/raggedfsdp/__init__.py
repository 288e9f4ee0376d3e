"""raggedfsdp: structure-aware fully sharded data parallelism for PyTorch."""

from .layout import RaggedShard, ShardInfo, ShardLayout, layout_of, shard_info
from .planner import PlanEntry, ShardPlan, StructAwarePlanner, shard_size_lower_bound

__all__ = [
    "PlanEntry",
    "RaggedShard",
    "ShardInfo",
    "ShardLayout",
    "ShardPlan",
    "StructAwarePlanner",
    "layout_of",
    "shard_info",
    "shard_size_lower_bound",
]
