"""The training job: ``raggedfsdp train`` and the worker that torchrun starts.

``python -m raggedfsdp.train`` (what torchrun runs) is :func:`main`. The worker side is
``config`` (options), ``build`` (model, planner, optimizer), ``job`` (the loop), ``step``
(:func:`train_step`, one optimizer step), ``checkpoints`` and ``run_dir`` (what it saves and
where), ``monitor`` (metrics and reports), ``health`` (timeouts, watchdog, NaN handling) and
``preemption`` (SIGTERM); ``launch`` is the launcher side (the ``train`` and ``export``
subcommands) and ``preflight`` what it checks before starting workers. The worker side never
imports the launcher, the bench or the plan report.
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
