"""Structure-aware optimizers: the same numbers on ragged shards as on one device.

:class:`Muon` (each matrix orthogonalised whole on a balanced owner rank, bitwise
``torch.optim.Muon``, with an auxiliary AdamW), :class:`Shampoo` (block Shampoo with Adam grafting;
shards hold whole row-blocks, no communication) and :class:`AdamW8bit` (block-wise 8-bit moments
whose blocks coincide with shard cuts). Each is its own single-device reference: given plain
parameters it runs on one process with no process group.
"""

from .adamw8bit import AdamW8bit
from .muon import Muon
from .shampoo import Shampoo

__all__ = ["AdamW8bit", "Muon", "Shampoo"]
