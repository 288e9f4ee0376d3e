"""``raggedfsdp train`` and ``raggedfsdp export``.

``train`` checks what it can in this process (options, data path, output folder, checkpoint), so
that a mistake is one line before any worker starts, then starts the workers through torchrun's
own code path (``torch.distributed.run``: the elastic agent, c10d rendezvous, restarts) running
the module :mod:`raggedfsdp.train` with the same options. ``--dry-run`` plans here and starts
nothing.

One machine (default: 2 worker processes on CPU, one per GPU with CUDA)::

    raggedfsdp train --model gpt-tiny --steps 200

Several machines (run on each; the first to reach the endpoint hosts the rendezvous)::

    raggedfsdp train --nnodes 2 --node-rank 0 --rdzv-endpoint host0:29400 --nproc 8 ...

With ``--max-restarts K`` the agent restarts all workers after a failure, up to K times; they
continue from the newest complete checkpoint (as with ``--resume``).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys

import torch

from .config import TrainConfig, add_config_arguments, config_from_args, train_argv
from .preemption import PREEMPTED_EXIT_CODE
from .run_dir import latest_checkpoint

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
        "--nnodes", type=_positive, default=1, metavar="N", help="nodes in the job (default: 1)"
    )
    launcher.add_argument(
        "--node-rank",
        type=_non_negative,
        default=0,
        metavar="R",
        help="this node's rank; node 0 checks the output folder (ranks inside the job are "
        "assigned by the rendezvous)",
    )
    launcher.add_argument(
        "--rdzv-endpoint",
        type=_endpoint,
        default=None,
        metavar="HOST:PORT",
        help="c10d rendezvous endpoint shared by all nodes (default with one node: a free local "
        "port)",
    )
    launcher.add_argument(
        "--rdzv-id", default="raggedfsdp", metavar="ID", help="job id shared by all nodes"
    )
    launcher.add_argument(
        "--max-restarts",
        type=_non_negative,
        default=0,
        metavar="K",
        help="restart all workers up to K times after a failure, resuming from the newest "
        "checkpoint (default: 0)",
    )
    add_config_arguments(parser.add_argument_group("training"))  # type: ignore[arg-type]


def torchrun_argv(
    args: argparse.Namespace, worker_argv: list[str], *, preempt_grace_s: float
) -> list[str]:
    """torchrun's command line for ``args``' launcher options and the workers' options."""
    nproc = args.nproc or default_nproc()
    argv = [
        f"--nproc-per-node={nproc}",
        f"--nnodes={args.nnodes}",
        f"--max-restarts={args.max_restarts}",
    ]
    if _torchrun_has("--shutdown-timeout"):  # torch >= 2.9; older agents wait 30 s
        # On SIGTERM the agent passes it on and waits this long before SIGKILL: the workers'
        # grace period, and a little for their exit.
        argv.append(f"--shutdown-timeout={math.ceil(preempt_grace_s) + 5}")
    if args.rdzv_endpoint is None:
        if args.nnodes > 1:
            raise ValueError(
                "--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)"
            )
        argv.append("--standalone")
    else:
        argv += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={args.rdzv_endpoint}",
            f"--rdzv-id={args.rdzv_id}",
        ]  # c10d assigns node ranks itself (torchrun ignores --node-rank there, with a warning)
    return [*argv, "--module", TRAIN_MODULE, *worker_argv]


def run_train(args: argparse.Namespace) -> int:
    """Check, then launch the workers; 0 when they all succeed. A user error is a
    ``ValueError``; a failed worker is reported in one line (its own message came before)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from .preflight import dry_run_report, preflight

    cfg = config_from_args(args)
    nproc = args.nproc or default_nproc()
    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise ValueError(f"--nproc {nproc} exceeds the {torch.cuda.device_count()} GPUs here")
    world = args.nnodes * nproc
    if cfg.dry_run:
        print(dry_run_report(cfg, world))
        return 0
    # Only the first node checks the output folder: others may see it filling already.
    preflight(cfg, world, check_out=args.node_rank == 0, ranks_per_node=nproc)
    worker_argv = train_argv(args) + (["--debug"] if getattr(args, "debug", False) else [])
    # torchrun would set 1 thread per worker (with a banner saying so); share the cores instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    argv = torchrun_argv(args, worker_argv, preempt_grace_s=cfg.preempt_grace_s)
    try:
        run(get_args_parser().parse_args(argv))
    except SignalException as err:  # the launcher itself was told to stop (SIGTERM, ...)
        return _preempted(cfg, signal.Signals(err.sigval).name)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        if failure.exitcode == PREEMPTED_EXIT_CODE:  # only the workers got SIGTERM
            return _preempted(cfg, "SIGTERM")
        how = (
            f"was killed by {failure.signal_name()}"
            if failure.exitcode < 0
            else f"exited with status {failure.exitcode}"
        )
        sys.stderr.write(
            f"raggedfsdp: error: training failed: worker rank {rank} {how}"
            f"{' after all restarts' if args.max_restarts else ''}\n"
        )
        # A user error in the workers keeps its status (2); anything else is 1.
        return 2 if failure.exitcode == 2 else 1
    return 0


def _preempted(cfg: TrainConfig, signal_name: str) -> int:
    """One line saying the job stopped for a signal, and where it can resume from."""
    latest = latest_checkpoint(cfg.out)
    where = f"newest checkpoint {latest}" if latest is not None else "no checkpoint was saved"
    sys.stderr.write(
        f"raggedfsdp: stopped by {signal_name} ({where}); rerun the same command with "
        f"--resume to continue\n"
    )
    return PREEMPTED_EXIT_CODE


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
