"""AdamW with block-wise 8-bit moments whose blocks coincide with the shard cuts.

Each moment is stored as one uint8 code per element plus one fp32 scale (the block's absmax) per
block; a code indexes a 256-value dynamic map (bitsandbytes' dynamic data type, Dettmers 2015, arXiv
1511.04561): signed for the first moment, unsigned for the second. A step dequantizes, runs torch's
AdamW arithmetic in fp32, and requantizes to the nearest map value. The blocks, and why a rank's
codes are the single-device ones: the comment at :class:`AdamW8bit`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..layout import ShardLayout, row_numel
from ..tensor import global_shape, shard_info
from ._common import Pieces, ShardedOptimizer, advance_steps, check_betas, check_block_cuts, local

__all__ = ["AdamW8bit", "dequantize_blocks", "dynamic_map", "quantize_blocks"]


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 sorted fp32 values of bitsandbytes' ``create_dynamic_map(signed, 7, 8)``.

    For each decade ``i = 0..6`` the values are ``10^(i-6)`` times the midpoints of
    ``linspace(0.1, 1, k + 1)``, with ``k = 2^i`` (signed: mirrored to negative values too) or
    ``k = 2^(i+1)`` (unsigned, which spends the sign bit on precision); then 0 and 1. That is
    127 + 127 + 2 = 256 signed values in [-1, 1] and 254 + 2 = 256 unsigned values in [0, 1], dense
    near 0 where most optimizer-moment magnitudes lie after absmax scaling.
    """
    values = [torch.tensor([0.0, 1.0])]
    for i in range(7):
        count = 2**i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1.0, count + 1, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 6)
        values += [means, -means] if signed else [means]
    return torch.cat(values).sort().values


_SIGNED_MAP = dynamic_map(signed=True)  # first moment
_UNSIGNED_MAP = dynamic_map(signed=False)  # second moment (never negative)


