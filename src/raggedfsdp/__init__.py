"""raggedfsdp: structure-aware fully sharded data parallelism for PyTorch."""

from . import optim
from .backend import FSDPBackend, FSDPModule, fully_shard
from .checkpoint import full_state_dict
from .clip import clip_grad_norm_
from .dbuffer import DBufferConfig
from .layout import RaggedShard, ShardInfo, ShardLayout, layout_of, shard_info
from .materialize import init_sharded_
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
    "clip_grad_norm_",
    "full_state_dict",
    "fully_shard",
    "init_sharded_",
    "layout_of",
    "optim",
    "shard_info",
    "shard_size_lower_bound",
]
