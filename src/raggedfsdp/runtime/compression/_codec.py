"""BucketCodec: one bucket's shards as messages of codes and scales.

A rank's *message* is one 1-D byte buffer: its shard's ``S`` one-byte codes at the shard's own
offsets, padded to 16 bytes, then the fp32 scales of its pieces' blocks in buffer order, padded to
the largest count of any rank, the whole padded to 16 bytes (``planner.MessageLayout``). A *piece*
is one parameter's part of one rank's shard: whole blocks, because the planner never cuts one
(checked here). How a bad gradient reaches every rank: [Note: non-finite gradients] at
:class:`BucketCodec`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...layout import RaggedShard
from ...planner import MessageLayout, QuantBlock, ShardPlan, quant_block
from ._quant import Kernels, dequantize, quantize

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


@dataclass(frozen=True)
class _Tables:
    """The codec's layout as small tensors on one device, for finding bad scales there."""

    #: [W, scale slots] bool: True where a slot is padding (beyond its rank's scales), and
    #: where it is not
    padding: torch.Tensor
    valid: torch.Tensor
    #: 1-D int64: where each piece's scales start in the ``[W, slots]`` table, flattened,
    #: ascending (ranks in order, each rank's pieces in buffer order)
    piece_starts: torch.Tensor
    #: 1-D int32: each piece's parameter, its index in :attr:`BucketCodec.names`
    piece_params: torch.Tensor


