"""BucketCodec: one bucket's shards as messages of codes and scales.

A rank's *message* is one 1-D byte buffer: the codes of its whole shard (``S`` one-byte codes,
at the shard's own offsets, so a parameter's codes sit where its values sit in the bucket) padded
to 4 bytes, then the fp32 scales of its pieces' blocks in buffer order, padded to the largest
count of any rank (all messages have one size, so an all-gather or an all-to-all moves them). A
*piece* is one parameter's part of one rank's shard: whole quantization blocks, because the
planner never cuts a block (checked here, so a plan made without the compression fails loudly).

[Note: non-finite gradients] A non-finite value in a block leaves a non-finite scale, but in the
reduce-scatter only the block's owner receives that scale: the other ranks would go on into the
next collective while the owner raises. So the sender seals its messages
(:meth:`BucketCodec.seal`): if any of its scales is not finite, EVERY message it sends is
poisoned (all scale slots NaN, the first four code bytes the index of the first bad parameter).
Every rank receives one message from every rank, so every rank sees the poison of the same
sender (the first in rank order) and raises the same error at the same point of its program,
before any rank enters another collective, without an extra collective or byte on the wire.
Under HSDP the other replica groups receive nothing from the poisoned group but its all-reduce:
there the poisoned ranks defer the error, fill their reduced shards with NaN, and after the
all-reduce every rank of every group finds it (:meth:`QuantizedReduceScatter.check_replicated`).

Parameters are named as the bucket's plan names them (below the unit's module); the collectives
qualify a name with the unit's path when they raise, so the codec is built once and never
renamed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...layout import RaggedShard
from ...planner import QuantBlock, ShardPlan, quant_block
from ._quant import dequantize, quantize

__all__ = ["BucketCodec", "Piece"]


@dataclass(frozen=True)
class Piece:
    """One parameter's part of one rank's shard."""

    name: str
    local: int  # first element in the rank's shard [S]
    numel: int
    scale: int  # first scale in the rank's message
    block: QuantBlock

    @property
    def elements(self) -> slice:
        return slice(self.local, self.local + self.numel)

    @property
    def scales(self) -> slice:
        return slice(self.scale, self.scale + self.block.num_blocks(self.numel))


class BucketCodec:
    """Where each rank's pieces lie in a message, and encoding / decoding one (module doc)."""

    def __init__(
        self, plan: ShardPlan, policy: RaggedShard, block_size: int | tuple[int, int] | None
    ) -> None:
        self.shard_numel = plan.shard_numel
        self.world_size = plan.world_size
        #: per rank, its pieces in buffer order
        self.pieces: list[list[Piece]] = [[] for _ in range(plan.world_size)]
        entries = sorted(plan.entries.values(), key=lambda e: e.offset)
        #: the bucket's parameters in buffer order: a poisoned message names one by its index
        self.names = [entry.name for entry in entries]
        for rank, pieces in enumerate(self.pieces):
            scale = 0
            for entry in entries:
                start, end = plan.local_range(entry.name, rank)
                if end == start:
                    continue
                block = quant_block(entry.name, entry.shape, policy, block_size)
                if start % block.unit_numel:
                    raise ValueError(
                        f"parameter {entry.name!r} of shape {list(entry.shape)}: rank {rank}'s "
                        f"shard starts at element {start}, inside a quantization block {block}; "
                        f"plan with StructAwarePlanner(..., compression=...) so units keep "
                        f"blocks whole"
                    )
                local = entry.offset + start - rank * plan.shard_numel
                pieces.append(Piece(entry.name, local, end - start, scale, block))
                scale += block.num_blocks(end - start)
        #: scales each rank's message carries (the rest of its scale slots is padding)
        self.scale_counts = [sum(p.block.num_blocks(p.numel) for p in ps) for ps in self.pieces]
        self.code_bytes = -(-plan.shard_numel // 4) * 4  # the fp32 scales start 4-byte aligned
        self.message_bytes = self.code_bytes + 4 * max(self.scale_counts, default=0)

    def codes(self, message: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The codes of ``message`` (1-D uint8), as ``dtype``: 1-D ``[S]``."""
        return message[: self.shard_numel].view(dtype)

    def scales(self, message: torch.Tensor) -> torch.Tensor:
        """The scales slots of ``message``: 1-D fp32."""
        return message[self.code_bytes : self.message_bytes].view(torch.float32)

    def encode(
        self,
        shard: torch.Tensor,
        rank: int,
        message: torch.Tensor,
        dtype: torch.dtype,
        *,
        residual: torch.Tensor | None = None,
    ) -> None:
        """Quantize rank ``rank``'s shard ``shard`` (1-D ``[S]``) into ``message``;
        ``residual`` (1-D fp32 ``[S]``) receives what quantizing dropped."""
        codes, scales = self.codes(message, dtype), self.scales(message)
        for piece in self.pieces[rank]:
            at = piece.elements
            quantize(
                shard[at],
                piece.block,
                codes[at],
                scales[piece.scales],
                residual=None if residual is None else residual[at],
            )

    def decode(
        self,
        message: torch.Tensor,
        rank: int,
        out: torch.Tensor,
        dtype: torch.dtype,
        *,
        accumulate: bool = False,
    ) -> None:
        """Dequantize rank ``rank``'s ``message`` into its shard's pieces of ``out`` (1-D
        ``[S]``; ``accumulate`` adds instead); elements outside the pieces are left alone."""
        codes, scales = self.codes(message, dtype), self.scales(message)
        for piece in self.pieces[rank]:
            at = piece.elements
            dequantize(codes[at], scales[piece.scales], piece.block, out[at], accumulate=accumulate)

    def seal(self, outgoing: torch.Tensor) -> None:
        """Make a rank's ``W`` messages ``outgoing`` (1-D, one per owner) safe
        to read by every owner: zero their scale padding, and poison them all if a scale is not
        finite ([Note: non-finite gradients])."""
        table = outgoing.view(self.world_size, self.message_bytes)
        scales = table[:, self.code_bytes :].view(torch.float32)  # [W, scale slots]
        for owner, count in enumerate(self.scale_counts):
            scales[owner, count:] = 0.0
        if bool(torch.isfinite(scales).all()):
            return
        bad = next(
            piece
            for owner, pieces in enumerate(self.pieces)
            for piece in pieces
            if not bool(torch.isfinite(scales[owner, piece.scales]).all())
        )
        scales.fill_(float("nan"))
        table[:, :4].view(torch.int32)[:, 0] = self.names.index(bad.name)

    def poisoned_parameter(self, message: torch.Tensor) -> str | None:
        """The parameter a poisoned sealed ``message`` names ([Note: non-finite gradients]), or
        ``None`` when the message is sound."""
        if bool(torch.isfinite(self.scales(message)).all()):
            return None
        return self.names[int(message[:4].view(torch.int32)[0])]

    def non_finite_parameter(self, message: torch.Tensor, rank: int) -> str | None:
        """The first parameter of rank ``rank``'s ``message`` with a block that had a
        non-finite value (its scale is then not finite), or ``None``."""
        scales = self.scales(message)[: self.scale_counts[rank]]
        if bool(torch.isfinite(scales).all()):
            return None
        return next(
            piece.name
            for piece in self.pieces[rank]
            if not bool(torch.isfinite(scales[piece.scales]).all())
        )
