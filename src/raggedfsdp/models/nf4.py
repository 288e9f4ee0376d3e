"""A frozen weight in NF4 (QLoRA's 4-bit NormalFloat): two codes a byte, one scale per block.

Torchao's ``NF4Tensor`` layout without its double-quantized scales: half a byte a parameter plus
``4 / block``. It computes as its dequantized value and is frozen (an in-place update is an error;
``copy_`` of plain values quantizes them). It speaks FSDP2's all-gather protocol (codes and scales
travel; ``param_dtype`` is the dtype it dequantizes to) and tells the planner its block, so every
rank holds whole blocks at any W (docs/lora.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["DEFAULT_BLOCK", "NF4_CODE_BOOK", "NF4Weight", "nf4_bytes"]

#: elements per scale, as torchao's ``to_nf4`` (``block_size=64``)
DEFAULT_BLOCK = 64

#: QLoRA's NF4 values (Dettmers et al. 2023, as bitsandbytes and torchao tabulate them)
NF4_CODE_BOOK = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)

#: ops after which the weight keeps its class: views and copies of the same values
_SAME = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def nf4_bytes(numel: int, block: int = DEFAULT_BLOCK) -> tuple[int, int]:
    """Bytes of ``numel`` elements in NF4: ``(codes, scales)``. The capacity model's and the
    class's one formula."""
    return numel // 2, numel // block * 4


