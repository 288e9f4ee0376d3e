"""Compressed collectives of one bucket: block-quantized all-gather and reduce-scatter.

[Note: compressed all-gather] Each rank quantizes its master shard block by block into one
message (codes, then scales: :mod:`._codec`) and the messages are all-gathered in ONE collective
(codes and scales in two would pay the latency twice for a few hundred bytes of scales); every
rank then dequantizes each rank's message straight into the unsharded parameter buffer (its
dtype: ``param_dtype`` under mixed precision), its own message included, so the parameters
forward sees are bitwise the single-process quantize-dequantize of the full master parameter.
The message is valid until an iteration that reduces gradients ends (or the shard changes): with
``reshard_after_forward`` the second all-gather before backward does not quantize again, nor do
the micro-batches of gradient accumulation (``no_sync``) after the first: once per optimizer
step. That costs one message per bucket, about a quarter of the fp32 shard, kept for the
bucket's life (one buffer re-encoded in place: no allocation per step).

[Note: compressed reduce-scatter] Each rank quantizes its whole unsharded gradient block by block,
one message per owner, and sends each owner its message (an all-to-all: nothing is summed in low
precision, as in ZeRO++'s qgZ); the owner dequantizes the ``W`` messages into an fp32 shard in
rank order, adding, and divides by ``W``. A non-finite gradient poisons every message its rank
sends, so every rank raises the same error ([Note: non-finite gradients]). With error feedback a
rank adds what quantizing dropped last time (its residual, ``[W*S]``) to the gradient before
quantizing, and keeps the new residual (:class:`Residual`).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from ..layout import RaggedShard
from ..planner import ShardPlan
from ._codec import BucketCodec
from ._collectives import Pending
from ._metrics import RuntimeStats
from ._pool import BufferPool
from ._transport import Tag, all_gather_tensor, exchange, is_gloo, peers, world_tensor
from .api import CommCompression

__all__ = ["BucketCompression", "Residual"]

#: How error-feedback residuals are stored. 8-bit (int8 codes of the residual, in the gradient's
#: own blocks) keeps the error of a sum over 256 steps of a fixed gradient where fp32 keeps it,
#: and bf16 lets it drift ~20% further, at 1/4 and 1/2 of fp32's memory (``tests/test_quant.py``,
#: docs/compression.md).
ResidualStorage = Literal["fp32", "bf16", "int8"]


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


def _poison_error(
    codec: BucketCodec, received: list[torch.Tensor], group: dist.ProcessGroup | None
) -> str | None:
    """The error of the first poisoned message in rank order, naming the parameter and the
    sender's global rank: the same on every rank of the group ([Note: non-finite gradients])."""
    for k, message in enumerate(received):
        name = codec.poisoned_parameter(message)
        if name is not None:
            sender = k if group is None else dist.get_global_rank(group, k)
            return (
                f"raggedfsdp: the gradient of parameter {name!r} on rank {sender} has a "
                f"non-finite value; compressed communication cannot quantize it (every rank "
                f"raises this error before its next collective)"
            )
    return None


