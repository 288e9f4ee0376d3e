"""The sharded tensor: :class:`RaggedTensor`, a DTensor whose placement on one mesh dimension is a
:class:`RaggedShardPlacement` (this rank holds a run of whole units of the row-major
flattening, [Note: ragged shards as DTensors]), with everything that makes, places and reads it.

Offers the tensor and its placement; :class:`ShardInfo` and the readers of a tensor
(:func:`shard_info`, :func:`layout_of`, :func:`local_piece`, :func:`global_shape`,
:func:`local_range`, :func:`comm_group`: a plain tensor is held whole by this process); the
makers (:func:`distribute`, torch's ``distribute_tensor`` for a ragged placement;
:func:`placed_like`, :func:`to_ragged_tensor`) and :func:`gather_full` / :func:`local_flat`;
:func:`adapt_torch`, what torch needs to take them, run on first use ([Note: torch adapted on
first use]). Below the runtime, the optimizers, the checkpoint and clipping, which all take
sharded tensors; it imports none of them. The policy and the geometry of a layout
(``RaggedShard``, ``ShardLayout``) are in :mod:`raggedfsdp.layout`, which needs no process group.
Private: the placement (``_placement``), the ops the tensor runs (``_ops``), the readers
(``_info``), torch's adaptations (``_adapt``, DSD's loads in ``_torch_dsd``).
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
