"""Block-quantized communication (``CommCompression``): the quantized pair of collective strategies.

A bucket may carry them ([Note: one strategy per bucket] in ``runtime/_comm.py``):
:class:`QuantizedAllGather` (the parameters travel as codes and scales) and
:class:`QuantizedReduceScatter` (so do the gradients, summed in fp32), with what they share: the
error-feedback :class:`Residual`, the :class:`BucketCodec` (a bucket's messages), the root's
:class:`NonFiniteCheck`, and ``_quant`` (docs/design.md's formulas, kernels cut per device).
"""

from ._all_gather import QuantizedAllGather
from ._codec import BucketCodec, Piece
from ._error_feedback import Residual
from ._finite import Finding, NonFiniteCheck
from ._quant import Kernels
from ._reduce_scatter import QuantizedReduceScatter

__all__ = [
    "BucketCodec",
    "Finding",
    "Kernels",
    "NonFiniteCheck",
    "Piece",
    "QuantizedAllGather",
    "QuantizedReduceScatter",
    "Residual",
]
