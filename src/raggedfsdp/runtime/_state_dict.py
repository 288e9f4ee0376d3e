"""The state dict of a sharded module.

Its values are the parameters themselves, RaggedTensors DCP reads as its own checkpointables, so
saving copies nothing and a checkpoint reshards across world sizes and plans ([Note: ragged shards
in DCP] at :func:`state_dict_post_hook`); a 0-D parameter's value is the whole scalar.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from ..tensor import RaggedTensor

__all__ = ["state_dict_post_hook"]


# [Note: ragged shards in DCP] A sharded parameter is a :class:`~raggedfsdp.tensor.RaggedTensor`, a
# DTensor that DCP reads as its own ``_Checkpointable`` (rectangles of this rank's piece, views of
# the parameter), so ``model.state_dict()`` holds the parameters themselves, as with FSDP2: saving
# copies nothing and ``torch.distributed.checkpoint.load`` writes straight into the parameters. DCP
# stores chunks by global offsets, so a checkpoint reshards across world sizes and plans and loads
# into FSDP2 or one process. Loading goes through ``param.copy_(value)``, which takes a sharded
# value of this layout (its piece), of another layout or placement (resharded: a collective, as
# every rank loads), or a whole tensor (its piece cut out): any of them works with
# ``load_state_dict``.
#
# The one exception is a 0-D parameter: one rank holds it, so its state-dict value is the whole
# scalar, a plain tensor every rank has (DCP treats plain tensors as replicated).
def state_dict_post_hook(
    named_params: Sequence[tuple[str, nn.Parameter]], state_dict: dict[str, Any]
) -> None:
    """0-D sharded parameters of a unit (``(key, parameter)`` under every name) become their
    whole value in ``state_dict``; every other entry is the parameter itself."""
    for key, param in named_params:
        if isinstance(param, RaggedTensor) and param.dim() == 0 and key in state_dict:
            value = param.to_local().detach().reshape(-1).sum().reshape(())  # 0 where not held
            dist.all_reduce(value, group=param.shard_group)
            state_dict[key] = value
