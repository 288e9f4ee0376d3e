"""The training job: the worker that torchrun starts, and the launch behind ``raggedfsdp train``.

``python -m raggedfsdp.train`` (what torchrun runs) is :func:`main`. The worker side (options,
build, the loop, checkpoints, monitoring, health, preemption) never imports the launcher side
(``launch``, ``rendezvous``, ``preflight``), the bench or the plan report; the commands around them
are :mod:`raggedfsdp.cli`, which nothing here imports.
"""

from .build import build_model, build_optimizer, build_planner, lr_factor
from .config import TrainConfig
from .job import build_parser, main, train
from .step import StepResult, train_step

__all__ = [
    "StepResult",
    "TrainConfig",
    "build_model",
    "build_optimizer",
    "build_parser",
    "build_planner",
    "lr_factor",
    "main",
    "train",
    "train_step",
]
