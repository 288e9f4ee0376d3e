"""What compressed communication costs, from the plans: messages, residuals and codec traffic.

A bucket's *message* is what one rank sends per peer, laid out as the runtime's codec lays it out
(both through :class:`~raggedfsdp.planner.MessageLayout`): ``S`` one-byte codes padded to 16 bytes,
then one fp32 scale per quantization block of its pieces, padded to the largest count of any rank
(all messages of a bucket have one size), the whole padded to 16 bytes. The planner keeps every
block whole, so a rank's pieces are whole blocks and the counts follow from the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..layout import RaggedShard
from ..planner import MessageLayout, ShardPlan, quant_block
from ..planner.quant_blocks import Compression

__all__ = [
    "ALL_GATHER_CODES",
    "CODE_DTYPES",
    "REDUCE_SCATTER_CODES",
    "CompressionSpec",
    "codec_traffic_bytes",
    "message_bytes",
]

#: The code dtype of each spelling of ``--compress-all-gather`` / ``--compress-reduce-scatter``
#: (``raggedfsdp train`` and ``raggedfsdp plan``).
CODE_DTYPES: dict[str, torch.dtype | None] = {
    "none": None,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
#: The spellings each direction accepts.
ALL_GATHER_CODES = ("none", "fp8", "int8")
REDUCE_SCATTER_CODES = ("none", "int8", "fp8", "fp8_e5m2")


@dataclass(frozen=True, kw_only=True)
class CompressionSpec:
    """What the capacity planner needs to know of a compression, where the runtime's
    :class:`raggedfsdp.CommCompression` is out of reach (the planner does not import the
    runtime; ``raggedfsdp plan`` builds one of these). Either type may be passed to
    :class:`~.capacity.CapacityOptions`.

    Attributes:
        all_gather: code dtype of the all-gather, or ``None`` (uncompressed).
        reduce_scatter: code dtype of the reduce-scatter, or ``None``.
        block_size: the quantization block (``None``: the policy's tiles).
        error_feedback: each rank keeps an 8-bit residual of its unsharded gradients.
    """

    all_gather: torch.dtype | None = None
    reduce_scatter: torch.dtype | None = None
    block_size: int | tuple[int, int] | None = None
    error_feedback: bool = False

    def __post_init__(self) -> None:
        if self.error_feedback and self.reduce_scatter is None:
            raise ValueError(
                "error feedback needs reduce-scatter compression (--compress-reduce-scatter)"
            )

    @property
    def enabled(self) -> bool:
        """Whether any collective is compressed."""
        return self.all_gather is not None or self.reduce_scatter is not None

    @classmethod
    def parse(
        cls, all_gather: str | None, reduce_scatter: str | None, error_feedback: bool
    ) -> CompressionSpec | None:
        """From the command line's spellings (:data:`CODE_DTYPES`); ``None`` when nothing is
        compressed and there is no error feedback to refuse."""
        spec = cls(
            all_gather=CODE_DTYPES[all_gather or "none"],
            reduce_scatter=CODE_DTYPES[reduce_scatter or "none"],
            error_feedback=error_feedback,
        )
        return spec if spec.enabled else None


def message_bytes(
    plan: ShardPlan, policy: RaggedShard, block_size: int | tuple[int, int] | None
) -> int:
    """Bytes of one rank's message for bucket ``plan`` (module doc): ``ceil16(S)`` codes plus
    4 bytes per block of the rank with the most blocks, to a multiple of 16. Each entry visits
    only its first and last rank; the ranks between hold ``S`` of it each, whole blocks from a
    block boundary, so the same number of blocks (added to all of them at once)."""
    size = plan.shard_numel
    counts = torch.zeros(plan.world_size, dtype=torch.int64)
    for entry in plan.entries.values():
        if not entry.numel:
            continue
        block = quant_block(entry.name, entry.shape, policy, block_size)
        first = entry.offset // size
        last = (entry.offset + entry.numel - 1) // size
        for rank in {first, last}:
            start, end = plan.local_range(entry.name, rank)
            counts[rank] += block.num_blocks(end - start)
        if last - first > 1:
            counts[first + 1 : last] += block.num_blocks(size)
    return MessageLayout(size, int(counts.max())).message_bytes


def codec_traffic_bytes(
    shards: Sequence[int],
    messages: Sequence[int],
    gathers: int,
    reduced: Sequence[bool],
    world_size: int,
    compression: Compression,
    *,
    param_itemsize: int,
    master_itemsize: int = 4,
) -> int:
    """Memory traffic (bytes read plus written) of one unit's quantizing and dequantizing in
    one step, on the compute thread: its buckets' shards ``S`` and messages, all-gathered
    ``gathers`` times, ``reduced``: which buckets are reduce-scattered.

    - all-gather: quantize the master shard once per step (read ``S`` masters, write ``S``
      codes and the scales), dequantize the ``W`` messages into the unsharded parameters at
      each gather (read ``W`` messages, write ``W S`` parameters);
    - reduce-scatter: quantize the unsharded gradient (read ``W S`` gradients, write ``W``
      messages), and, with error feedback, decode the residual into an fp32 copy of the
      gradient and encode the new one (``W S`` fp32 written and read twice, ``W`` messages read
      and written); the owner dequantizes ``W`` messages, adding into its fp32 shard (read
      ``W`` messages, read and write ``W S`` fp32 partial sums).
    """
    w, total = world_size, 0
    for size, message, grad in zip(shards, messages, reduced, strict=True):
        if compression.all_gather is not None and gathers:
            total += size * master_itemsize + message
            total += gathers * w * (message + size * param_itemsize)
        if compression.reduce_scatter is not None and grad:
            total += w * size * param_itemsize + w * message
            if compression.error_feedback:
                total += 3 * w * size * 4 + 2 * w * message
            total += w * message + 2 * w * size * 4
    return total
