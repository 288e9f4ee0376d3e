"""The FSDP runtime: sharded modules whose parameters and gradients are views of flat buffers.

One buffer per bucket, so the all-gather and the reduce-scatter run in place. Offers ``fully_shard``
/ ``FSDPBackend`` and the :class:`FSDPModule` methods; their configuration (:class:`DBufferConfig`,
:class:`MixedPrecisionPolicy`, :class:`CommCompression`, :class:`DataParallelMeshDims`); the
counters (:class:`RuntimeStats`, :class:`HostSyncCounter`); :func:`adapt_torch` (run by the first
``fully_shard``); for the checkpoint layer, :func:`full_parameters` and :func:`error_feedback_state`
/ :func:`load_error_feedback_state`. Everything else is private.
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
