"""``raggedfsdp train`` and ``raggedfsdp export``.

``train`` checks what it can in this process (options, data path, output folder, checkpoint), so
that a mistake is one line before any worker starts, then starts the workers through torchrun's
own code path (``torch.distributed.run``: the elastic agent, c10d rendezvous, restarts) running
the module :mod:`raggedfsdp.train` with the same options. ``--dry-run`` plans here and starts
nothing.

One machine (default: 2 worker processes on CPU, one per GPU with CUDA)::

    raggedfsdp train --model gpt-tiny --steps 200

Several machines (run on each; the first to reach the endpoint hosts the rendezvous, unless
``raggedfsdp rendezvous`` hosts it there: :mod:`.rendezvous`)::

    raggedfsdp train --nnodes 2 --node-rank 0 --rdzv-endpoint host0:29400 --nproc 8 ...

With ``--max-restarts K`` the agent restarts all workers after a failure, up to K times; they
continue from the newest complete checkpoint (as with ``--resume``). A node lost from such a job
is replaced by starting its command on another machine; with ``--nnodes MIN:MAX`` the job also
goes on with fewer nodes and takes in more as they come (docs/operations.md, "Membership").
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .config import TrainConfig, add_config_arguments, config_from_args, train_argv
from .preemption import PREEMPTED_EXIT_CODE
from .run_dir import latest_checkpoint

if TYPE_CHECKING:  # torchrun's modules load when a launch needs them
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

__all__ = [
    "configure_export_parser",
    "configure_train_parser",
    "run_export",
    "run_train",
    "torchrun_argv",
]

#: Worker processes per node on a machine without CUDA.
CPU_PROCESSES = 2
#: The training module each worker runs.
TRAIN_MODULE = "raggedfsdp.train"


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def _non_negative(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def _nodes(text: str) -> tuple[int, int]:
    """``N`` (a fixed-size job) or ``MIN:MAX`` (elastic) -> (min, max)."""
    low, _, high = text.partition(":")
    high = high or low
    if not (low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
        raise argparse.ArgumentTypeError(
            f"expected N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}"
        )
    return int(low), int(high)


def _endpoint(text: str) -> str:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return text


def default_nproc() -> int:
    """One process per GPU with CUDA, else :data:`CPU_PROCESSES`."""
    return torch.cuda.device_count() if torch.cuda.is_available() else CPU_PROCESSES


def configure_train_parser(parser: argparse.ArgumentParser) -> None:
    """The launcher's options, then every training option (``--help`` shows both)."""
    launcher = parser.add_argument_group("launcher (torchrun)")
    launcher.add_argument(
        "--nproc",
        type=_positive,
        default=None,
        metavar="N",
        help=f"worker processes on this node (default: one per GPU, or {CPU_PROCESSES} on CPU)",
    )
    launcher.add_argument(
        "--nnodes",
        type=_nodes,
        default=(1, 1),
        metavar="N|MIN:MAX",
        help="nodes in the job (default: 1); MIN:MAX runs elastically: losing a node the job "
        "continues on the others from the newest checkpoint, and a node that joins is taken in "
        "at once (the workers restart from a checkpoint of the step in flight); needs "
        "--max-restarts",
    )
    launcher.add_argument(
        "--node-rank",
        type=_non_negative,
        default=0,
        metavar="R",
        help="this node's rank; node 0 checks the output folder, so a replacement node takes "
        "the lost node's rank (ranks inside the job are assigned by the rendezvous)",
    )
    launcher.add_argument(
        "--rdzv-endpoint",
        type=_endpoint,
        default=None,
        metavar="HOST:PORT",
        help="c10d rendezvous endpoint shared by all nodes (default with one node: a free local "
        "port); the first launcher there hosts it, or 'raggedfsdp rendezvous' does, so that "
        "any node may be lost",
    )
    launcher.add_argument(
        "--rdzv-id", default="raggedfsdp", metavar="ID", help="job id shared by all nodes"
    )
    launcher.add_argument(
        "--max-restarts",
        type=_non_negative,
        default=0,
        metavar="K",
        help="restart all workers up to K times after a failure or a change of membership, "
        "resuming from the newest checkpoint (default: 0)",
    )
    launcher.add_argument(
        "--rdzv-conf",
        default="",
        metavar="KEY=VALUE,...",
        help="torchrun's rendezvous settings (e.g. last_call_timeout=5: how long an elastic "
        "job waits for more nodes once MIN are there; default 30 s). join_timeout defaults to "
        "--startup-timeout-s",
    )
    add_config_arguments(parser.add_argument_group("training"))  # type: ignore[arg-type]


