"""What torch needs to take ragged placements and RaggedTensors as its own: :func:`adapt_torch`.

Run by the first ragged placement or RaggedTensor made ([Note: torch adapted on first use] in
``_placement.py``) and by the first ``fully_shard``; never at import. Each change is contained:
torch behaves as before for whatever is not a ragged shard.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed._state_dict_utils as state_dict_utils
import torch.distributed.tensor
import torch.distributed.tensor._api as dtensor_api
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement
from torch.utils._foreach_utils import _foreach_supported_types

from ._placement import RaggedShardPlacement, on_first_use
from ._ragged_tensor import RaggedTensor, distribute
from ._torch_dsd import route_distribute_tensors

__all__ = ["adapt_torch"]


def adapt_torch() -> None:
    """Make torch's own utilities right over ragged shards. Idempotent (flags on torch's
    objects, so a second call changes nothing).

    1. :class:`RaggedTensor`, the class of sharded parameters, their gradients and optimizer
       state, joins torch's foreach-supported types, so optimizers, ``clip_grad_norm_`` and
       the norm utilities take their fused paths over it, as over DTensor
       (torch/distributed/tensor/__init__.py registers DTensor the same way; the list is
       checked by exact type).
    2. ``torch.distributed.tensor.distribute_tensor`` (where torch exports it, and in every
       module already imported that bound it by name, DSD's among them) hands a whole tensor
       to be placed by a ragged placement to :func:`~._ragged_tensor.distribute`, where torch's
       would refuse the placement: DSD's full-state loads and accelerate's
       ``cpu_ram_efficient_loading`` call it with the parameters' own placements. Other
       placements go to torch's, unchanged.
    3. DSD's ``_distribute_tensors`` (its ``broadcast_from_rank0`` loads) places RaggedTensors
       by ``copy_`` ([Note: torch.distributed.checkpoint.state_dict over ragged shards] in
       ``_torch_dsd.py``).
    """
    if RaggedTensor not in _foreach_supported_types:
        _foreach_supported_types.append(RaggedTensor)
    _route_distribute_tensor()
    route_distribute_tensors()


def _route_distribute_tensor() -> None:
    """Item 2 of :func:`adapt_torch`: every module that binds ``distribute_tensor``."""
    torch_distribute = dtensor_api.distribute_tensor
    if getattr(torch_distribute, "_raggedfsdp", False):
        return

    @functools.wraps(torch_distribute)
    def route(
        tensor: torch.Tensor,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        **kwargs: Any,
    ) -> DTensor:
        ragged = placements is not None and any(
            isinstance(p, RaggedShardPlacement) for p in placements
        )
        if ragged and device_mesh is not None:
            return distribute(tensor, device_mesh, placements, **kwargs)
        return torch_distribute(tensor, device_mesh, placements, **kwargs)

    route._raggedfsdp = True  # type: ignore[attr-defined]
    for exporter in (dtensor_api, torch.distributed.tensor, state_dict_utils):
        exporter.distribute_tensor = route  # type: ignore[attr-defined]
    # Modules imported before this that bound torch's function by name (``from
    # torch.distributed.tensor import distribute_tensor``: torch's test utilities, a framework)
    # get the route too; only that exact function object is replaced.
    for module in list(sys.modules.values()):
        if getattr(module, "distribute_tensor", None) is torch_distribute:
            module.distribute_tensor = route  # type: ignore[attr-defined]


on_first_use(adapt_torch)
