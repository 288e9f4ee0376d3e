"""raggedfsdp: structure-aware fully sharded data parallelism for PyTorch.

The layers, each a room of its own (imports flow down this list only):

- ``layout``      RaggedShard policies, ShardLayout, the ShardInfo a sharded parameter carries
- ``planner``     StructAwarePlanner, ShardPlan, the one bucketing (pure Python, no group)
- ``runtime``     fully_shard / FSDPBackend, DBuffer, collectives, hooks; beside it, never
  importing it nor imported by it, ``capacity``: the cost model (memory, bytes and time per
  step of a plan, raggedfsdp beside FSDP2; pure Python, no group)
- ``checkpoint``  full state dicts, optimizer state for DCP; ``optim``, ``clip``, ``materialize``
- ``integration`` what raggedfsdp changes in torch, installed by its ``install()``
- ``train``, ``bench``  the job (the torchrun worker and its launch), the benchmark
- ``cli``         the ``raggedfsdp`` commands, each ``configure(parser)`` and ``run(args)``

Importing the package calls :func:`raggedfsdp.integration.install` once (idempotent): torch's
``register_fsdp_forward_method``, ``distribute_tensor`` and
``torch.distributed.checkpoint.state_dict`` then handle raggedfsdp's sharded modules, and its
RaggedTensor joins torch's foreach-supported types. It is the only change to torch made at
import.
"""

# First, before torch loads (seconds): a worker of ``raggedfsdp train`` dies with its launcher
# from here on, not only once it reaches train() (_lifeline.py).
from ._lifeline import hold_from_env as _hold_from_env

_hold_from_env()

from . import integration, optim
from .checkpoint import full_state_dict, load_optim_state_dict, optim_state_dict
from .clip import clip_grad_norm_
from .layout import (
    RaggedShard,
    RaggedShardPlacement,
    ShardInfo,
    ShardLayout,
    layout_of,
    mark_sharded,
    shard_info,
)
from .materialize import init_sharded_
from .planner import PlanEntry, ShardPlan, StructAwarePlanner, shard_size_lower_bound
from .runtime import (
    CommCompression,
    DataParallelMeshDims,
    DBufferConfig,
    FSDPBackend,
    FSDPModule,
    MixedPrecisionPolicy,
    RaggedTensor,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
)

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
    "layout_of",
    "load_optim_state_dict",
    "mark_sharded",
    "optim",
    "optim_state_dict",
    "register_fsdp_forward_method",
    "shard_info",
    "shard_size_lower_bound",
]

integration.install()
