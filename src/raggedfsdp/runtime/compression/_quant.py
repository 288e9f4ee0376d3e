"""Block quantization for compressed communication (docs/design.md), vectorised over tiles.

A piece of a parameter is viewed as a 2-D matrix (``QuantBlock.view_shape``) cut into tiles of
``rows x cols``, partial edge tiles blocks of their own; the tiles of one size form at most four
rectangular regions, cut into chunks of whole tiles (:class:`Kernels`, [Note: codec kernels per
device]), each a strided 3-D view of the matrix, so every formula is a handful of tensor operations
per chunk, never a loop over blocks. The numbers: the comment at :func:`quantize`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...planner import QuantBlock

__all__ = ["CHUNK", "CODE_MAX", "DEVICE_CHUNK", "Kernels", "dequantize", "quantize"]

#: The largest code magnitude of each code dtype: a block's amax maps onto it.
CODE_MAX: dict[torch.dtype, float] = {
    torch.int8: 127.0,
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}

# (row slice, column slice, tile-row slice, tile-column slice, tile rows, tile columns)
_Region = tuple[slice, slice, slice, slice, int, int]


#: Elements of the largest region processed at once on the CPU (1 MiB of fp32): a region's
#: temporaries then come from one reused scratch buffer (:func:`_scratch`), and its passes over
#: memory (|x|, x / s, rounding, encoding) hit the CPU's L2 cache instead of main memory.
CHUNK = 1 << 18
#: The same on an accelerator: large enough that a chunk is a whole piece of all but the
#: largest parameters, small enough to bound the fp32 scratch (64 MiB) ([Note: codec kernels
#: per device]).
DEVICE_CHUNK = 1 << 24


# [Note: codec kernels per device] How the regions are cut is the device's business, never the
# numbers': every operation is element-wise or a maximum within one tile, so any cut into whole
# tiles gives the same bits (``tests/unit/test_quant.py`` checks both shapes against a
# block-by-block reference). On the CPU a region is cut into chunks of :data:`CHUNK` elements (1 MiB
# of fp32), so its five passes over memory hit the L2 cache. On an accelerator that chunking would
# launch ~10 kernels per 2^18 elements (about half a million per step for a 7B model at W = 8), each
# too small to fill the device; there a chunk is :data:`DEVICE_CHUNK` = 2^24 elements, so a piece of
# a parameter is one pass per region for every matrix up to 4096 x 4096 (one region, ~10 kernels)
# and a few for larger ones, while the fp32 scratch stays at 64 MiB however large the piece (one
# pass per *bucket* would need a per-element block index as large as the codes, or a compiled kernel
# per bucket layout). fp8 codes become fp32 through a 256-entry table on the CPU (~7x faster than
# the conversion there) and by the conversion itself on accelerators (one fused kernel instead of an
# int32 index and a gather); both are exact.
@dataclass(frozen=True)
class Kernels:
    """How the codec's kernels cut their work on one kind of device ([Note: codec kernels per
    device]); the codes and scales do not depend on it."""

    #: elements of the largest chunk of a region processed at once
    chunk: int
    #: fp8 codes become fp32 through a 256-entry table (else by conversion)
    fp8_table: bool

    @staticmethod
    def for_device(device: torch.device | str) -> Kernels:
        """The CPU's shape (cache-sized chunks, the table) or an accelerator's (large chunks,
        conversion). Read at each call, so :data:`CHUNK` may be patched (tests)."""
        if torch.device(device).type == "cpu":
            return Kernels(chunk=CHUNK, fp8_table=True)
        return Kernels(chunk=DEVICE_CHUNK, fp8_table=False)


def _regions(shape: tuple[int, int], block: QuantBlock, chunk: int) -> list[_Region]:
    """The regions of a ``shape`` matrix in which all tiles have one size (body, right edge,
    bottom edge, corner), each cut into whole tiles of at most ``chunk`` elements."""
    rows, cols = shape
    across = _spans(cols, block.cols, max(1, chunk // (block.rows * block.cols)))
    width = max((cs.stop - cs.start for cs, _, _ in across), default=0)
    down = _spans(rows, block.rows, max(1, chunk // max(1, block.rows * width)))
    return [(rs, cs, ts, us, r, c) for rs, ts, r in down for cs, us, c in across]


def _spans(length: int, step: int, group: int) -> list[tuple[slice, slice, int]]:
    """``(elements, tiles, tile size)`` along one axis: the whole tiles in runs of at most
    ``group`` tiles, then the partial one."""
    whole, rest = divmod(length, step)
    spans = [
        (slice(t * step, min(t + group, whole) * step), slice(t, min(t + group, whole)), step)
        for t in range(0, whole, group)
    ]
    if rest:
        spans.append((slice(whole * step, length), slice(whole, whole + 1), rest))
    return spans


_SCRATCH: dict[torch.device, torch.Tensor] = {}


def _scratch(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """A contiguous fp32 tensor of ``shape`` in a buffer reused by every call on ``device``
    (:data:`CHUNK` elements, more for a larger region: a single tile larger than that on the
    CPU, a region of up to :data:`DEVICE_CHUNK` elements on an accelerator): no allocation (and
    no page faults) per region. Its contents are garbage; callers are not re-entrant (the
    compute thread only)."""
    numel = shape.numel()
    buffer = _SCRATCH.get(device)
    if buffer is None or buffer.numel() < numel:
        size = max(numel, CHUNK)
        buffer = _SCRATCH[device] = torch.empty(size, dtype=torch.float32, device=device)
    return buffer[:numel].view(shape)


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
    scales = grid[ts, us]
    return (scales if r == 1 else scales.repeat_interleave(r, dim=0))[:, :, None]


@functools.cache
def _code_max(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``CODE_MAX[dtype]`` as a 0-d fp32 tensor on ``device`` (see the module doc)."""
    return torch.tensor(CODE_MAX[dtype], dtype=torch.float32, device=device)


