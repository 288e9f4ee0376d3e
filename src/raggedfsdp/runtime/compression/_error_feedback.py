"""Error feedback: what quantizing a rank's gradient dropped, kept and added to its next one.

A rank's residual is one tensor per trainable bucket, ``[W*S]`` like the unsharded gradient it
corrects: it is per-rank training state, not a shard of anything (``runtime/residuals.py`` saves
and loads it). How it is stored is ``CommCompression.residual_storage``: 8-bit (int8 codes of
the residual, in the gradient's own blocks) keeps the error of a sum over 256 steps of a fixed
gradient where fp32 keeps it, and bf16 lets it drift ~20% further, at 1/4 and 1/2 of fp32's
memory (``tests/unit/test_quant.py``, docs/results/compression.md).
"""

from __future__ import annotations

import torch

from ..api import ResidualStorage
from ._codec import BucketCodec

__all__ = ["Residual"]


class Residual:
    """What quantizing a rank's unsharded gradient dropped, kept for the next one: 1-D ``[W*S]``
    in ``storage`` (``"int8"``: codes and scales in the codec's message layout, one message per
    owner)."""

    def __init__(self, codec: BucketCodec, storage: ResidualStorage, device: torch.device):
        self.codec = codec
        self.storage = storage
        numel = codec.world_size * codec.shard_numel
        if storage == "int8":
            # Zeros are a valid message: codes 0 with scale 0 decode to 0.
            self.data = torch.zeros(
                codec.world_size * codec.message_bytes, dtype=torch.uint8, device=device
            )
        else:
            dtype = torch.float32 if storage == "fp32" else torch.bfloat16
            self.data = torch.zeros(numel, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def add_to(self, x: torch.Tensor) -> None:
        """``x += residual`` (``x``: fp32 ``[W*S]``)."""
        if self.storage != "int8":
            x.add_(self.data)
            return
        size, message = self.codec.shard_numel, self.codec.message_bytes
        for owner in range(self.codec.world_size):
            self.codec.decode(
                self.data[owner * message : (owner + 1) * message],
                owner,
                x[owner * size : (owner + 1) * size],
                torch.int8,
                accumulate=True,
            )

    def store(self, residual: torch.Tensor) -> None:
        """Keep ``residual`` (fp32 ``[W*S]``)."""
        if self.storage != "int8":
            self.data.copy_(residual)
            return
        size, message = self.codec.shard_numel, self.codec.message_bytes
        for owner in range(self.codec.world_size):
            self.codec.encode(
                residual[owner * size : (owner + 1) * size],
                owner,
                self.data[owner * message : (owner + 1) * message],
                torch.int8,
            )
