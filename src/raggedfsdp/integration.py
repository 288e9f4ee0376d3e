"""raggedfsdp's integration with torch: everything it changes in torch, in one list.

Nothing changes at ``import raggedfsdp``. Each change lives with what it adapts and is made once, on
first use: the first ``fully_shard`` makes all four, the first ragged placement or RaggedTensor the
sharded tensor's three ([Note: torch adapted on first use] in ``raggedfsdp/tensor/_placement.py``).
:func:`install` makes them all now. Each is contained: torch behaves as before for whatever is not
raggedfsdp's.
"""

from __future__ import annotations

from .runtime import adapt_torch

__all__ = ["install"]


def install() -> None:
    """Make torch's own utilities right over raggedfsdp's sharded modules now. Idempotent; not
    needed where ``fully_shard`` has run.

    1. torch's ``register_fsdp_forward_method`` hands modules sharded by ``rf.fully_shard`` to
       :func:`raggedfsdp.register_fsdp_forward_method`, where it would return silently for
       them (:func:`raggedfsdp.runtime.adapt_torch`).
    2. :class:`~raggedfsdp.tensor.RaggedTensor` joins torch's foreach-supported types, so
       optimizers, ``clip_grad_norm_`` and the norm utilities take their fused paths over it.
    3. ``torch.distributed.tensor.distribute_tensor`` (and every loaded module's binding of it)
       hands a ragged placement to :func:`raggedfsdp.tensor.distribute`.
    4. DSD's ``_distribute_tensors`` (its ``broadcast_from_rank0`` loads) places RaggedTensors
       by ``copy_``. Items 2-4: :func:`raggedfsdp.tensor.adapt_torch`.
    """
    adapt_torch()