@functools.cache
def _fp8_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The fp32 value of each of the 256 codes of an fp8 dtype: indexing this table gives
    ``codes.float()`` bit for bit, ~7x faster on CPU than the element-wise conversion."""
    return torch.arange(256, dtype=torch.uint8, device=device).view(dtype).float()


def _values_into(out: torch.Tensor, codes: torch.Tensor, kernels: Kernels) -> torch.Tensor:
    """``out = codes.float()`` (``out``: contiguous fp32 of ``codes``' shape); returns ``out``."""
    if codes.dtype == torch.int8 or not kernels.fp8_table:
        return out.copy_(codes)
    table = _fp8_values(codes.dtype, codes.device)
    index = codes.reshape(-1).view(torch.uint8).int()
    torch.index_select(table, 0, index, out=out.view(-1))
    return out


def _encode_into(codes: torch.Tensor, y: torch.Tensor) -> None:
    """``codes`` = ``y`` (scaled values, fp32, overwritten) encoded in ``codes``' dtype. In
    place: each full-size temporary costs a pass and page faults on CPU. ``copy_`` casts as
    ``.to`` does (int8: exact on integers in range; fp8: the same rounding)."""
    if codes.dtype == torch.int8:
        torch.round(y, out=y).clamp_(-127, 127)
    codes.copy_(y)


# Per block, in fp32: ``amax = max|x|``; ``s = 1`` when ``amax == 0``, else ``amax / code_max``;
# codes ``clamp(round(x / s), -127, 127)`` (int8) or ``(x / s).to(fp8)``; dequantized ``q.float() *
# s``. ``x / s`` and ``amax / code_max`` are true divisions by tensors on ``x``'s device (CUDA
# divides by a host scalar through its reciprocal, which would change bits), so every device and
# every world size gives the same codes and scales.
def quantize(
    x: torch.Tensor,
    block: QuantBlock,
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    residual: torch.Tensor | None = None,
    kernels: Kernels | None = None,
) -> None:
    """Quantize the piece ``x`` (1-D, whole blocks of ``block``) into ``codes`` (1-D, same
    numel, the code dtype) and ``scales`` (1-D fp32, one per block, row-major over the tiles).
    ``residual`` (1-D fp32, optional) receives ``x - dequantized``: what quantizing dropped.
    A non-finite value leaves a non-finite scale (the caller names the parameter).
    ``kernels``: how to cut the work (default: ``x``'s device's; the bits are the same)."""
    kernels = kernels or Kernels.for_device(x.device)
    shape = block.view_shape(x.numel())
    matrix = x.view(shape)
    scale_grid = scales.view(block.grid(x.numel()))
    for region in _regions(shape, block, kernels.chunk):
        bands = _bands(matrix, region).float()  # [rows, tiles across, c]
        # One fp32 scratch takes |x|, then x / s, then the dequantized values: no temporary
        # (and abs then amax is ~4x faster on CPU than aminmax).
        y = torch.abs(bands, out=_scratch(bands.shape, x.device))
        row_amax = y.amax(dim=2)  # [rows, tiles across]
        r = region[4]
        amax = row_amax if r == 1 else row_amax.view(-1, r, row_amax.shape[1]).amax(dim=1)
        # s = amax / code_max, and 1 where amax == 0 (written in place: a view of ``scales``)
        grid = torch.div(amax, _code_max(codes.dtype, x.device), out=scale_grid[region[2:4]])
        grid.masked_fill_(amax == 0, 1.0)
        s = _per_row(scale_grid, region)
        code_bands = _bands(codes.view(shape), region)
        _encode_into(code_bands, torch.div(bands, s, out=y))
        if residual is not None:
            _values_into(y, code_bands, kernels)
            torch.sub(bands, y.mul_(s), out=_bands(residual.view(shape), region))


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block: QuantBlock,
    out: torch.Tensor,
    *,
    accumulate: bool = False,
    kernels: Kernels | None = None,
) -> None:
    """``out = codes.float() * scale`` per block (cast to ``out``'s dtype), or ``out +=`` it
    with ``accumulate``; ``codes`` and ``out`` 1-D of one numel, ``scales`` as :func:`quantize`
    writes them; ``kernels`` as there."""
    kernels = kernels or Kernels.for_device(out.device)
    shape = block.view_shape(codes.numel())
    code_matrix, out_matrix = codes.view(shape), out.view(shape)
    scale_grid = scales.view(block.grid(codes.numel()))
    for region in _regions(shape, block, kernels.chunk):
        target = _bands(out_matrix, region)
        code_bands = _bands(code_matrix, region)
        s = _per_row(scale_grid, region)
        if not accumulate and target.dtype == torch.float32 and target.is_contiguous():
            _values_into(target, code_bands, kernels).mul_(s)  # in place: no temporary
            continue
        values = _values_into(_scratch(code_bands.shape, out.device), code_bands, kernels)
        if accumulate:
            target.add_(values.mul_(s))
        else:
            torch.mul(values, s, out=target)
