"""The sharded tensor: :class:`RaggedTensor`, a DTensor placed by a :class:`RaggedShardPlacement`.

This rank holds a run of whole units of the row-major flattening ([Note: ragged shards as
DTensors]). Offers the tensor and its placement, :class:`ShardInfo` and the readers of a tensor (a
plain tensor is held whole by this process), the makers (:func:`distribute`, :func:`placed_like`,
:func:`to_ragged_tensor`), :func:`gather_full` / :func:`local_flat`, and :func:`adapt_torch`, run on
first use ([Note: torch adapted on first use]). Below the runtime, the optimizers, the checkpoint
and clipping, and imports none of them; a layout's geometry is :mod:`raggedfsdp.layout`'s.
"""

from ._adapt import adapt_torch
from ._info import comm_group, global_shape, layout_of, local_piece, local_range, shard_info
from ._placement import RaggedShardPlacement, ShardInfo, ragged_dim
from ._ragged_tensor import (
    RaggedTensor,
    distribute,
    gather_full,
    local_flat,
    placed_like,
    to_ragged_tensor,
)

__all__ = [
    "RaggedShardPlacement",
    "RaggedTensor",
    "ShardInfo",
    "adapt_torch",
    "comm_group",
    "distribute",
    "gather_full",
    "global_shape",
    "layout_of",
    "local_flat",
    "local_piece",
    "local_range",
    "placed_like",
    "ragged_dim",
    "shard_info",
    "to_ragged_tensor",
]
