"""``raggedfsdp train``: the launcher's flags, every training option, and the checks made here.

The checks make a mistake one line before any worker starts. The launch itself (torchrun's agent,
c10d rendezvous, restarts) is :func:`raggedfsdp.train.launch.launch`; ``--dry-run`` plans here and
starts nothing. A failed worker, a rendezvous that never met and a preemption each end in one line
and an exit status (docs/operations.md, "Exit statuses").
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import TYPE_CHECKING

from .._console import USAGE_ERROR
from ..train.config import TrainConfig, add_config_arguments, config_from_args, train_argv
from ..train.launch import (
    CPU_PROCESSES,
    LaunchOptions,
    agent_log,
    check_launch,
    default_nproc,
    launch,
)
from ..train.preemption import PREEMPTED_EXIT_CODE
from ..train.run_dir import latest_checkpoint
from ..train.run_lock import run_lock

if TYPE_CHECKING:  # torchrun's modules load when a launch needs them
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

__all__ = ["configure", "launch_options", "run"]


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


def _add_rendezvous_arguments(launcher: argparse._ArgumentGroup) -> None:
    """The options of the c10d rendezvous: where, which job, torchrun's settings."""
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
        "--rdzv-id",
        metavar="ID",
        help="the job's id, its key in the store (needed with --nnodes above 1, the same on "
        "every node; one node: a random one). The store has no authentication (SECURITY.md)",
    )
    launcher.add_argument(
        "--rdzv-conf",
        default="",
        metavar="KEY=VALUE,...",
        help="torchrun's rendezvous settings (e.g. last_call_timeout=5: how long an elastic "
        "job waits for more nodes once MIN are there; default 30 s). join_timeout defaults to "
        "--startup-timeout-s",
    )


def configure(parser: argparse.ArgumentParser) -> None:
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
    _add_rendezvous_arguments(launcher)
    launcher.add_argument(
        "--max-restarts",
        type=_non_negative,
        default=0,
        metavar="K",
        help="restart all workers up to K times after a failure or a change of membership, "
        "resuming from the newest checkpoint (default: 0)",
    )
    parser.add_argument_group("files").add_argument(
        "--user-only",
        action="store_true",
        help="everything the run writes readable and writable by this user alone (umask 077; "
        "default: the umask's modes, usually readable by all; SECURITY.md)",
    )
    add_config_arguments(parser.add_argument_group("training"))  # type: ignore[arg-type]


def launch_options(args: argparse.Namespace) -> LaunchOptions:
    """The :class:`LaunchOptions` of arguments parsed by a :func:`configure` parser."""
    low, high = args.nnodes
    return LaunchOptions(
        nproc=args.nproc or default_nproc(),
        min_nodes=low,
        max_nodes=high,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        max_restarts=args.max_restarts,
        rdzv_conf=args.rdzv_conf,
    )


def run(args: argparse.Namespace) -> int:
    """Check, take the run folder's lock, check what needs it, then launch the workers; 0 when
    they all succeed. A user error is a ``ValueError`` (nothing is left in ``--out``: the lock
    goes, and the folder if this launcher made it); a failed worker or rendezvous is reported
    in one line (a worker's own message came before)."""
    from ..train.preflight import dry_run_report

    cfg = config_from_args(args)
    options = launch_options(args)
    options.check()
    if cfg.dry_run:
        print(dry_run_report(cfg, options.max_world_size))
        return 0
    if args.user_only:  # before the first file; the workers inherit it
        os.umask(0o077)
    with run_lock(cfg.out, job=options.job) as lock:
        if lock.taken_over is not None:
            sys.stderr.write(
                f"raggedfsdp: took over the lock {str(lock.path)!r} of a job that is gone "
                f"({lock.taken_over.describe()})\n"
            )
        check_launch(cfg, options)
        worker_argv = train_argv(args) + (["--debug"] if getattr(args, "debug", False) else [])
        return _launch(cfg, options, worker_argv, job=lock.job)


def _launch(cfg: TrainConfig, options: LaunchOptions, worker_argv: list[str], *, job: str) -> int:
    """torchrun's agent for this node's workers, and the exit status its end makes; the
    agent's own log goes to ``OUT/logs`` (:func:`agent_log`), unless the workers refused to
    start."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    with agent_log(cfg.out) as log:
        try:
            launch(cfg, options, worker_argv, job=job)
        except SignalException as err:  # the launcher itself was told to stop (SIGTERM, ...)
            return _preempted(cfg, signal.Signals(err.sigval).name)
        except RendezvousError as err:
            where = options.rdzv_endpoint or "localhost"
            sys.stderr.write(
                f"raggedfsdp: error: the nodes did not meet at {where}: "
                f"{type(err).__name__}: {' '.join(str(err).split())}\n"
            )
            return 1
        except ChildFailedError as err:
            status = _child_failed(err, cfg, restarts=options.max_restarts)
            if status == USAGE_ERROR:
                log.discard()
            return status
    return 0


def _child_failed(err: ChildFailedError, cfg: TrainConfig, *, restarts: int) -> int:
    """The exit status of a failed run (the first failure's, as srun gives its task's), after
    one line naming the rank that failed first and why, unless that rank said it already.

    The first failure is the earliest by torchrun's clock, which counts whole seconds: within
    one, a death by signal (the OOM killer, a kill) comes before the lost-peer errors it causes
    in the others. A worker that SIGTERM ended is passed over while another failed: once one
    worker fails, the agent ends the others with SIGTERM, which is not their failure.
    """
    failures = list(err.failures.items())
    own = [item for item in failures if item[1].exitcode != -signal.SIGTERM] or failures
    rank, failure = min(own, key=lambda item: (item[1].timestamp, item[1].exitcode >= 0))
    if failure.exitcode in (PREEMPTED_EXIT_CODE, -signal.SIGTERM):  # SIGTERM, to the workers
        return _preempted(cfg, "SIGTERM")
    if failure.exitcode == USAGE_ERROR:  # the worker's one line named the user's error
        return USAGE_ERROR
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
    # The shell's status of a process a signal ended (137: SIGKILL, e.g. the OOM killer).
    return 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode


def _preempted(cfg: TrainConfig, signal_name: str) -> int:
    """One line saying the job stopped for a signal, and where it can resume from."""
    latest = latest_checkpoint(cfg.out)
    where = f"newest checkpoint {latest}" if latest is not None else "no checkpoint was saved"
    sys.stderr.write(
        f"raggedfsdp: stopped by {signal_name} ({where}); rerun the same command with "
        f"--resume to continue\n"
    )
    return PREEMPTED_EXIT_CODE