def torchrun_argv(
    args: argparse.Namespace, worker_argv: list[str], *, cfg: TrainConfig
) -> list[str]:
    """torchrun's command line for ``args``' launcher options and the workers' options."""
    nproc = args.nproc or default_nproc()
    low, high = args.nnodes
    argv = [
        f"--nproc-per-node={nproc}",
        f"--nnodes={low}:{high}" if low < high else f"--nnodes={low}",
        f"--max-restarts={args.max_restarts}",
    ]
    if _torchrun_has("--shutdown-timeout"):  # torch >= 2.9; older agents wait 30 s
        # On SIGTERM the agent passes it on and waits this long before SIGKILL: the workers'
        # grace period, and a little for their exit.
        argv.append(f"--shutdown-timeout={math.ceil(cfg.preempt_grace_s) + 5}")
    if args.rdzv_endpoint is None:
        if high > 1:
            raise ValueError(
                "--nnodes above 1 needs --rdzv-endpoint HOST:PORT (the same on every node)"
            )
        argv.append("--standalone")
    else:
        argv += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={args.rdzv_endpoint}",
            f"--rdzv-id={args.rdzv_id}",
        ]  # c10d assigns node ranks itself (torchrun ignores --node-rank there, with a warning)
    conf = rdzv_conf(args.rdzv_conf, startup_timeout_s=cfg.startup_timeout_s)
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


