"""The training job: the worker that torchrun starts, and the launch behind ``raggedfsdp train``.

``python -m raggedfsdp.train`` (what torchrun runs) is :func:`main`. The worker side is
``config`` (options), ``build`` (model, planner, optimizer), ``job`` (the loop), ``step``
(:func:`train_step`, one optimizer step), ``checkpoints`` and ``run_dir`` (what it saves and
where), ``monitor`` (metrics and reports), ``health`` (timeouts, watchdog, NaN handling) and
``preemption`` (SIGTERM). The launcher side is ``launch`` (torchrun's agent for this node's
workers), ``rendezvous`` (a rendezvous store that outlives the nodes) and ``preflight`` (what
is checked before workers start). The commands around them (flags, printing, exit statuses)
are :mod:`raggedfsdp.cli`, which nothing here imports; the worker side never imports the
launcher, the bench or the plan report either.
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
