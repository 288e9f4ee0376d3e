"""raggedfsdp: structure-aware fully sharded data parallelism for PyTorch.

The rooms (``layout``, ``planner`` beside ``tensor``, ``runtime`` beside ``capacity``,
``checkpoint``, ``optim``, ``clip``, ``materialize``, ``integration``, ``train``, ``bench``,
``cli``) import down that list only (README.md, "Layout"). Importing the package changes nothing in
torch: the first ``fully_shard``, ragged placement or RaggedTensor adapts torch once
(:mod:`raggedfsdp.integration` lists what changes; its ``install()`` makes them at once).
"""

# First, before torch loads (seconds): a worker of ``raggedfsdp train`` dies with its launcher
# from here on, not only once it reaches train() (_lifeline.py).
from ._lifeline import hold_from_env as _hold_from_env

_hold_from_env()

from . import integration, optim
from .checkpoint import full_state_dict, load_optim_state_dict, optim_state_dict
from .clip import clip_grad_norm_
from .layout import RaggedShard, ShardLayout
from .materialize import init_sharded_
from .planner import (
    PlanEntry,
    ShardPlan,
    StructAwarePlanner,
    register_block_numel,
    shard_size_lower_bound,
)
from .runtime import (
    CommCompression,
    DataParallelMeshDims,
    DBufferConfig,
    FSDPBackend,
    FSDPModule,
    MixedPrecisionPolicy,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
)
from .tensor import RaggedShardPlacement, RaggedTensor, ShardInfo, layout_of, shard_info

__all__ = [
    "CommCompression",
    "DBufferConfig",
    "DataParallelMeshDims",
    "FSDPBackend",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "PlanEntry",
    "RaggedShard",
    "RaggedShardPlacement",
    "RaggedTensor",
    "ShardInfo",
    "ShardLayout",
    "ShardPlan",
    "StructAwarePlanner",
    "UnshardHandle",
    "clip_grad_norm_",
    "full_state_dict",
    "fully_shard",
    "init_sharded_",
    "integration",
    "layout_of",
    "load_optim_state_dict",
    "optim",
    "optim_state_dict",
    "register_block_numel",
    "register_fsdp_forward_method",
    "shard_info",
    "shard_size_lower_bound",
]