# A rank's *message* is one 1-D byte buffer: the codes of its whole shard (``S`` one-byte codes, at
# the shard's own offsets, so a parameter's codes sit where its values sit in the bucket) padded to
# 16 bytes, then the fp32 scales of its pieces' blocks in buffer order, padded to the largest count
# of any rank (all messages have one size, so an all-gather or an all-to-all moves them) and the
# whole to 16 bytes (``planner.MessageLayout``: the scales and every message in a buffer of them
# start 16-byte aligned). A *piece* is one parameter's part of one rank's shard: whole quantization
# blocks, because the planner never cuts a block (checked here, so a plan made without the
# compression fails loudly).
#
# [Note: non-finite gradients] A non-finite value in a block leaves a non-finite scale, but in the
# reduce-scatter only the block's owner receives that scale: the other ranks would go on as if
# nothing happened. So the sender seals its messages (:meth:`BucketCodec.seal`): if any of its
# scales is not finite, EVERY message it sends is poisoned (all scale slots NaN, the first four code
# bytes the index of the first bad parameter), decided and written on the device, with no host sync.
# Every rank receives one message from every rank, so every rank sees the poison of the same sender
# (the first in rank order: :meth:`BucketCodec.find_poison`) and raises the same error at the same
# point of its program ([Note: one finiteness check per step] in ``_finite.py``), without an extra
# collective or byte on the wire. Under HSDP the other replica groups receive nothing from the
# poisoned group but its all-reduce: there the poisoned ranks fill their reduced shards with NaN,
# and every rank of every group finds it after the all-reduce
# (:meth:`QuantizedReduceScatter.check_replicated`).
#
# Parameters are named as the bucket's plan names them (below the unit's module); the collectives
# qualify a name with the unit's path when they raise, so the codec is built once and never renamed.
class BucketCodec:
    """Where each rank's pieces lie in a message, and encoding / decoding one (module doc).
    ``kernels`` fixes how the quantizing kernels cut their work (default: the device's,
    ``_quant.Kernels.for_device``); the codes and scales are the same bits either way."""

    def __init__(
        self,
        plan: ShardPlan,
        policy: RaggedShard,
        block_size: int | tuple[int, int] | None,
        *,
        kernels: Kernels | None = None,
    ) -> None:
        self.shard_numel = plan.shard_numel
        self.world_size = plan.world_size
        self.kernels = kernels
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
        layout = MessageLayout(plan.shard_numel, max(self.scale_counts, default=0))
        self.code_bytes = layout.code_bytes  # where the fp32 scales start: 16-byte aligned
        self.message_bytes = layout.message_bytes  # a multiple of 16
        self.scale_slots = layout.scale_slots
        self._tables: dict[torch.device, _Tables] = {}

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
                kernels=self.kernels,
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
            dequantize(
                codes[at],
                scales[piece.scales],
                piece.block,
                out[at],
                accumulate=accumulate,
                kernels=self.kernels,
            )

    # -- non-finite values, found on the device ---------------------------------------------------

    def seal(self, outgoing: torch.Tensor) -> None:
        """Make a rank's ``W`` messages ``outgoing`` (1-D, one per owner) safe to read by
        every owner: zero their scale padding, and poison them all if a scale is not finite
        ([Note: non-finite gradients]). On the device: no host sync."""
        if not self.scale_slots:  # no blocks in the bucket: nothing to quantize or poison
            return
        tables = self._tables_on(outgoing.device)
        table = outgoing.view(self.world_size, self.message_bytes)
        scales = table[:, self.code_bytes :].view(torch.float32)  # [W, scale slots]
        scales.masked_fill_(tables.padding, 0.0)
        bad = torch.isfinite(scales).logical_not_().view(-1)
        poisoned = bad.any()  # 0-d
        # Indices stay 1-element tensors: indexing by a 0-d tensor would read it on the host.
        first = bad.to(torch.uint8).argmax().view(1)  # the first bad slot (0 when none)
        piece = (torch.searchsorted(tables.piece_starts, first, right=True) - 1).clamp_(min=0)
        param = tables.piece_params.index_select(0, piece)  # [1]
        heads = table[:, :4].view(torch.int32)[:, 0]  # the first four code bytes of each
        heads.copy_(torch.where(poisoned, param, heads))
        scales.masked_fill_(poisoned, float("nan"))

    def find_poison(self, received: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Whether one of the sealed ``received`` messages (in rank order) is poisoned (0-d
        bool), and ``[sender, parameter index]`` of the first one (1-D int64, meaningful only
        then): on the device."""
        scales = torch.stack([self.scales(message) for message in received])  # [W, slots]
        poisoned = torch.isfinite(scales).all(dim=1).logical_not_()  # [W]
        sender = poisoned.to(torch.uint8).argmax().view(1)
        heads = torch.stack([message[:4].view(torch.int32)[0] for message in received])  # [W]
        param = heads.index_select(0, sender).to(torch.int64)
        return poisoned.any(), torch.cat([sender, param])

    def parameter_named(self, index: int) -> str:
        """The parameter a poisoned message names by ``index`` (:meth:`find_poison`)."""
        return self.names[index]

    def find_non_finite(self, messages: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Whether a block of the ``W`` ``messages`` (rank ``k``'s at ``k``, as encoded, not
        sealed) had a non-finite value (0-d bool), and the first bad scale slot, flattened
        over ``[W, slots]`` (1-D int64 of one, meaningful only then): on the device."""
        if not self.scale_slots:  # no blocks: nothing can be bad
            device = messages[0].device
            return (
                torch.zeros((), dtype=torch.bool, device=device),
                torch.zeros(1, dtype=torch.int64, device=device),
            )
        valid = self._tables_on(messages[0].device).valid
        scales = torch.stack([self.scales(message) for message in messages])  # [W, slots]
        bad = torch.isfinite(scales).logical_not_().logical_and_(valid).view(-1)
        return bad.any(), bad.to(torch.uint8).argmax().view(1)

    def piece_at(self, slot: int) -> tuple[int, str]:
        """The rank and the parameter of flattened scale slot ``slot`` (:meth:`find_non_finite`)."""
        rank, scale = divmod(slot, self.scale_slots)
        piece = next(p for p in self.pieces[rank] if p.scales.start <= scale < p.scales.stop)
        return rank, piece.name

    def _tables_on(self, device: torch.device) -> _Tables:
        """:class:`_Tables` on ``device``, made once."""
        tables = self._tables.get(device)
        if tables is None:
            slot = torch.arange(self.scale_slots)
            counts = torch.tensor(self.scale_counts, dtype=torch.int64)
            starts, params = [], []
            for rank, pieces in enumerate(self.pieces):
                for piece in pieces:
                    starts.append(rank * self.scale_slots + piece.scale)
                    params.append(self.names.index(piece.name))
            padding = (slot[None, :] >= counts[:, None]).to(device)
            tables = self._tables[device] = _Tables(
                padding=padding,
                valid=padding.logical_not(),
                piece_starts=torch.tensor(starts, dtype=torch.int64, device=device),
                piece_params=torch.tensor(params, dtype=torch.int32, device=device),
            )
        return tables
