"""The quantized all-gather of one bucket's parameters.

Each rank quantizes its master shard once per optimizer step into one message, all-gathered in one
collective, and every rank dequantizes every message into the unsharded buffer ([Note: compressed
all-gather] at :class:`QuantizedAllGather`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from .._collectives import Pending
from .._comm import AllGather
from .._metrics import RuntimeStats
from .._pool import BufferPool
from .._transport import Tag, all_gather_tensor, exchange, peers, point_to_point
from ._codec import BucketCodec
from ._finite import Finding

__all__ = ["QuantizedAllGather"]


# [Note: compressed all-gather] Each rank quantizes its master shard block by block into one message
# (codes, then scales: :mod:`._codec`) and the messages are all-gathered in ONE collective (codes
# and scales in two would pay the latency twice for a few hundred bytes of scales); every rank then
# dequantizes each rank's message straight into the unsharded parameter buffer (its dtype:
# ``param_dtype`` under mixed precision), its own message included, so the parameters forward sees
# are bitwise the single-process quantize-dequantize of the full master parameter. A non-finite
# master weight is found on the device and raised at the end of the root's forward ([Note: one
# finiteness check per step] in ``_finite.py``). The message is valid until an iteration that
# reduces gradients ends (or the shard changes): with ``reshard_after_forward`` the second
# all-gather before backward does not quantize again, nor do the micro-batches of gradient
# accumulation (``no_sync``) after the first: once per optimizer step. That costs one message per
# bucket, about a quarter of the fp32 shard, kept for the bucket's life (one buffer re-encoded in
# place: no allocation per step).
class QuantizedAllGather(AllGather):
    """One bucket's all-gather as ``dtype`` codes and fp32 scales (module doc); it keeps the
    quantized shard it last sent."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        codec: BucketCodec,
        dtype: torch.dtype,
        qualify: Callable[[str], str],
        report: Callable[[Finding], None],
        *,
        gloo_point_to_point: bool = True,
    ) -> None:
        self.group = group
        self.codec = codec
        self.dtype = dtype  # the codes' dtype (CommCompression.all_gather)
        #: DBufferConfig's: on Gloo, point to point (else NCCL's all-gather of the messages)
        self.gloo_point_to_point = gloo_point_to_point
        #: a parameter's name in the codec -> its name in the model, read when raising
        self.qualify = qualify
        #: hands what each gather found on the device to the root's check of non-finite
        #: values ([Note: one finiteness check per step] in ``_finite.py``)
        self.report = report
        #: the quantized master shard ``[message_bytes]`` (one buffer, re-encoded in place,
        #: allocated at the first all-gather) and the shard version it encodes (-1: stale)
        self._quantized: torch.Tensor | None = None
        self._quantized_version = -1

    def shard_may_change(self) -> None:
        """The next all-gather quantizes again (into the same buffer)."""
        self._quantized_version = -1

    def _quantized_shard(self, local: torch.Tensor, rank: int) -> torch.Tensor:
        # The version counter catches in-place changes made through the parameters (optimizer
        # steps, load_state_dict); changes through .data are caught at the end of an iteration
        # that reduced (no_sync micro-batches keep the shard: no optimizer step between them).
        if self._quantized is None:  # zeros: the padding of codes and scales stays 0
            self._quantized = torch.zeros(
                self.codec.message_bytes, dtype=torch.uint8, device=local.device
            )
        if self._quantized_version != local._version:
            self.codec.encode(local, rank, self._quantized, self.dtype)
            self._quantized_version = local._version
        return self._quantized

    def copy_in(
        self, full: torch.Tensor, local: torch.Tensor, stats: RuntimeStats, pool: BufferPool
    ) -> torch.Tensor:
        """This rank's message: its master shard ``local`` quantized (unless it still is)."""
        rank, _ = peers(self.group)
        return self._quantized_shard(local, rank)

    def issue(
        self,
        full: torch.Tensor,
        sent: torch.Tensor,
        stats: RuntimeStats,
        pool: BufferPool,
        *,
        own_ranges: Sequence[tuple[int, int]],
    ) -> Pending:
        """Gather every rank's message (``sent`` is this rank's); once they are in, each is
        dequantized into ``full`` (1-D ``[W*S]``, the unsharded parameter buffer), this rank's
        too, so ``own_ranges`` needs no placing of its own."""
        codec, group = self.codec, self.group
        size, nbytes, world = codec.shard_numel, codec.message_bytes, codec.world_size
        with record_function("raggedfsdp::quantized_all_gather"):
            rank, others = peers(group)
            received = pool.take(world * nbytes, torch.uint8, sent.device)  # 1-D [W*message]
            messages = [received[k * nbytes : (k + 1) * nbytes] for k in range(world)]
            if point_to_point(group, sent.device, gloo_point_to_point=self.gloo_point_to_point):
                transfers = [(p, sent, messages[p]) for p in others]
                works = exchange(transfers, group, Tag.QUANTIZED_ALL_GATHER)
                messages[rank] = sent
            else:
                works = [all_gather_tensor(received, sent, group=group, async_op=True)]
            stats.note_all_gather(nbytes, uncompressed_bytes=size * full.element_size())

        def dequantize() -> None:
            with record_function("raggedfsdp::dequantize"):
                # A non-finite master weight left a non-finite scale, which dequantizes to NaN
                # or inf: the root raises once it reads the finding (every rank the same: each
                # decodes every message).
                found, slot = codec.find_non_finite(messages)
                self.report(Finding(found, slot, self._describe, gradient=False))
                for k, message in enumerate(messages):
                    codec.decode(message, k, full[k * size : (k + 1) * size], self.dtype)
            pool.give(received)

        return Pending([w for w in works if w is not None], stats, dequantize)

    def _describe(self, detail: list[int]) -> str:
        """The error of a finding of :meth:`BucketCodec.find_non_finite` at scale slot
        ``detail[0]``."""
        rank, name = self.codec.piece_at(detail[0])
        return (
            f"raggedfsdp: the master weight of parameter {self.qualify(name)!r} has a "
            f"non-finite value (in rank {rank}'s shard); compressed communication cannot "
            f"quantize it"
        )
