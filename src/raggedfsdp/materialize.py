"""Initialise a model built on the meta device, shard by shard, as if it had been built whole.

``fully_shard`` gives a meta-device model real local shards (zeros) without ever holding a full
parameter. :func:`init_sharded_` then fills them: for each parameter in model order it lets
``init_fn`` fill one full-size temporary, from the same random stream a whole build would use,
and keeps this rank's piece. Every rank runs the same stream, so the result equals a whole build
with the same seed bit for bit; the only full-size memory is one parameter at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .layout import shard_info

__all__ = ["init_sharded_"]

InitFn = Callable[[str, torch.Tensor], None]


@torch.no_grad()
def init_sharded_(model: nn.Module, init_fn: InitFn) -> nn.Module:
    """Fill every parameter of a sharded (or plain) ``model`` with ``init_fn(name, full)``,
    visiting parameters in ``model.named_parameters()`` order (tied parameters once, under their
    first name), exactly as a whole-model ``init_weights`` loop would. Meta buffers are
    materialised on the parameters' device and passed to ``init_fn`` too."""
    device = None
    for name, param in model.named_parameters():
        info = shard_info(param)
        if info is None:
            if param.device.type == "meta":
                raise ValueError(
                    f"parameter {name!r} is on the meta device and not sharded; call "
                    f"fully_shard / FSDPBackend before init_sharded_"
                )
            init_fn(name, param.data)
            continue
        device = param.device
        full = torch.empty(info.layout.global_shape, dtype=param.dtype, device=param.device)
        init_fn(name, full)
        param.copy_(info.layout.to_local(full, info.rank))
    for module_name, module in model.named_modules():
        for buf_name, buf in list(module._buffers.items()):
            if buf is not None and buf.device.type == "meta":
                real = torch.empty_like(buf, device=device or torch.device("cpu"))
                init_fn(f"{module_name}.{buf_name}" if module_name else buf_name, real)
                module._buffers[buf_name] = real
    return model
