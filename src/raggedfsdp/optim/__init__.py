"""Structure-aware optimizers: the same numbers on ragged shards as on one device.

- :class:`Muon`: each matrix orthogonalised whole on a balanced owner rank (bitwise
  ``torch.optim.Muon``), with an auxiliary AdamW for non-matrix parameters.
- :class:`Shampoo`: block Shampoo with Adam grafting; shards hold whole row-blocks, so each rank
  preconditions its own blocks without communication.
- :class:`AdamW8bit`: AdamW with block-wise 8-bit moments whose blocks coincide with shard cuts.

Each is its own single-device reference: given plain (unsharded) parameters it runs on one process
with no process group.
"""

from .adamw8bit import AdamW8bit
from .muon import Muon
from .shampoo import Shampoo

__all__ = ["AdamW8bit", "Muon", "Shampoo"]
