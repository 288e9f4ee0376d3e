"""The quantized reduce-scatter of one bucket's gradients.

An all-to-all of quantized messages, one per owner, summed by the owner in fp32 in rank order, with
optional error feedback ([Note: compressed reduce-scatter] at :class:`QuantizedReduceScatter`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from .._collectives import Pending
from .._comm import BucketReduce, ReduceScatter
from .._mesh import MeshInfo
from .._metrics import RuntimeStats
from .._pool import BufferPool
from .._transport import Tag, exchange, peers, point_to_point, world_tensor
from ._codec import BucketCodec
from ._error_feedback import Residual
from ._finite import Finding

__all__ = ["QuantizedReduceScatter", "quantize_gradient"]


# [Note: compressed reduce-scatter] Each rank quantizes its whole unsharded gradient block by block,
# one message per owner, and sends each owner its message (an all-to-all: nothing is summed in low
# precision, as in ZeRO++'s qgZ); the owner dequantizes the ``W`` messages into an fp32 shard in
# rank order, adding, and divides by ``W``. A non-finite gradient poisons every message its rank
# sends, so every rank raises the same error at the end of backward ([Note: non-finite gradients];
# [Note: one finiteness check per step] in ``_finite.py``). With error feedback a rank adds what
# quantizing dropped last time (its residual, ``[W*S]``) to the gradient before quantizing, and
# keeps the new residual (:class:`~._error_feedback.Residual`).
class QuantizedReduceScatter(ReduceScatter):
    """One trainable bucket's reduce-scatter as ``dtype`` codes and fp32 scales, summed in fp32
    (module doc); with a ``residual``, error feedback."""

    def __init__(
        self,
        mesh: MeshInfo,
        codec: BucketCodec,
        dtype: torch.dtype,
        residual: Residual | None,
        qualify: Callable[[str], str],
        report: Callable[[Finding], None],
        *,
        gloo_point_to_point: bool = True,
    ) -> None:
        super().__init__(mesh, gloo_point_to_point=gloo_point_to_point)
        self.codec = codec
        self.dtype = dtype  # the codes' dtype (CommCompression.reduce_scatter)
        self.residual = residual  # error feedback's, kept across steps; None without it
        #: a parameter's name in the codec -> its name in the model, read when raising
        self.qualify = qualify
        #: hands what each reduction found on the device to the root's check of non-finite
        #: values ([Note: one finiteness check per step] in ``_finite.py``)
        self.report = report

    def reduce_scatter(
        self, full_grad: torch.Tensor, stats: RuntimeStats, pool: BufferPool
    ) -> BucketReduce:
        """The reduced shard (fp32 ``[S]``) is the mean over ranks of their dequantized messages
        for this rank, from each rank's ``full_grad``. A poisoned message is reported as a
        finding (the root raises at the end of backward) and fills the shard with NaN, which
        under HSDP the all-reduce over the replicas carries to the other groups ([Note:
        non-finite gradients])."""
        codec, group = self.codec, self.group
        nbytes, world = codec.message_bytes, codec.world_size
        output = torch.empty(codec.shard_numel, dtype=torch.float32, device=full_grad.device)
        with record_function("raggedfsdp::quantized_reduce_scatter"):
            rank, others = peers(group)
            outgoing = pool.take(world * nbytes, torch.uint8, full_grad.device)
            quantize_gradient(codec, self.dtype, self.residual, full_grad, outgoing)
            incoming = pool.take(world * nbytes, torch.uint8, full_grad.device)
            sent = [outgoing[k * nbytes : (k + 1) * nbytes] for k in range(world)]
            received = [incoming[k * nbytes : (k + 1) * nbytes] for k in range(world)]
            p2p = self.gloo_point_to_point
            if point_to_point(group, full_grad.device, gloo_point_to_point=p2p):
                transfers = [(p, sent[p], received[p]) for p in others]
                works = exchange(transfers, group, Tag.QUANTIZED_ALL_TO_ALL)
                received[rank] = sent[rank]
            else:
                works = [dist.all_to_all_single(incoming, outgoing, group=group, async_op=True)]
            uncompressed = full_grad.numel() * full_grad.element_size()
            stats.note_reduce_scatter(world * nbytes, uncompressed_bytes=uncompressed)

        def reduce() -> None:
            with record_function("raggedfsdp::dequantize_sum"):
                found, where = codec.find_poison(received)
                self.report(Finding(found, where, self._describe, gradient=True))
                output.zero_()
                for message in received:  # in rank order, summed in fp32
                    codec.decode(message, rank, output, self.dtype, accumulate=True)
                output.div_(world_tensor(world, output.dtype, output.device))
                output.masked_fill_(found, float("nan"))  # what the replicas' all-reduce carries
            pool.give(outgoing)
            pool.give(incoming)

        pending = Pending([w for w in works if w is not None], stats, reduce)
        return BucketReduce(pending, output, full_grad)

    def check_replicated(self, output: torch.Tensor) -> None:
        """HSDP, after the all-reduce of ``output`` over the replicas: report NaN in it, which a
        non-finite gradient anywhere leaves on every rank of every replica group (the poisoned
        group's own finding, reported before, names the parameter)."""
        found = torch.isfinite(output).all().logical_not_()
        nowhere = torch.zeros(0, dtype=torch.int64, device=output.device)
        self.report(Finding(found, nowhere, _replicated, gradient=True))

    def error_feedback_state(self) -> torch.Tensor | None:
        """The residual itself (loading copies into it)."""
        return None if self.residual is None else self.residual.data

    def _describe(self, detail: list[int]) -> str:
        """The error of a finding of :meth:`BucketCodec.find_poison`: ``[sender, parameter
        index]``, naming the sender by its global rank ([Note: non-finite gradients])."""
        sender, index = detail
        if self.group is not None:
            sender = dist.get_global_rank(self.group, sender)
        name = self.qualify(self.codec.parameter_named(index))
        return (
            f"raggedfsdp: the gradient of parameter {name!r} on rank {sender} has a non-finite "
            f"value; compressed communication cannot quantize it (every rank raises this error "
            f"at the end of backward)"
        )


def _replicated(detail: list[int]) -> str:
    """The error of a replica group that found another group's poison in its reduced shard."""
    return (
        "raggedfsdp: a non-finite gradient reached this rank's reduced shard through the "
        "all-reduce over the replicas (HSDP): another replica group had a non-finite gradient, "
        "and its ranks name the parameter"
    )


def quantize_gradient(
    codec: BucketCodec,
    dtype: torch.dtype,
    residual: Residual | None,
    full_grad: torch.Tensor,
    outgoing: torch.Tensor,
) -> None:
    """``outgoing`` (1-D, ``W`` messages) = one sealed message of ``dtype`` codes per owner
    from this rank's unsharded gradient ``full_grad`` (1-D ``[W*S]``), plus ``residual`` (error
    feedback), which then keeps what this quantizing dropped."""
    size, nbytes = codec.shard_numel, codec.message_bytes
    x, dropped = full_grad, None
    if residual is not None:
        x = full_grad.float()  # a copy when full_grad is fp32 too: x is added to
        if x.data_ptr() == full_grad.data_ptr():
            x = x.clone()
        residual.add_to(x)
        dropped = torch.zeros_like(x)  # padding between parameters stays 0
    for owner in range(codec.world_size):
        at = slice(owner * size, (owner + 1) * size)
        codec.encode(
            x[at],
            owner,
            outgoing[owner * nbytes : (owner + 1) * nbytes],
            dtype,
            residual=None if dropped is None else dropped[at],
        )
    if residual is not None:
        assert dropped is not None
        residual.store(dropped)
    codec.seal(outgoing)
