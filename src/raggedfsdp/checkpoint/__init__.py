"""Checkpoint state of sharded models and their optimizers, for ``torch.distributed.checkpoint``.

Offers :func:`full_state_dict` (the unwrapped model's state, full, on every rank) and the
optimizer's state keyed by parameter FQN (:func:`optim_state_dict`,
:func:`load_optim_state_dict`, :func:`init_optimizer_state`). A sharded model's own
``state_dict()`` is reshardable already (its hooks live in the runtime), and so is an
optimizer's: the state of sharded parameters is DTensors. (torch's own
``torch.distributed.checkpoint.state_dict`` over ragged shards: ``tensor/_torch_dsd.py``.)
"""

from ._model_state import full_state_dict
from ._optim_state import (
    expected_entries,
    init_optimizer_state,
    load_optim_state_dict,
    optim_state_dict,
)

__all__ = [
    "expected_entries",
    "full_state_dict",
    "init_optimizer_state",
    "load_optim_state_dict",
    "optim_state_dict",
]