def run_train(args: argparse.Namespace) -> int:
    """Check, then launch the workers; 0 when they all succeed. A user error is a
    ``ValueError``; a failed worker or rendezvous is reported in one line (a worker's own
    message came before)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import get_args_parser, run

    from .preflight import check_plan, dry_run_report, preflight

    cfg = config_from_args(args)
    nproc = args.nproc or default_nproc()
    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise ValueError(f"--nproc {nproc} exceeds the {torch.cuda.device_count()} GPUs here")
    low, high = args.nnodes
    if low < high and args.max_restarts < 1:
        raise ValueError(
            f"--nnodes {low}:{high} needs --max-restarts >= 1: every change of membership "
            f"restarts the workers"
        )
    if cfg.dry_run:
        print(dry_run_report(cfg, high * nproc))
        return 0
    # Only the first node checks the output folder: others may see it filling already. An
    # elastic job may run at any number of nodes in its range: each must split the batch, and
    # the plan must fit at both ends.
    preflight(cfg, high * nproc, check_out=args.node_rank == 0, ranks_per_node=nproc)
    for nodes in range(low, high):
        cfg.check_world(nodes * nproc)
    if low < high:
        check_plan(cfg, low * nproc)
    worker_argv = train_argv(args) + (["--debug"] if getattr(args, "debug", False) else [])
    # torchrun would set 1 thread per worker (with a banner saying so); share the cores instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # A store per rendezvous round, hosted by that round's rank 0 (health.attempt_store): with
    # the agents' shared store, two agents deadlock in the rendezvous and restarted workers
    # cannot agree on their attempt.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    argv = torchrun_argv(args, worker_argv, cfg=cfg)
    try:
        with agent_log(cfg.out):
            run(get_args_parser().parse_args(argv))
    except SignalException as err:  # the launcher itself was told to stop (SIGTERM, ...)
        return _preempted(cfg, signal.Signals(err.sigval).name)
    except RendezvousError as err:
        sys.stderr.write(
            f"raggedfsdp: error: the nodes did not meet at {args.rdzv_endpoint or 'localhost'}: "
            f"{type(err).__name__}: {' '.join(str(err).split())}\n"
        )
        return 1
    except ChildFailedError as err:
        return _child_failed(err, cfg, restarts=args.max_restarts)
    return 0


def _child_failed(err: ChildFailedError, cfg: TrainConfig, *, restarts: int) -> int:
    """One line: the rank that failed first on this node and why; the exit status."""
    # The first by time, as torchrun's get_first_failure; its clock counts whole seconds, and
    # within one a death by signal (the OOM killer, a kill) comes before the lost-peer errors
    # it causes in the others.
    failures = err.failures.items()
    rank, failure = min(failures, key=lambda item: (item[1].timestamp, item[1].exitcode >= 0))
    if failure.exitcode == PREEMPTED_EXIT_CODE:  # only the workers got SIGTERM
        return _preempted(cfg, "SIGTERM")
    how = (
        f"was killed by {failure.signal_name()}"
        if failure.exitcode < 0
        else f"exited with status {failure.exitcode}"
    )
    # The worker's own "Type: message", when it recorded one in torchrun's error file.
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else ""
    cause = f": {message.splitlines()[0]}" if message else ""
    sys.stderr.write(
        f"raggedfsdp: error: training failed: worker rank {rank} {how}"
        f"{' after all restarts' if restarts else ''}{cause}\n"
    )
    # A user error in the workers keeps its status (2); anything else is 1.
    return 2 if failure.exitcode == 2 else 1


def _preempted(cfg: TrainConfig, signal_name: str) -> int:
    """One line saying the job stopped for a signal, and where it can resume from."""
    latest = latest_checkpoint(cfg.out)
    where = f"newest checkpoint {latest}" if latest is not None else "no checkpoint was saved"
    sys.stderr.write(
        f"raggedfsdp: stopped by {signal_name} ({where}); rerun the same command with "
        f"--resume to continue\n"
    )
    return PREEMPTED_EXIT_CODE


@contextlib.contextmanager
def agent_log(out: str) -> Iterator[None]:
    """Keep torchrun's own log lines off the terminal while the block runs: its warnings and
    errors repeat, in a dozen lines, what the workers and :func:`run_train` say in one. They go
    to ``OUT/logs/agent_HOST_PID.log`` at the end (once the workers have made ``OUT``; before,
    a file there would make a corrected rerun's folder "not empty")."""
    logger = logging.getLogger("torch.distributed")
    handler = _Kept()
    # torch's own handler sits on this logger (torch._logging): replaced, not joined.
    saved = logger.handlers, logger.propagate, logger.level
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)  # the rendezvous rounds too: what a recovery took
    try:
        yield
    finally:
        logger.handlers, logger.propagate, logger.level = saved
        if handler.lines and Path(out).is_dir():
            log = Path(out) / "logs" / f"agent_{socket.gethostname()}_{os.getpid()}.log"
            with contextlib.suppress(OSError):  # a full disk: the lines are the least loss
                log.parent.mkdir(exist_ok=True)
                with log.open("a") as f:
                    f.write("\n".join(handler.lines) + "\n")


class _Kept(logging.Handler):
    """Log records kept as formatted lines, in memory."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def _torchrun_has(flag: str) -> bool:
    from torch.distributed.run import get_args_parser

    return any(flag in action.option_strings for action in get_args_parser()._actions)


def configure_export_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="a checkpoint folder (checkpoints/step_NNNNNN) or a run's --out (its newest one)",
    )
    parser.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        help="where to write the state dict (torch.save; also FILE.safetensors when the "
        "safetensors package is installed)",
    )


def run_export(args: argparse.Namespace) -> int:
    """Write the checkpoint's model as a plain state dict of the unwrapped model."""
    from .checkpoints import export_checkpoint

    for path in export_checkpoint(args.checkpoint, args.out):
        print(f"wrote {path}")
    return 0