def _untiled(tiles: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The ``[rows, cols]`` matrix of a padded ``[tile_rows, r, tile_cols, c]`` tiling."""
    tile_rows, r, tile_cols, c = tiles.shape
    return tiles.reshape(tile_rows * r, tile_cols * c)[:rows, :cols]


def _tiled(x2d: torch.Tensor, block_shape: tuple[int, int]) -> torch.Tensor:
    """``x2d`` zero-padded to whole tiles and viewed as ``[tile_rows, r, tile_cols, c]``."""
    rows, cols = x2d.shape
    r, c = block_shape
    pad_rows, pad_cols = -rows % r, -cols % c
    if pad_rows or pad_cols:
        x2d = F.pad(x2d, (0, pad_cols, 0, pad_rows))
    return x2d.reshape((rows + pad_rows) // r, r, (cols + pad_cols) // c, c)


def quantize_blocks(
    x2d: torch.Tensor, block_shape: tuple[int, int], qmap: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8, ``x2d``'s shape) and per-tile absmax scales (fp32 ``[tile_rows,
    tile_cols]``) of ``x2d``: each value becomes the index of the nearest value of ``qmap`` after
    dividing by its tile's absmax (zero padding of edge tiles leaves the absmax unchanged)."""
    tiles = _tiled(x2d.float(), block_shape)
    scales = tiles.abs().amax(dim=(1, 3))
    # An all-zero tile has scale 0; dividing by 1 instead keeps its codes at the map's zero.
    normalized = tiles / torch.where(scales > 0, scales, 1.0)[:, None, :, None]
    codes = _on_device(qmap, x2d.device).nearest(normalized)
    return _untiled(codes, *x2d.shape).contiguous(), scales


class _NearestCode:
    """``bucketize(x, midpoints)`` of a 256-value map, exactly, without a binary search.

    [Note: nearest code by table] A float32's bit pattern, flipped for negatives, is an integer
    key in the floats' own order, so the top 16 bits of the key split the real line into 65,536
    ordered cells. A table gives, per cell, how many midpoints lie in lower cells: every one of
    those is below ``x``. The few midpoints inside ``x``'s own cell (at most one for the dynamic
    maps) are compared directly. The result equals ``torch.bucketize`` bit for bit (tested on
    every midpoint and its float neighbours) at 2-3x its speed, which dominated the step.
    """

    def __init__(self, qmap: torch.Tensor, device: torch.device) -> None:
        qmap = qmap.to(device=device, dtype=torch.float32)
        self.midpoints = (qmap[:-1] + qmap[1:]) / 2  # 1-D [255], sorted
        cells = _cell(self.midpoints)
        every_cell = torch.arange(1 << 16, dtype=torch.int64, device=device)
        self.below = torch.searchsorted(cells, every_cell).to(torch.int32)  # [65536]
        self.per_cell = int(torch.bincount(cells, minlength=1 << 16).max())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        code = _lookup(self.below, _cell(x))
        last = self.midpoints.numel() - 1
        for _ in range(self.per_cell):
            nxt = _lookup(self.midpoints, code.clamp(max=last))
            code += ((code <= last) & (nxt < x)).to(torch.int32)
        return code.to(torch.uint8)


@dataclass(frozen=True)
class _MapOnDevice:
    """A code map as one device computes with it."""

    values: torch.Tensor  # the map's 256 fp32 values, on the device
    nearest: _NearestCode  # its nearest-code table, on the device


#: The optimizer's two maps on each device they were used on, by (map identity, device):
#: made once, as a step would otherwise pay a blocking host-to-device copy of each map per
#: parameter and moment (and a host read to build the table).
_ON_DEVICE: dict[tuple[int, torch.device], _MapOnDevice] = {}


def _on_device(qmap: torch.Tensor, device: torch.device) -> _MapOnDevice:
    """``qmap`` on ``device``: cached for the optimizer's two maps, made afresh for others (a
    caller's own map, which the cache would keep alive)."""
    key = (id(qmap), device)
    cached = _ON_DEVICE.get(key)
    if cached is None:
        cached = _MapOnDevice(qmap.to(device, torch.float32), _NearestCode(qmap, device))
        if qmap is _SIGNED_MAP or qmap is _UNSIGNED_MAP:
            _ON_DEVICE[key] = cached
    return cached


def _lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for a 1-D table, in ``index``'s shape."""
    return torch.index_select(table, 0, index.reshape(-1).long()).view(index.shape)


def _cell(x: torch.Tensor) -> torch.Tensor:
    """Which of 2^16 ordered cells of the float32 line each value of ``x`` falls in."""
    bits = x.contiguous().view(torch.int32)
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # monotone in the value
    return ((key >> 16) + (1 << 15)).long()


def dequantize_blocks(
    codes: torch.Tensor, scales: torch.Tensor, block_shape: tuple[int, int], qmap: torch.Tensor
) -> torch.Tensor:
    """The fp32 values of :func:`quantize_blocks`' output (``codes``' shape)."""
    # index_select: a 1-D gather, several times faster on CPU than advanced indexing.
    values = _lookup(_on_device(qmap, codes.device).values, codes)
    tiles = _tiled(values, block_shape).mul_(scales[:, None, :, None])
    return _untiled(tiles, *codes.shape)


# Blocks are 256-element runs of the flattened tensor (``block_numel``), or, with ``block_shape=(r,
# c)``, ``r × c`` tiles of the parameter's ``[rows, row_len]`` matrix view (the 32×32 tiles of
# veScale's 8-bit Adam). A partial last block (or edge tile) is kept as a smaller block.
#
# Sharding: when every rank boundary of a parameter falls on a multiple of ``block_numel`` elements
# (flat) or of ``r`` rows (tiles), each rank's piece is a run of whole global blocks, so quantizing
# its piece locally produces exactly the global codes and scales it holds: codes, scales and
# parameters are bitwise the single-device ones for any world size. A layout that cuts a block is a
# ``ValueError``. Whether a parameter is quantized at all is decided from its *global* numel
# (torchao and bitsandbytes decide from the local shard, so the mesh changes the maths: ao#4912,
# bnb#2080).
class AdamW8bit(ShardedOptimizer):
    """AdamW whose moments are block-wise 8-bit; single-device and sharded alike.

    Args:
        params: parameters or param groups (sharded pieces or plain tensors).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay).
        block_numel: elements per quantization block of the flattened tensor.
        block_shape: ``(rows, cols)`` tiles of each >= 2-D parameter's ``[rows, row_len]`` view
            instead of flat blocks (0-D/1-D parameters keep flat blocks of ``block_numel``).
        min_8bit_numel: parameters whose GLOBAL numel is below this keep fp32 moments (and get
            exactly ``torch.optim.AdamW``'s update).
        skip_nonfinite: skip a step with a NaN/Inf gradient on every rank (else raise).

    State of a quantized parameter: ``step``; ``exp_avg_codes``, ``exp_avg_sq_codes`` (uint8,
    shaped and placed like the parameter); ``exp_avg_scales``, ``exp_avg_sq_scales`` (fp32
    ``[tile_rows, tile_cols]``; ``[1, blocks]`` for flat blocks; of a sharded parameter, placed
    by :meth:`sharded_state_layout`: this rank holds its blocks' rows). Other parameters have
    ``torch.optim.AdamW``'s state. A sharded parameter's state is RaggedTensors ([Note:
    optimizer state across world sizes]).
    """

    _KEEP_DTYPE_STATE_KEYS = (
        "exp_avg_codes",
        "exp_avg_scales",
        "exp_avg_sq_codes",
        "exp_avg_sq_scales",
    )

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        block_numel: int = 256,
        block_shape: tuple[int, int] | None = None,
        min_8bit_numel: int = 4096,
        skip_nonfinite: bool = True,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "block_numel": block_numel,
            "block_shape": None if block_shape is None else tuple(block_shape),
            "min_8bit_numel": min_8bit_numel,
        }
        super().__init__(params, defaults, skip_nonfinite=skip_nonfinite)

    def _check_group(self, group: dict[str, Any], group_index: int) -> None:
        super()._check_group(group, group_index)
        where = f"param group {group_index}"
        check_betas(group["betas"], f"{where}: betas")
        if not group["eps"] >= 0:
            raise ValueError(f"{where}: eps must be >= 0, got {group['eps']}")
        if not (isinstance(group["block_numel"], int) and group["block_numel"] >= 1):
            raise ValueError(
                f"{where}: block_numel must be an integer >= 1, got {group['block_numel']!r}"
            )
        shape = group["block_shape"]
        if shape is not None and not (
            len(shape) == 2 and all(isinstance(s, int) and s >= 1 for s in shape)
        ):
            raise ValueError(
                f"{where}: block_shape must be None or two integers >= 1, got {shape!r}"
            )
        if not (isinstance(group["min_8bit_numel"], int) and group["min_8bit_numel"] >= 0):
            raise ValueError(
                f"{where}: min_8bit_numel must be an integer >= 0, got {group['min_8bit_numel']!r}"
            )
        for index, p in enumerate(group["params"]):
            info = shard_info(p)
            geometry = _geometry(p, group)
            if info is None or geometry is None:
                continue
            cols, (r, c) = geometry
            label = self.param_label(group, index, group_index)
            if cols is None:
                stride, block = c, f"AdamW8bit's blocks of {c} elements (block_numel={c})"
            else:
                stride, block = r * cols, f"AdamW8bit's {r}×{c} tiles (block_shape=({r}, {c}))"
            check_block_cuts(
                label,
                info.layout,
                stride,
                block,
                f"Shard it in whole multiples of {stride} elements, e.g. with "
                f"StructAwarePlanner(optimizer_type='adamw8bit').",
            )

    def sharded_state_layout(self, param: torch.Tensor, key: str) -> ShardLayout | None:
        """The base rules, and for the ``*_scales`` of a quantized sharded parameter the layout
        of its global scales, in which this rank holds those of its own blocks (so a checkpoint
        reshards them with their blocks; codes are param-shaped)."""
        layout = super().sharded_state_layout(param, key)
        if layout is None or not key.endswith("_scales"):
            return layout
        group = next(g for g in self.param_groups if any(p is param for p in g["params"]))
        geometry = _geometry(param, group)
        if geometry is None:
            raise ValueError(
                f"AdamW8bit state {key!r} is that of a quantized parameter, but "
                f"{self._label_of(param)} has fewer than min_8bit_numel="
                f"{group['min_8bit_numel']} elements and keeps fp32 moments"
            )
        cols, (r, c) = geometry
        shape = layout.global_shape
        if cols is None:  # flat blocks: scales are [1, blocks]
            per_block, col_tiles, rows_total = c, 1, math.prod(shape)
        else:  # tiles of the [rows, cols] view: scales are [tile_rows, tile_cols]
            per_block, col_tiles, rows_total = r * cols, -(-cols // c), math.prod(shape) // cols
        rows_or_blocks = -(-math.prod(shape) // per_block)
        global_scales = (1, rows_or_blocks) if cols is None else (-(-rows_total // r), col_tiles)
        ranges = []
        for start, end in layout.ranges:
            # Interior cuts are block multiples; only the parameter's end may cut a partial block.
            first = -(-start // per_block) if start == end else start // per_block
            ranges.append((first * col_tiles, -(-end // per_block) * col_tiles))
        return ShardLayout(torch.Size(global_scales), col_tiles, tuple(ranges))

    def _update(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            self._adamw_update(group, [p for p in params if _geometry(p, group) is None])
            quantized = [(p, g) for p in params if (g := _geometry(p, group)) is not None]
            pieces = [
                self._pieces(p, functools.partial(self._quantized_state, geometry=g))
                for p, g in quantized
            ]
            steps = advance_steps([x.state["step"] for x in pieces])
            for x, (_, geometry), step in zip(pieces, quantized, steps, strict=True):
                _update_quantized(x, group, *geometry, step)

    def _quantized_state(
        self, p: torch.Tensor, geometry: tuple[int | None, tuple[int, int]]
    ) -> dict[str, Any]:
        """The state of a new quantized parameter: both moments zero."""
        cols, tile = geometry
        state: dict[str, Any] = {"step": torch.tensor(0.0)}
        piece = local(p)
        zeros = torch.zeros(piece.shape, dtype=torch.float32, device=piece.device)
        for key, qmap in (("exp_avg", _SIGNED_MAP), ("exp_avg_sq", _UNSIGNED_MAP)):
            codes, scales = quantize_blocks(zeros.view(_blocks_view(cols)), tile, qmap)
            state[f"{key}_codes"] = self._placed(p, f"{key}_codes", codes.view(piece.shape))
            state[f"{key}_scales"] = self._placed(p, f"{key}_scales", scales)
        return state


def _blocks_view(cols: int | None) -> tuple[int, int]:
    """A piece as the blocks see it: one row of flat blocks, or ``[rows, row_len]``."""
    return (1, -1) if cols is None else (-1, cols)


def _update_quantized(
    pieces: Pieces, group: dict[str, Any], cols: int | None, tile: tuple[int, int], step: float
) -> None:
    """One step of a quantized parameter (its ``step``-th) on this rank's pieces."""
    piece, grad, state = pieces
    view = _blocks_view(cols)
    beta1, beta2 = group["betas"]
    lr = group["lr"]
    exp_avg = dequantize_blocks(
        state["exp_avg_codes"].view(view), state["exp_avg_scales"], tile, _SIGNED_MAP
    )
    exp_avg_sq = dequantize_blocks(
        state["exp_avg_sq_codes"].view(view), state["exp_avg_sq_scales"], tile, _UNSIGNED_MAP
    )
    grad = grad.float().view(view)
    # torch.optim.AdamW's single-tensor arithmetic, in fp32.
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    param = piece.float().view(view)  # the piece itself when it is fp32
    param.mul_(1 - lr * group["weight_decay"])
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(group["eps"])
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    if param.data_ptr() != piece.data_ptr():
        piece.copy_(param.view(piece.shape))
    for key, value, qmap in (
        ("exp_avg", exp_avg, _SIGNED_MAP),
        ("exp_avg_sq", exp_avg_sq, _UNSIGNED_MAP),
    ):
        codes, scales = quantize_blocks(value, tile, qmap)
        # Into the state's own tensors: a sharded state's pieces stay where DCP finds them.
        state[f"{key}_codes"].copy_(codes.view(piece.shape))
        state[f"{key}_scales"].copy_(scales)


def _geometry(p: torch.Tensor, group: dict[str, Any]) -> tuple[int | None, tuple[int, int]] | None:
    """How ``p``'s moments are blocked: ``(row_len, block_shape)`` for tiles of its
    ``[rows, row_len]`` view, ``(None, (1, block_numel))`` for flat blocks, or ``None`` when the
    parameter is too small (by GLOBAL numel) to quantize."""
    shape = global_shape(p)
    if math.prod(shape) < group["min_8bit_numel"]:
        return None
    if group["block_shape"] is not None and len(shape) >= 2:
        return row_numel(shape), group["block_shape"]
    return None, (1, group["block_numel"])
