"""Block-quantized communication (``CommCompression``): the quantized pair of collective
strategies a bucket may carry ([Note: one strategy per bucket] in ``runtime/_comm.py``).

- :class:`QuantizedAllGather` (``_all_gather``): the parameters travel as codes and scales;
- :class:`QuantizedReduceScatter` (``_reduce_scatter``): so do the gradients, summed in fp32;
- :class:`Residual` (``_error_feedback``): what quantizing a rank's gradient dropped, for the
  next one;
- :class:`BucketCodec` (``_codec``): one bucket's shards as messages of codes and scales;
- :class:`NonFiniteCheck` (``_finite``): what the collectives found non-finite, read by the root
  once at the end of forward and once at the end of backward;
- ``_quant``: docs/design.md's block quantization formulas, vectorised over tiles, kernels cut
  as the device wants (:class:`Kernels`).
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
