"""raggedfsdp: structure-aware fully sharded data parallelism for PyTorch."""

from .backend import FSDPBackend, FSDPModule, fully_shard
from .checkpoint import full_state_dict
from .dbuffer import DBufferConfig
from .layout import RaggedShard, ShardInfo, ShardLayout, layout_of, shard_info
from .param_group import MixedPrecisionPolicy
from .planner import PlanEntry, ShardPlan, StructAwarePlanner, shard_size_lower_bound

__all__ = [
    "DBufferConfig",
    "FSDPBackend",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "PlanEntry",
    "RaggedShard",
    "ShardInfo",
    "ShardLayout",
    "ShardPlan",
    "StructAwarePlanner",
    "full_state_dict",
    "fully_shard",
    "layout_of",
    "shard_info",
    "shard_size_lower_bound",
]