class BucketCompression:
    """One bucket's compressed collectives, and what they keep between calls: the quantized
    shard of the all-gather and, for a ``trainable`` bucket, the error-feedback residual
    (module doc)."""

    residual_storage: ResidualStorage = "int8"

    def __init__(
        self,
        plan: ShardPlan,
        policy: RaggedShard,
        compression: CommCompression,
        device: torch.device,
        *,
        trainable: bool = True,
    ) -> None:
        self.config = compression
        self.codec = BucketCodec(plan, policy, compression.block_size)
        self.rank: int | None = None  # set by the first collective
        #: the quantized master shard ``[message_bytes]`` (one buffer, re-encoded in place) and
        #: the shard version it encodes (-1: stale, see :meth:`drop_quantized_shard`)
        self._quantized: torch.Tensor | None = None
        self._quantized_version = -1
        #: the error of the last reduce-scatter's poisoned message, deferred under HSDP
        self.error: str | None = None
        self.residual = (
            Residual(self.codec, self.residual_storage, device)
            if compression.error_feedback and trainable
            else None
        )

    def drop_quantized_shard(self) -> None:
        """An iteration that reduced gradients ended: the optimizer may change the shard before
        the next all-gather, so the next one quantizes again (into the same buffer)."""
        self._quantized_version = -1

    def _quantized_shard(self, local: torch.Tensor, rank: int) -> torch.Tensor:
        # The version counter catches in-place changes made through the parameters (optimizer
        # steps, load_state_dict); changes through .data are caught at the end of an iteration
        # that reduced (no_sync micro-batches keep the shard: no optimizer step between them).
        if self._quantized_version != local._version:
            if self._quantized is None:  # zeros: the padding of codes and scales stays 0
                self._quantized = torch.zeros(
                    self.codec.message_bytes, dtype=torch.uint8, device=local.device
                )
            dtype = self.config.all_gather
            assert dtype is not None
            self.codec.encode(local, rank, self._quantized, dtype)
            self._quantized_version = local._version
        assert self._quantized is not None
        return self._quantized

    def all_gather(
        self,
        full: torch.Tensor,
        local: torch.Tensor,
        group: dist.ProcessGroup,
        stats: RuntimeStats,
        pool: BufferPool,
    ) -> Pending:
        """Fill ``full`` (1-D ``[W*S]``, the unsharded parameter buffer) with every rank's
        dequantized shard; ``local`` is this rank's master shard ``[S]``."""
        codec, dtype = self.codec, self.config.all_gather
        assert dtype is not None
        size, nbytes, world = codec.shard_numel, codec.message_bytes, codec.world_size
        with record_function("raggedfsdp::quantized_all_gather"):
            rank, others = peers(group)
            mine = self._quantized_shard(local, rank)
            received = pool.take(world * nbytes, torch.uint8, local.device)  # 1-D [W*message]
            messages = [received[k * nbytes : (k + 1) * nbytes] for k in range(world)]
            if is_gloo(group, local.device):
                works = exchange(
                    [(p, mine, messages[p]) for p in others], group, Tag.QUANTIZED_ALL_GATHER
                )
                messages[rank] = mine
            else:
                works = [all_gather_tensor(received, mine, group=group, async_op=True)]
            stats.note_all_gather(nbytes, uncompressed_bytes=size * full.element_size())

        def dequantize() -> None:
            with record_function("raggedfsdp::dequantize"):
                for k, message in enumerate(messages):
                    codec.check_finite(message, k, "the master weight")
                    codec.decode(message, k, full[k * size : (k + 1) * size], dtype)
            pool.give(received)

        return Pending([w for w in works if w is not None], stats, dequantize)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        full_grad: torch.Tensor,
        group: dist.ProcessGroup,
        stats: RuntimeStats,
        pool: BufferPool,
        *,
        replicated: bool = False,
    ) -> Pending:
        """``output`` (fp32 ``[S]``) = the mean over ranks of their dequantized messages for this
        rank, from each rank's ``full_grad`` (1-D ``[W*S]``). A poisoned message raises when
        the wait ends; ``replicated`` (HSDP) defers that to :meth:`check_replicated`, after the
        all-reduce over the replicas, and fills ``output`` with NaN for that all-reduce to
        carry ([Note: non-finite gradients])."""
        codec, dtype = self.codec, self.config.reduce_scatter
        assert dtype is not None
        nbytes, world = codec.message_bytes, codec.world_size
        with record_function("raggedfsdp::quantized_reduce_scatter"):
            rank, others = peers(group)
            outgoing = pool.take(world * nbytes, torch.uint8, full_grad.device)
            self._quantize_gradient(full_grad, outgoing)
            incoming = pool.take(world * nbytes, torch.uint8, full_grad.device)
            sent = [outgoing[k * nbytes : (k + 1) * nbytes] for k in range(world)]
            received = [incoming[k * nbytes : (k + 1) * nbytes] for k in range(world)]
            if is_gloo(group, full_grad.device):
                transfers = [(p, sent[p], received[p]) for p in others]
                works = exchange(transfers, group, Tag.QUANTIZED_ALL_TO_ALL)
                received[rank] = sent[rank]
            else:
                works = [dist.all_to_all_single(incoming, outgoing, group=group, async_op=True)]
            uncompressed = full_grad.numel() * full_grad.element_size()
            stats.note_reduce_scatter(world * nbytes, uncompressed_bytes=uncompressed)

        def reduce() -> None:
            with record_function("raggedfsdp::dequantize_sum"):
                self.error = _poison_error(codec, received, group)
                if self.error is None:
                    output.zero_()
                    for message in received:  # in rank order, summed in fp32
                        codec.decode(message, rank, output, dtype, accumulate=True)
                    output.div_(world_tensor(world, output.dtype, output.device))
                else:
                    output.fill_(float("nan"))  # what the replicas' all-reduce carries (HSDP)
            pool.give(outgoing)
            pool.give(incoming)
            if self.error is not None and not replicated:
                raise ValueError(self.error)

        return Pending([w for w in works if w is not None], stats, reduce)

    def check_replicated(self, output: torch.Tensor) -> None:
        """HSDP, after the all-reduce of ``output`` over the replicas: raise on every rank of
        every replica group if a gradient was non-finite anywhere (the poisoned group names the
        parameter; the others see its NaN in ``output``)."""
        if self.error is not None:
            raise ValueError(self.error)
        if not bool(torch.isfinite(output).all()):
            raise ValueError(
                "raggedfsdp: a non-finite gradient reached this rank's reduced shard through "
                "the all-reduce over the replicas (HSDP): another replica group had a non-finite "
                "gradient, and its ranks name the parameter"
            )

    def _quantize_gradient(self, full_grad: torch.Tensor, outgoing: torch.Tensor) -> None:
        """One message per owner from this rank's unsharded gradient (plus its residual)."""
        codec, dtype = self.codec, self.config.reduce_scatter
        assert dtype is not None
        size, nbytes = codec.shard_numel, codec.message_bytes
        x, residual = full_grad, None
        if self.residual is not None:
            x = full_grad.float()  # a copy when full_grad is fp32 too: x is added to
            if x.data_ptr() == full_grad.data_ptr():
                x = x.clone()
            self.residual.add_to(x)
            residual = torch.zeros_like(x)  # padding between parameters stays 0
        for owner in range(codec.world_size):
            at = slice(owner * size, (owner + 1) * size)
            codec.encode(
                x[at],
                owner,
                outgoing[owner * nbytes : (owner + 1) * nbytes],
                dtype,
                residual=None if residual is None else residual[at],
            )
        if self.residual is not None:
            assert residual is not None
            self.residual.store(residual)
        codec.seal(outgoing)
