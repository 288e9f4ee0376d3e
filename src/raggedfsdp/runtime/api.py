"""The runtime's public configuration: frozen, keyword-only, validated once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DBufferConfig", "MixedPrecisionPolicy"]


@dataclass(frozen=True, kw_only=True)
class DBufferConfig:
    """How the runtime lays out and manages bucket buffers.

    Attributes:
        zero_copy: parameters and gradients are views of the bucket buffers, so collectives run
            in place. ``False`` is an FSDP2-style copy-in/copy-out path kept for A/B measurement.
        group_level: memory is managed per unit and shared across units: the unsharded
            parameter buffers of all buckets of a unit share one storage, allocated and freed
            as a whole, and the gradient and reduce-scatter scratch blocks come from one pool
            shared by all units of the model, reused from unit to unit within a backward and
            emptied at its end. ``False`` gives each bucket its own parameter storage and
            allocates every scratch block afresh (as FSDP2 does). Unsharded *parameter*
            storage is not pooled across units: see [Note: freeing unsharded storage].
        buffer_size: a unit's parameters are split into buckets of at most this many bytes (in
            the communication dtype); a single larger parameter gets its own bucket; ``None`` makes
            each unit one bucket per dtype.
    """

    zero_copy: bool = True
    group_level: bool = True
    buffer_size: int | None = None

    def __post_init__(self) -> None:
        if self.buffer_size is not None and (
            isinstance(self.buffer_size, bool)
            or not isinstance(self.buffer_size, int)
            or self.buffer_size < 1
        ):
            raise ValueError(
                f"DBufferConfig.buffer_size must be a positive number of bytes or None, "
                f"got {self.buffer_size!r}"
            )


@dataclass(frozen=True, kw_only=True)
class MixedPrecisionPolicy:
    """Dtypes for the unsharded parameters and the gradient reduction; master shards keep their
    own dtype (fp32). ``None`` keeps the parameter's dtype; ``reduce_dtype=None`` reduces in
    ``param_dtype`` (as FSDP2). Floating-point forward inputs are cast to ``param_dtype``."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