class NF4Weight(torch.Tensor):
    """A frozen weight as packed NF4 codes (``uint8``, two elements a byte, the first in the high
    nibble) and fp32 absmax scales (one per ``block`` elements, flat). Its ``dtype`` is the dtype
    it dequantizes to."""

    codes: torch.Tensor
    scales: torch.Tensor
    block: int

    @staticmethod
    def __new__(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        shape: torch.Size,
        block: int,
        dtype: torch.dtype = torch.float32,
    ) -> NF4Weight:
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=codes.device, requires_grad=False
        )

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        shape: torch.Size,
        block: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.codes = codes
        self.scales = scales
        self.block = block

    @property
    def fsdp_block_numel(self) -> int:
        """The planner's block (``raggedfsdp.planner.subclass_blocks``): no rank cuts one."""
        return self.block

    @classmethod
    def quantize(cls, weight: torch.Tensor, block: int = DEFAULT_BLOCK) -> NF4Weight:
        """``weight`` in NF4: each element the nearest code-book value of it over its block's
        absmax. ``ValueError`` unless ``block`` is even and tiles ``weight``."""
        numel = weight.numel()
        if block < 2 or block % 2 or numel % block:
            raise ValueError(
                f"NF4 of a weight of shape {list(weight.shape)} ({numel} elements): the block "
                f"of {block} elements must be even and tile it"
            )
        blocks = weight.detach().float().reshape(-1, block)
        scales = blocks.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny)
        book = torch.tensor(NF4_CODE_BOOK, device=weight.device)
        middles = (book[:-1] + book[1:]) / 2
        index = torch.bucketize(blocks / scales[:, None], middles).to(torch.uint8).reshape(-1)
        codes = (index[0::2] << 4) | index[1::2]
        return cls(codes, scales, weight.shape, block, weight.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The plain weight it stands for, in ``dtype`` (default: its own)."""
        index = torch.stack([self.codes >> 4, self.codes & 15], dim=-1).reshape(-1, self.block)
        book = torch.tensor(NF4_CODE_BOOK, device=self.codes.device)
        values = book[index.long()] * self.scales[:, None]
        return values.reshape(self.shape).to(dtype or self.dtype)

    def _like(self, codes: torch.Tensor, scales: torch.Tensor, **changes: Any) -> NF4Weight:
        shape = changes.get("shape", self.shape)
        return NF4Weight(codes, scales, shape, self.block, changes.get("dtype", self.dtype))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _SAME:
            (t,) = args
            return t._like(t.codes, t.scales)
        if func is torch.ops.aten.clone.default:
            t = args[0]
            return t._like(t.codes.clone(), t.scales.clone())
        if func is torch.ops.aten.slice.Tensor:
            t, dim, start, end = (*args, *[None] * 4)[:4]
            return t._rows(dim or 0, start or 0, end)
        if func is torch.ops.aten.split.Tensor:  # FSDP2's chunks of dim 0
            t, size = args[:2]
            if (args[2] if len(args) > 2 else kwargs.get("dim", 0)) != 0:
                raise ValueError(f"{t!r} splits along dim 0 alone")
            return [t._rows(0, start, start + size) for start in range(0, t.shape[0], size)]
        if func is torch.ops.aten.new_zeros.default:  # FSDP2 pads a shard with it
            t, size = args[:2]
            numel = torch.Size(size).numel()
            zeros = t.codes.new_zeros(numel // 2), t.scales.new_zeros(-(-numel // t.block))
            return t._like(*zeros, shape=torch.Size(size))
        if func is torch.ops.aten.as_strided.default:  # FSDP2's unsharded parameter: itself
            t, size, stride = args[:3]
            offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
            if torch.Size(size) != t.shape or tuple(stride) != t.stride() or offset:
                raise ValueError(f"{t!r} as_strided to {list(size)}, {stride}, {offset}")
            return t._like(t.codes, t.scales)
        if func is torch.ops.aten.view.default:  # the same elements, row-major
            t, size = args[:2]
            shape = torch.Size(size if -1 not in size else [t.numel()])
            if shape.numel() != t.numel():
                raise ValueError(f"a view of {t!r} as {list(size)}")
            return t._like(t.codes, t.scales, shape=shape)
        if func is torch.ops.aten._to_copy.default:
            t = args[0]
            device = kwargs.get("device") or t.device
            dtype = kwargs.get("dtype") or t.dtype
            return t._like(t.codes.to(device), t.scales.to(device), dtype=dtype)
        if func is torch.ops.aten.copy_.default and isinstance(args[0], cls):
            return args[0]._copy_from(args[1])
        if func._schema.is_mutable and isinstance(args[0], cls):
            raise TypeError(
                f"NF4Weight is a frozen weight: {func} would update a dequantized copy of it; "
                f"keep it out of the optimizer (requires_grad=False)"
            )
        plain = pytree.tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*plain[0], **plain[1])

    def _copy_from(self, src: torch.Tensor) -> NF4Weight:
        """``copy_``: another NF4 weight's codes and scales, or plain values quantized (as
        torchao's NF4 takes them: a checkpoint's dequantized values load back bit for bit)."""
        if src.shape != self.shape:
            raise ValueError(f"copy_ of a tensor of shape {list(src.shape)} into {self!r}")
        if not isinstance(src, NF4Weight) or src.block != self.block:
            src = NF4Weight.quantize(src.to(self.device), self.block)
        self.codes.copy_(src.codes)
        self.scales.copy_(src.scales)
        return self

    def _rows(self, dim: int, start: int, end: int | None) -> NF4Weight:
        """Rows ``[start, end)``: whole blocks of the codes and scales, or ``ValueError``."""
        rows = self.shape[0]
        end = rows if end is None else min(end, rows)
        row = self.shape[1:].numel()
        lo, hi = start * row, end * row
        if dim != 0 or lo % self.block or (hi % self.block and end != rows):
            raise ValueError(
                f"rows [{start}, {end}) of {list(self.shape)} cut a {self.block}-block"
            )
        shape = torch.Size((end - start, *self.shape[1:]))
        codes = self.codes[lo // 2 : hi // 2]
        return self._like(codes, self.scales[lo // self.block : hi // self.block], shape=shape)

    def __tensor_flatten__(self) -> tuple[list[str], tuple[torch.Size, int, torch.dtype]]:
        return ["codes", "scales"], (self.shape, self.block, self.dtype)

    @classmethod
    def __tensor_unflatten__(cls, inner: dict, meta: Any, size: Any, stride: Any) -> NF4Weight:
        shape, block, dtype = meta
        return cls(inner["codes"], inner["scales"], shape, block, dtype)

    def fsdp_pre_all_gather(self, mesh: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """FSDP2's protocol: this shard's codes and scales are what travel."""
        return (self.codes, self.scales), None

    def fsdp_post_all_gather(
        self,
        outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """Every rank's codes and scales (concatenated) -> the whole weight, dequantizing to
        ``param_dtype`` (mixed precision's, as torchao's NF4); ``out``: refill the earlier one."""
        codes, scales = outputs
        if out is not None:
            assert isinstance(out, NF4Weight), type(out)
            out.codes.copy_(codes)
            out.scales.copy_(scales)
            return None
        rows = 2 * codes.numel() // self.shape[1:].numel()
        shape = torch.Size((rows, *self.shape[1:]))
        return NF4Weight(codes, scales, shape, self.block, param_dtype), (codes, scales)

    def __repr__(self) -> str:
        return f"NF4Weight(shape={list(self.shape)}, block={self.block}, dtype={self.dtype})"


# A checkpoint holds NF4Weight shards; torch.load's weights-only unpickler must know the class
# (as torchao registers NF4Tensor).
torch.serialization.add_safe_globals([NF4Weight])
