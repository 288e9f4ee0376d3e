"""Block quantization for compressed communication: DESIGN.md's formulas, vectorised over tiles.

A piece of a parameter is viewed as a 2-D matrix (``QuantBlock.view_shape``) cut into tiles of
``rows x cols``; partial tiles at the right and bottom edges are blocks of their own. The tiles
of one size form at most four rectangular regions (body, right edge, bottom edge, corner), and
each region is a strided 4-D view ``[tiles down, rows, tiles across, cols]`` of the matrix, so
every formula below is a handful of tensor operations per piece, never a loop over blocks.

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


def _tiles(matrix: torch.Tensor, region: _Region) -> torch.Tensor:
    """The region of ``matrix`` as a 4-D view ``[tiles down, r, tiles across, c]``."""
    rs, cs, _, _, r, c = region
    part = matrix[rs, cs]
    return part.view(part.shape[0] // r, r, part.shape[1] // c, c)


@functools.cache
def _code_max(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``CODE_MAX[dtype]`` as a 0-d fp32 tensor on ``device`` (see the module doc)."""
    return torch.tensor(CODE_MAX[dtype], dtype=torch.float32, device=device)


def _encode(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.int8:
        return torch.round(y).clamp_(-127, 127).to(torch.int8)
    return y.to(dtype)


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
    code_matrix = codes.view(shape)
    down, across = block.grid(x.numel())
    scale_grid = scales.view(down, across)
    for region in _regions(shape, block):
        tiles = _tiles(matrix, region).float()
        amax = tiles.abs().amax(dim=(1, 3))
        scale = torch.where(amax == 0, 1.0, amax / _code_max(codes.dtype, x.device))
        s = scale[:, None, :, None]
        q = _encode(tiles / s, codes.dtype)
        _tiles(code_matrix, region).copy_(q)
        scale_grid[region[2], region[3]] = scale
        if residual is not None:
            _tiles(residual.view(shape), region).copy_(tiles - q.float() * s)


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
        values = (
            _tiles(code_matrix, region).float() * scale_grid[region[2], region[3]][:, None, :, None]
        )
        target = _tiles(out_matrix, region)
        if accumulate:
            target.add_(values)
        else:
            target.copy_(values)
