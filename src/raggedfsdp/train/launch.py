"""Starting the workers of ``raggedfsdp train`` through torchrun's own code path.

``torch.distributed.run`` (the elastic agent, c10d rendezvous, restarts) starts each worker running
:mod:`raggedfsdp.train` with the same options, on one machine or several, restarted from the newest
complete checkpoint with ``--max-restarts`` and elastic with ``--nnodes MIN:MAX``
(docs/operations.md). The command around it (its flags, what it prints, its exit statuses) is
:mod:`raggedfsdp.cli.train`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .._lifeline import LAUNCHER_PID
from .config import TrainConfig
from .rendezvous import BACKEND, register_backend
from .run_dir import JOB_ENV, has_outputs

__all__ = [
    "CPU_PROCESSES",
    "AgentLog",
    "LaunchOptions",
    "agent_log",
    "check_launch",
    "default_nproc",
    "launch",
    "rdzv_conf",
    "torchrun_argv",
]

#: Worker processes per node on a machine without CUDA.
CPU_PROCESSES = 2
#: The training module each worker runs.
TRAIN_MODULE = "raggedfsdp.train"


def default_nproc() -> int:
    """One process per GPU with CUDA, else :data:`CPU_PROCESSES`."""
    return torch.cuda.device_count() if torch.cuda.is_available() else CPU_PROCESSES


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """How torchrun starts this node's workers (the launcher's flags of ``raggedfsdp train``).

    Attributes:
        nproc: worker processes on this node.
        min_nodes: nodes the job needs to run.
        max_nodes: nodes it takes at most (above ``min_nodes``: an elastic job).
        node_rank: this node's rank; node 0 checks the output folder.
        rdzv_endpoint: ``HOST:PORT`` of the c10d rendezvous (``None``: one node, standalone).
        rdzv_id: the job id shared by all nodes, its key in the store; needed with several
            nodes (a guessable default would let other jobs share it), random on one.
        max_restarts: how often the agent restarts all workers after a failure or a change of
            membership.
        rdzv_conf: torchrun's rendezvous settings, ``KEY=VALUE,...``.
    """

    nproc: int
    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    max_restarts: int = 0
    rdzv_conf: str = ""

    def check(self) -> None:
        """``ValueError`` unless this machine and torchrun can run these options, whatever the
        job: no more workers than GPUs here; an elastic range restarts the workers at every
        change of membership, so it needs restarts."""
        if torch.cuda.is_available() and self.nproc > torch.cuda.device_count():
            raise ValueError(
                f"--nproc {self.nproc} exceeds the {torch.cuda.device_count()} GPUs here"
            )
        if self.elastic and self.max_restarts < 1:
            raise ValueError(
                f"--nnodes {self.min_nodes}:{self.max_nodes} needs --max-restarts >= 1: every "
                f"change of membership restarts the workers"
            )

    @property
    def elastic(self) -> bool:
        """Whether the job runs at any number of nodes between ``min_nodes`` and ``max_nodes``."""
        return self.min_nodes < self.max_nodes

    @property
    def job(self) -> str | None:
        """The key every node's launcher of this job shares (its run-folder lock names it):
        the rendezvous and the job id of a multi-node job; None for one node, whose launcher
        is the job."""
        return f"{self.rdzv_endpoint}/{self.rdzv_id}" if self.max_nodes > 1 else None

    @property
    def max_world_size(self) -> int:
        """Ranks of the job at its largest."""
        return self.max_nodes * self.nproc


def check_launch(cfg: TrainConfig, options: LaunchOptions) -> None:
    """What can be checked of this job before any worker starts (``ValueError`` otherwise; the
    options alone are :meth:`LaunchOptions.check`'s): the preflight
    (options, data, output folder, checkpoint, memory) at the largest world size; only the
    first node checks the output folder, since others may see it filling already. An elastic
    job may run at any number of nodes in its range: each must split the batch, and the plan
    must fit at both ends."""
    from .preflight import check_plan, preflight  # the cost model loads only for a launch

    preflight(
        cfg,
        options.max_world_size,
        check_out=options.node_rank == 0,
        ranks_per_node=options.nproc,
    )
    for nodes in range(options.min_nodes, options.max_nodes):
        cfg.check_world(nodes * options.nproc)
    if options.elastic:
        check_plan(cfg, options.min_nodes * options.nproc)


def launch(
    cfg: TrainConfig, options: LaunchOptions, worker_argv: Sequence[str], *, job: str
) -> None:
    """Run torchrun's agent for this node's workers (each ``python -m raggedfsdp.train
    WORKER_ARGV``, working for ``job``: what their checkpoints record) until they finish.
    torchrun's own errors pass through: ``SignalException``
    (the launcher itself was told to stop), ``RendezvousError`` (the nodes did not meet),
    ``ChildFailedError`` (a worker failed after all restarts)."""
    from torch.distributed.run import get_args_parser, run

    argv = torchrun_argv(options, list(worker_argv), cfg=cfg)
    # torchrun would set 1 thread per worker (with a banner saying so); share the cores instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // options.nproc)))
    # A store per rendezvous round, hosted by that round's rank 0 (health.attempt_store): with
    # the agents' shared store, two agents deadlock in the rendezvous and restarted workers
    # cannot agree on their attempt.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # The workers die with this process from their first instruction, even if it is SIGKILLed
    # while they start (raggedfsdp._lifeline); torchrun's agent runs here, so it is their parent.
    os.environ[LAUNCHER_PID] = str(os.getpid())
    os.environ[JOB_ENV] = job
    register_backend()
    run(get_args_parser().parse_args(argv))


def torchrun_argv(options: LaunchOptions, worker_argv: list[str], *, cfg: TrainConfig) -> list[str]:
    """torchrun's command line for the launcher's ``options`` and the workers' options."""
    low, high = options.min_nodes, options.max_nodes
    argv = [
        f"--nproc-per-node={options.nproc}",
        f"--nnodes={low}:{high}" if low < high else f"--nnodes={low}",
        f"--max-restarts={options.max_restarts}",
    ]
    if _torchrun_has("--shutdown-timeout"):  # torch >= 2.9; older agents wait 30 s
        # On SIGTERM the agent passes it on and waits this long before SIGKILL: the workers'
        # grace period, and a little for their exit.
        argv.append(f"--shutdown-timeout={math.ceil(cfg.preempt_grace_s) + 5}")
    if options.rdzv_endpoint is None:
        if high > 1:
            raise ValueError(
                "--nnodes above 1 needs --rdzv-endpoint HOST:PORT (the same on every node)"
            )
        # torchrun's --standalone, but on loopback alone: the rendezvous store (the backend's,
        # at a free port) and, through --local-addr, the workers' (MASTER_ADDR, stores.py).
        argv += [
            f"--rdzv-backend={BACKEND}",
            "--rdzv-endpoint=127.0.0.1:0",
            f"--rdzv-id={secrets.token_hex(8)}",
            "--local-addr=127.0.0.1",
        ]
    elif high > 1 and not options.rdzv_id:
        raise ValueError(
            "--nnodes above 1 needs --rdzv-id ID, the same on every node and unique to this job "
            "(the scheduler's job id, or `openssl rand -hex 8`): the store knows a job by it"
        )
    else:
        argv += [
            f"--rdzv-backend={BACKEND}",  # torchrun's c10d, its state checked (rendezvous.py)
            f"--rdzv-endpoint={options.rdzv_endpoint}",
            f"--rdzv-id={options.rdzv_id or secrets.token_hex(8)}",  # one node: its own
        ]  # c10d assigns node ranks itself (torchrun ignores --node-rank there, with a warning)
    conf = rdzv_conf(options.rdzv_conf, startup_timeout_s=cfg.startup_timeout_s)
    if conf:
        argv.append(f"--rdzv-conf={conf}")
    return [*argv, "--module", TRAIN_MODULE, *worker_argv]


def rdzv_conf(text: str, *, startup_timeout_s: float) -> str:
    """``--rdzv-conf`` checked (``KEY=VALUE`` pairs, whole seconds for timeouts), with
    ``join_timeout`` from ``--startup-timeout-s`` unless given: an agent that cannot meet its
    peers gives up then, as its workers' watchdog does."""
    pairs = dict(item.partition("=")[::2] for item in text.split(",") if item)
    for key, value in pairs.items():
        if not key or not value or (key.endswith("timeout") and not value.isdigit()):
            raise ValueError(f"--rdzv-conf: expected KEY=VALUE with whole seconds, got {text!r}")
    if startup_timeout_s > 0:
        pairs.setdefault("join_timeout", str(math.ceil(startup_timeout_s)))
    return ",".join(f"{key}={value}" for key, value in pairs.items())


@contextlib.contextmanager
def agent_log(out: str) -> Iterator[AgentLog]:
    """Keep torchrun's own log lines off the terminal while the block runs: its warnings and
    errors repeat, in a dozen lines, what the workers and the ``train`` command say in one. They go
    to ``OUT/logs/agent_HOST_PID.log`` at the end, unless :meth:`AgentLog.discard` was called
    (a start the workers refused leaves nothing) or the workers never wrote there (a file
    there would make a corrected rerun's folder "not empty")."""
    logger = logging.getLogger("torch.distributed")
    handler = AgentLog()
    # torch's own handler sits on this logger (torch._logging): replaced, not joined.
    saved = logger.handlers, logger.propagate, logger.level
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)  # the rendezvous rounds too: what a recovery took
    try:
        yield handler
    finally:
        logger.handlers, logger.propagate, logger.level = saved
        if handler.lines and has_outputs(out):
            log = Path(out) / "logs" / f"agent_{socket.gethostname()}_{os.getpid()}.log"
            with contextlib.suppress(OSError):  # a full disk: the lines are the least loss
                log.parent.mkdir(exist_ok=True)
                with log.open("a") as f:
                    f.write("\n".join(handler.lines) + "\n")


class AgentLog(logging.Handler):
    """torchrun's log records, kept as formatted lines in memory (:func:`agent_log`)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def discard(self) -> None:
        """Write none of the lines kept so far."""
        self.lines.clear()


def _torchrun_has(flag: str) -> bool:
    from torch.distributed.run import get_args_parser

    return any(flag in action.option_strings for action in get_args_parser()._actions)
