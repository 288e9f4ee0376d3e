"""raggedfsdp: structure-aware fully sharded data parallelism for PyTorch.

The layers, each a room of its own (imports flow down this list only):

- ``layout``      RaggedShard policies, ShardLayout (pure Python, no group)
- ``planner``     StructAwarePlanner, ShardPlan, the one bucketing (pure Python, no group); beside
  it, never importing it nor imported by it, ``tensor``: the sharded tensor (RaggedTensor, its
  RaggedShardPlacement and ShardInfo, its ops and the readers of it)
- ``runtime``     fully_shard / FSDPBackend, DBuffer, collectives, hooks; beside it, never
  importing it nor imported by it, ``capacity``: the cost model (memory, bytes and time per
  step of a plan, raggedfsdp beside FSDP2; pure Python, no group)
- ``checkpoint``  full state dicts, optimizer state for DCP; ``optim``, ``clip``, ``materialize``
- ``integration`` the list of what raggedfsdp changes in torch; its ``install()`` makes them now
- ``train``, ``bench``  the job (the torchrun worker and its launch), the benchmark
- ``cli``         the ``raggedfsdp`` commands, each ``configure(parser)`` and ``run(args)``

Importing the package changes nothing in torch. The first ``fully_shard``, ragged placement or
RaggedTensor adapts torch once (idempotent): torch's ``register_fsdp_forward_method``,
``distribute_tensor`` and ``torch.distributed.checkpoint.state_dict`` then handle raggedfsdp's
sharded modules, and RaggedTensor joins torch's foreach-supported types
(:mod:`raggedfsdp.integration` lists them; its ``install()`` makes them at once).
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
from .planner import PlanEntry, ShardPlan, StructAwarePlanner, shard_size_lower_bound
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
    "register_fsdp_forward_method",
    "shard_info",
    "shard_size_lower_bound",
]
