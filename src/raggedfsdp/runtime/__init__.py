"""The FSDP runtime: sharded modules whose parameters and gradients are views of one flat buffer
per bucket, so the all-gather and the reduce-scatter run in place.

Offers ``fully_shard`` / ``FSDPBackend`` and the :class:`FSDPModule` methods sharded modules
get; their configuration (:class:`DBufferConfig`, :class:`MixedPrecisionPolicy`,
:class:`CommCompression`, :class:`DataParallelMeshDims` for the full-SPMD-mesh form); the
counters (:class:`RuntimeStats`) and the host synchronisations (:class:`HostSyncCounter`);
:class:`RaggedTensor`, the DTensor class of sharded parameters, their gradients and optimizer
state (with :func:`to_ragged_tensor`, :func:`local_flat` and :func:`gather_full`); for the
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
from ._ragged_tensor import RaggedTensor, distribute, gather_full, local_flat, to_ragged_tensor
from ._spmd import DataParallelMeshDims
from .api import CommCompression, DBufferConfig, MixedPrecisionPolicy
from .fully_shard import (
    FSDPBackend,
    FSDPModule,
    UnshardHandle,
    full_parameters,
    fully_shard,
    materialize_shards_,
    register_fsdp_forward_method,
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
    "RaggedTensor",
    "RuntimeStats",
    "UnshardHandle",
    "distribute",
    "error_feedback_state",
    "full_parameters",
    "fully_shard",
    "gather_full",
    "load_error_feedback_state",
    "local_flat",
    "materialize_shards_",
    "register_fsdp_forward_method",
    "to_ragged_tensor",
]
