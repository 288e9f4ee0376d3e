"""The FSDP runtime: sharded modules whose parameters and gradients are views of one flat
buffer per bucket, so the all-gather and the reduce-scatter run in place.

Offers ``fully_shard`` / ``FSDPBackend`` and the :class:`FSDPModule` methods sharded modules
get; their configuration (:class:`DBufferConfig`, :class:`MixedPrecisionPolicy`); the counters
(:class:`RuntimeStats`); and, for the checkpoint layer, :func:`full_parameters` and
:func:`to_sharded_tensor` (DCP's container of a ragged shard, with :func:`local_flat`,
:func:`gather_full` and :func:`is_ragged`). Everything else is private:
buffers (``_dbuffer``), scratch pool (``_pool``), collectives (``_collectives``), one
parameter's record (``_param``), a unit's group (``_param_group``), reductions in flight
(``_reduce``), hooks (``_state``), state machines (``_states``) and state dicts
(``_state_dict``).
"""

from ._metrics import RuntimeStats
from ._state_dict import gather_full, is_ragged, local_flat, to_sharded_tensor
from .api import DBufferConfig, MixedPrecisionPolicy
from .fully_shard import (
    FSDPBackend,
    FSDPModule,
    UnshardHandle,
    full_parameters,
    fully_shard,
    register_fsdp_forward_method,
)

__all__ = [
    "DBufferConfig",
    "FSDPBackend",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "RuntimeStats",
    "UnshardHandle",
    "full_parameters",
    "fully_shard",
    "gather_full",
    "is_ragged",
    "local_flat",
    "register_fsdp_forward_method",
    "to_sharded_tensor",
]
