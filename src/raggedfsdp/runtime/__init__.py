"""The FSDP runtime: sharded modules whose parameters and gradients are views of one flat buffer
per bucket, so the all-gather and the reduce-scatter run in place.

Offers ``fully_shard`` / ``FSDPBackend`` and the :class:`FSDPModule` methods sharded modules
get; their configuration (:class:`DBufferConfig`, :class:`MixedPrecisionPolicy`,
:class:`CommCompression`, :class:`DataParallelMeshDims` for the full-SPMD-mesh form); the
counters (:class:`RuntimeStats`) and the host synchronisations (:class:`HostSyncCounter`);
:func:`adapt_torch`, torch's ``register_fsdp_forward_method`` routed to raggedfsdp's (run by the
first ``fully_shard``, with the sharded tensor's adaptations, ``_torch_fsdp``); for the
checkpoint layer, :func:`full_parameters` and :func:`error_feedback_state` /
:func:`load_error_feedback_state` (the residuals of compressed reduce-scatters, per rank).
Everything else is private: buffers (``_dbuffer``), scratch pool (``_pool``), each bucket's
all-gather and reduce-scatter strategies (``_comm``; the quantized pair in ``compression/``),
collectives (``_collectives``) and how their bytes travel (``_transport``), one parameter's
record (``_param``), the full-SPMD-mesh form (``_spmd``), a unit's group (``_param_group``),
reductions in flight (``_reduce``), hooks (``_hooks``), state machines (``_state_machine``) and
state dicts (``_state_dict``).
"""

from ._metrics import HostSyncCounter, RuntimeStats
from ._spmd import DataParallelMeshDims
from ._torch_fsdp import adapt_torch, register_fsdp_forward_method
from .api import CommCompression, DBufferConfig, MixedPrecisionPolicy
from .fully_shard import (
    FSDPBackend,
    FSDPModule,
    UnshardHandle,
    full_parameters,
    fully_shard,
    materialize_shards_,
)
from .residuals import error_feedback_state, load_error_feedback_state

__all__ = [
    "CommCompression",
    "DBufferConfig",
    "DataParallelMeshDims",
    "FSDPBackend",
    "FSDPModule",
    "HostSyncCounter",
    "MixedPrecisionPolicy",
    "RuntimeStats",
    "UnshardHandle",
    "adapt_torch",
    "error_feedback_state",
    "full_parameters",
    "fully_shard",
    "load_error_feedback_state",
    "materialize_shards_",
    "register_fsdp_forward_method",
]
