"""The runtime's public configuration: frozen, keyword-only, validated once."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

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
    own dtype (fp32). FSDP2's four fields with FSDP2's meanings (torch's
    ``torch.distributed.fsdp.MixedPrecisionPolicy`` is accepted too and read into this).

    Attributes:
        param_dtype: dtype of the unsharded parameters (what forward computes with); ``None``
            keeps the parameter's dtype.
        reduce_dtype: dtype of the gradient reduction; ``None`` reduces in ``param_dtype``.
        output_dtype: floating-point forward outputs of the module are cast to it (e.g. fp32
            logits from a bf16 model); ``None`` leaves them as computed.
        cast_forward_inputs: floating-point forward inputs are cast to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    @classmethod
    def of(cls, policy: object | None) -> MixedPrecisionPolicy:
        """``policy`` as this class: ours as is, torch's FSDP2 policy field by field, ``None`` as
        the default; anything else is a ``TypeError``."""
        if policy is None:
            return cls()
        if isinstance(policy, cls):
            return policy
        if isinstance(policy, TorchMixedPrecisionPolicy):
            return cls(
                param_dtype=policy.param_dtype,
                reduce_dtype=policy.reduce_dtype,
                output_dtype=policy.output_dtype,
                cast_forward_inputs=policy.cast_forward_inputs,
            )
        raise TypeError(
            f"mp_policy must be rf.MixedPrecisionPolicy or torch.distributed.fsdp."
            f"MixedPrecisionPolicy, got {type(policy).__name__}"
        )
