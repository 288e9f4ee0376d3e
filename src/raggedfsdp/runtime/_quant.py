"""Block quantization for compressed communication: DESIGN.md's formulas, vectorised over tiles.

A piece of a parameter is viewed as a 2-D matrix (``QuantBlock.view_shape``) cut into tiles of
``rows x cols``; partial tiles at the right and bottom edges are blocks of their own. The tiles
of one size form at most four rectangular regions (body, right edge, bottom edge, corner), and
each region is a strided 3-D view ``[rows, tiles across, cols]`` of the matrix with its scales
repeated per row, so every formula below is a handful of tensor operations per piece, never a
loop over blocks.

Per block, in fp32: ``amax = max|x|``; ``s = 1`` when ``amax == 0``, else ``amax / code_max``;
codes ``clamp(round(x / s), -127, 127)`` (int8) or ``(x / s).to(fp8)``; dequantized ``q.float()
* s``. ``x / s`` and ``amax / code_max`` are true divisions by tensors on ``x``'s device (CUDA
divides by a host scalar through its reciprocal, which would change bits), so every device and
every world size gives the same codes and scales.
"""

from __future__ import annotations

import functools

import torch

from ..planner import QuantBlock

__all__ = ["CODE_MAX", "dequantize", "quantize"]

#: The largest code magnitude of each code dtype: a block's amax maps onto it.
CODE_MAX: dict[torch.dtype, float] = {
    torch.int8: 127.0,
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}

# (row slice, column slice, tile-row slice, tile-column slice, tile rows, tile columns)
_Region = tuple[slice, slice, slice, slice, int, int]


def _regions(shape: tuple[int, int], block: QuantBlock) -> list[_Region]:
    """The up to four regions of a ``shape`` matrix in which all tiles have one size."""
    rows, cols = shape
    down = _spans(rows, block.rows)
    across = _spans(cols, block.cols)
    return [(rs, cs, ts, us, r, c) for rs, ts, r in down for cs, us, c in across]


def _spans(length: int, step: int) -> list[tuple[slice, slice, int]]:
    """``(elements, tiles, tile size)`` of the whole tiles along one axis, then the partial one."""
    whole, rest = divmod(length, step)
    spans = [(slice(0, whole * step), slice(0, whole), step)] if whole else []
    if rest:
        spans.append((slice(whole * step, length), slice(whole, whole + 1), rest))
    return spans


def _bands(matrix: torch.Tensor, region: _Region) -> torch.Tensor:
    """The region of ``matrix`` as a 3-D view ``[rows, tiles across, c]``: every operation then
    broadcasts a per-row scale over the last dimension only, which is several times faster on
    CPU than broadcasting over ``[tiles down, r, tiles across, c]``."""
    rs, cs, _, _, _, c = region
    part = matrix[rs, cs]
    return part.view(part.shape[0], part.shape[1] // c, c)


def _per_row(grid: torch.Tensor, region: _Region) -> torch.Tensor:
    """The region's scales ``[tiles down, tiles across]`` repeated for each row of its tiles:
    ``[rows, tiles across, 1]`` (1/c of the data)."""
    _, _, ts, us, r, _ = region
    return grid[ts, us].repeat_interleave(r, dim=0)[:, :, None]


@functools.cache
def _code_max(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``CODE_MAX[dtype]`` as a 0-d fp32 tensor on ``device`` (see the module doc)."""
    return torch.tensor(CODE_MAX[dtype], dtype=torch.float32, device=device)


@functools.cache
def _fp8_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The fp32 value of each of the 256 codes of an fp8 dtype: indexing this table gives
    ``codes.float()`` bit for bit, ~7x faster on CPU than the element-wise conversion."""
    return torch.arange(256, dtype=torch.uint8, device=device).view(dtype).float()


def _values(codes: torch.Tensor) -> torch.Tensor:
    """``codes.float()`` (same shape)."""
    if codes.dtype == torch.int8:
        return codes.float()
    table = _fp8_values(codes.dtype, codes.device)
    index = codes.reshape(-1).view(torch.uint8).int()
    return torch.index_select(table, 0, index).view(codes.shape)


def _encode_into(codes: torch.Tensor, y: torch.Tensor) -> None:
    """``codes`` = ``y`` (scaled values, fp32, overwritten) encoded in ``codes``' dtype. In
    place: each full-size temporary costs a pass and page faults on CPU. ``copy_`` casts as
    ``.to`` does (int8: exact on integers in range; fp8: the same rounding)."""
    if codes.dtype == torch.int8:
        torch.round(y, out=y).clamp_(-127, 127)
    codes.copy_(y)


def quantize(
    x: torch.Tensor,
    block: QuantBlock,
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    residual: torch.Tensor | None = None,
) -> None:
    """Quantize the piece ``x`` (1-D, whole blocks of ``block``) into ``codes`` (1-D, same
    numel, the code dtype) and ``scales`` (1-D fp32, one per block, row-major over the tiles).
    ``residual`` (1-D fp32, optional) receives ``x - dequantized``: what quantizing dropped.
    A non-finite value leaves a non-finite scale (the caller names the parameter)."""
    shape = block.view_shape(x.numel())
    matrix = x.view(shape)
    scale_grid = scales.view(block.grid(x.numel()))
    for region in _regions(shape, block):
        bands = _bands(matrix, region).float()  # [rows, tiles across, c]
        low, high = torch.aminmax(bands, dim=2)  # [rows, tiles across]: max|x| without |x|
        row_amax = torch.maximum(low.neg_(), high)
        r = region[4]
        amax = row_amax.view(-1, r, row_amax.shape[1]).amax(dim=1)
        scale_grid[region[2], region[3]] = torch.where(
            amax == 0, 1.0, amax / _code_max(codes.dtype, x.device)
        )
        s = _per_row(scale_grid, region)
        code_bands = _bands(codes.view(shape), region)
        _encode_into(code_bands, bands / s)
        if residual is not None:
            torch.sub(bands, _values(code_bands) * s, out=_bands(residual.view(shape), region))


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block: QuantBlock,
    out: torch.Tensor,
    *,
    accumulate: bool = False,
) -> None:
    """``out = codes.float() * scale`` per block (cast to ``out``'s dtype), or ``out +=`` it
    with ``accumulate``; ``codes`` and ``out`` 1-D of one numel, ``scales`` as :func:`quantize`
    writes them."""
    shape = block.view_shape(codes.numel())
    code_matrix, out_matrix = codes.view(shape), out.view(shape)
    scale_grid = scales.view(block.grid(codes.numel()))
    for region in _regions(shape, block):
        target = _bands(out_matrix, region)
        values = _values(_bands(code_matrix, region))
        if accumulate:
            target.add_(values.mul_(_per_row(scale_grid, region)))
        else:
            torch.mul(values, _per_row(scale_grid, region), out=target)
