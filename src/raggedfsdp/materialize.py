"""Initialise a model built on the meta device, shard by shard, as if it had been built whole.

``fully_shard`` of a meta-device model keeps its shards on meta. :func:`init_sharded_` gives them
memory without ever holding a full parameter, then for each parameter in model order lets
``init_fn`` fill one full-size temporary from the same random stream a whole build would use and
keeps this rank's piece: bit for bit a whole build with the same seed, one full parameter at a time.
(FSDP2's recipe, ``to_empty`` then the parameters' own initialisation, works too: random fills of a
sharded parameter draw the whole tensor, [Note: ragged shards as DTensors].)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .runtime import materialize_shards_
from .tensor import distribute, shard_info

__all__ = ["init_sharded_"]

InitFn = Callable[[str, torch.Tensor], None]


@torch.no_grad()
def init_sharded_(model: nn.Module, init_fn: InitFn) -> nn.Module:
    """Fill every parameter of a sharded (or plain) ``model`` with ``init_fn(name, full)``,
    visiting parameters in ``model.named_parameters()`` order (tied parameters once, under their
    first name), exactly as a whole-model ``init_weights`` loop would. Meta buffers are
    materialised on the parameters' device and passed to ``init_fn`` too."""
    materialize_shards_(model)
    device = None
    for name, param in model.named_parameters():
        if shard_info(param) is None:
            if param.device.type == "meta":
                raise ValueError(
                    f"parameter {name!r} is on the meta device and not sharded; call "
                    f"fully_shard / FSDPBackend before init_sharded_"
                )
            init_fn(name, param.data)
            continue
        device = param.device
        # The whole parameter, also where tensor or expert parallelism splits it: its piece is
        # cut from the slice this rank's placements leave, as one process drew it.
        full = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        init_fn(name, full)
        piece = distribute(full, param.device_mesh, param.placements, src_data_rank=None)
        local = param.to_local()
        local.copy_(piece.to_local().view_as(local))
    for module_name, module in model.named_modules():
        for buf_name, buf in list(module._buffers.items()):
            if buf is not None and buf.device.type == "meta":
                real = torch.empty_like(buf, device=device or torch.device("cpu"))
                init_fn(f"{module_name}.{buf_name}" if module_name else buf_name, real)
                module._buffers[buf_name] = real
    return model
