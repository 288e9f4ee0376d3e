"""What one rank runs per step, as the cost model sees it: the batch, the dtypes, the settings.

The shape every costing reads (:mod:`.cost`'s bytes, :mod:`.steptime`'s seconds), and the dtype
each system reduces its gradients in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..facts.systems import System
from ..planner.quant_blocks import Compression

__all__ = ["StepShape"]


@dataclass(frozen=True, kw_only=True)
class StepShape:
    """What one rank runs per step. Activations are in ``param_dtype`` (what the blocks compute
    in under mixed precision); the loss in fp32."""

    batch: int  # sequences per rank
    seq_len: int
    master_dtype: torch.dtype = torch.float32
    param_dtype: torch.dtype = torch.float32
    checkpointing: bool = False
    gloo: bool = False  # the Gloo reduce-scatter's receive buffer
    #: compressed communication (raggedfsdp only; units then carry their messages)
    compression: Compression | None = None
    #: CPU offload (``CPUOffloadPolicy``): shards, gradients and optimizer state on the host
    offload: bool = False
    #: the gradients' reduction dtype (``MixedPrecisionPolicy.reduce_dtype``; ``None``:
    #: ``param_dtype``). Another one is a cast of each unit's unsharded gradients while its
    #: reduce-scatter is in flight (raggedfsdp: a pooled block, ``runtime/_comm.py``
    #: ``CastReduceScatter``; FSDP2: its reduce-scatter input), and the Gloo receive buffer and
    #: divisor are in it.
    reduce_dtype: torch.dtype | None = None
    #: ``reshard_after_forward=N`` on every block (``None``: ``True``, the default): after
    #: forward a block keeps a ``1 / N`` piece of its gathered buffer, and backward all-gathers
    #: the pieces within groups of ``N`` consecutive ranks (:meth:`UnitBytes.within`); the root
    #: stays unsharded, as both systems keep it.
    reshard_after_forward: int | None = None

    def __post_init__(self) -> None:
        for name in ("batch", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        n = self.reshard_after_forward
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"reshard_after_forward must be an integer >= 1, got {n!r}")

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def reduce_input_itemsize(self, system: System) -> int:
        """Bytes per element of what ``system``'s plain reduce-scatter reads (and on Gloo
        receives): the gradients' cast to the reduce dtype (:meth:`casts_for_reduce`), or the
        gradients themselves."""
        return (self.reduce_dtype if self.casts_for_reduce(system) else self.param_dtype).itemsize

    def reduce_output_itemsize(self, system: System) -> int:
        """Bytes per element of ``system``'s reduced shard: a compressed reduce-scatter sums
        the dequantized codes in fp32."""
        compression = system.compression(self.compression)
        if compression is not None and compression.reduce_scatter is not None:
            return 4
        return self.reduce_input_itemsize(system)

    def casts_for_reduce(self, system: System) -> bool:
        """Whether ``system`` reduces a cast of the unsharded gradients (held beside them while
        the reduce-scatter is in flight): a reduce dtype other than ``param_dtype``, outside a
        compressed reduce-scatter (which reads the gradients themselves)."""
        compression = system.compression(self.compression)
        if compression is not None and compression.reduce_scatter is not None:
            return False
        return self.reduce_dtype is not None and self.reduce_dtype != self.param_dtype
