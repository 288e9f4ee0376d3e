"""Fault tolerance of a training job: collective timeouts, a step watchdog, non-finite losses.

A collective waiting on a dead peer fails after the process group's timeout
(:func:`init_process_group`), a start-up or step that hangs is ended by :class:`StepWatchdog`, and a
NaN or Inf loss is judged globally (:func:`global_loss`), so every rank decides alike. Each one's
why is the comment at its code.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .. import _lifeline
from ..tensor import local_piece
from .stores import hosted_store, is_ip_address, listening_socket

__all__ = [
    "WATCHDOG_EXIT_CODE",
    "NonFiniteLossError",
    "StepWatchdog",
    "all_finite",
    "attempt_store",
    "crash_once",
    "die_with_agent",
    "global_loss",
    "init_process_group",
    "restarted",
]

#: Exit status of a process the watchdog ended (distinct from Python's 1 and argparse's 2).
WATCHDOG_EXIT_CODE = 3


class NonFiniteLossError(RuntimeError):
    """The loss (or gradient norm) was NaN or Inf under ``--on-nan stop``."""


# A collective that waits on a dead or stuck peer fails after the process group's timeout
# (``--comm-timeout-s``, given to :func:`init_process_group`) instead of hanging forever; and the
# workers of a restart meet in a store of their own attempt (:func:`attempt_store`), named by
# something every node agrees on.
def init_process_group(backend: str, *, timeout_s: float, device: torch.device) -> str:
    """The default process group, with every collective timing out after ``timeout_s``; the
    name of the store this attempt's ranks met in (for messages).

    Under torchrun (``MASTER_ADDR`` set) the ranks meet in :func:`attempt_store`. Without
    torchrun: a group of one. On GPUs the group is bound to ``device`` (NCCL then knows each
    rank's GPU up front).
    """
    timeout = timedelta(seconds=timeout_s)
    device_id = device if device.type == "cuda" else None
    if "MASTER_ADDR" not in os.environ:
        dist.init_process_group(
            backend,
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=timeout,
            device_id=device_id,
        )
        return "a local store"
    store, name = attempt_store(timeout)
    dist.init_process_group(
        backend,
        store=store,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
        device_id=device_id,
    )
    return name


def attempt_store(timeout: timedelta) -> tuple[dist.Store, str]:
    """The store of this attempt (one rendezvous round of torchrun's agents), and its name.

    The ranks of one attempt must meet in a namespace no earlier attempt wrote to: a restarted
    worker that read the Gloo addresses its predecessors left would wait forever on a dead peer.
    What names the attempt must be the same on every node, which ``TORCHELASTIC_RESTART_COUNT``
    is not: each agent counts its own restarts, so a replacement node starts at 0 while the
    survivors are at 1 (PyTorch #135712).

    - With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (``raggedfsdp train`` sets it) every round
      has a store of its own: global rank 0 hosts it at the port that round's rendezvous
      published (``MASTER_PORT``), so every node agrees on it and it holds nothing older.
    - With the agents' shared store (torchrun's default, and its static rendezvous), one store
      serves every round; the restart count names the attempt consistently on one node, or
      when there are no restarts (always 0). Several nodes that may restart cannot agree on
      anything the workers see, so that is refused (before any collective, on every rank
      alike).
    """
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if shared and nodes > 1 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        raise ValueError(
            "several nodes with restarts under torchrun's shared rendezvous store cannot agree "
            "on the restart attempt (PyTorch #135712): set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            "for every torchrun agent (c10d rendezvous), or launch with `raggedfsdp train`, "
            "which does"
        )
    hosts = rank == 0 and not shared
    if hosts and is_ip_address(addr):  # on that address alone (stores.py)
        sock = listening_socket(addr, port)
        store = hosted_store(addr, sock, timeout, world_size=world, wait_for_workers=True)
    else:
        store = dist.TCPStore(addr, port, world, is_master=hosts, timeout=timeout)
    if not shared:
        return dist.PrefixStore("raggedfsdp/", store), f"{addr}:{port}"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # one agent: its own count
    return dist.PrefixStore(f"raggedfsdp/attempt_{attempt}/", store), f"{addr}:{port}#{attempt}"


def restarted(device: torch.device) -> bool:
    """Whether this is a restart of the job on any node: the agents' restart counts differ
    between nodes (a replacement node's is 0), so the job takes the largest (a collective)."""
    count = torch.tensor([int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return bool(count.item() > 0)


def die_with_agent() -> None:
    """Under a bare ``torchrun``, have this worker die with its agent (:mod:`raggedfsdp._lifeline`),
    as ``raggedfsdp train``'s workers do from their first instruction. torchrun starts each
    worker in a session of its own, so a worker would outlive an agent that is killed (the OOM
    killer, ``kill -9``, a lost node's launcher) and go on training with its peers, unnoticed,
    while the surviving agents wait at their exit barrier. Armed this late (torchrun names no
    agent PID), a worker whose agent died before it cannot tell; a preemption does not end the
    agent first: it waits for its workers' checkpoint (``--shutdown-timeout``)."""
    if "TORCHELASTIC_RUN_ID" in os.environ and not _lifeline.holding():
        _lifeline.hold(os.getppid())


# A start-up that never ends (a peer that never arrives) or a step that hangs somewhere else (a
# deadlock, a stuck file system, a collective the timeout does not cover) is caught by
# :class:`StepWatchdog`: a daemon thread per rank that ends the process with
# :data:`WATCHDOG_EXIT_CODE` and one line on stderr. ``os._exit`` is deliberate: the main thread may
# be blocked in C++ where no Python exception can reach it. torchrun's elastic agent then sees a
# failed worker and stops the job, or restarts it from the last checkpoint when ``--max-restarts``
# allows.
class StepWatchdog:
    """Ends this process when start-up or one step runs too long (a hang anywhere: a peer that
    never arrives, a deadlock, a stuck file system, a collective the timeout does not cover).

    Armed for start-up from construction (``startup_timeout_s``, ``0`` disables) until the first
    :meth:`step`; :meth:`starting` names what start-up is doing, for the message. Use
    :meth:`step` around each training step (``timeout_s``, ``0`` disables). The thread checks
    twice per second at most, so the abort comes within about half a second of the deadline.
    """

    def __init__(self, timeout_s: float, *, rank: int, startup_timeout_s: float = 0.0) -> None:
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.rank = rank
        self._lock = threading.Lock()
        # What is watched: (description, limit in s, the option that sets it), or None.
        self._watched: tuple[str, float, str] | None = None
        self._started = time.monotonic()
        if startup_timeout_s > 0:
            self._watched = ("start-up", startup_timeout_s, "--startup-timeout-s")
        self._stop = threading.Event()
        limits = [t for t in (timeout_s, startup_timeout_s) if t > 0]
        if limits:
            poll = min(0.5, min(limits) / 4)
            threading.Thread(
                target=self._watch, args=(poll,), name="raggedfsdp-watchdog", daemon=True
            ).start()

    def starting(self, what: str) -> None:
        """Say what start-up does now (the clock keeps running from construction)."""
        with self._lock:
            if self._watched is not None and self._watched[2] == "--startup-timeout-s":
                self._watched = (f"start-up ({what})", *self._watched[1:])

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Arm the watchdog for ``step`` while the block runs (start-up is over)."""
        with self._lock:
            armed = ("step " + str(step), self.timeout_s, "--step-timeout-s")
            self._watched = armed if self.timeout_s > 0 else None
            self._started = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._watched = None

    def close(self) -> None:
        """Stop watching (the thread ends at its next check)."""
        self._stop.set()

    def _watch(self, poll: float) -> None:
        while not self._stop.wait(poll):
            with self._lock:
                watched, started = self._watched, self._started
            if watched is None:
                continue
            what, limit, option = watched
            elapsed = time.monotonic() - started
            if elapsed > limit:
                sys.stderr.write(
                    f"raggedfsdp: error: rank {self.rank}: {what} has run for {elapsed:.1f} s, "
                    f"over {option}={limit:g}; the job is stuck, aborting this worker (exit "
                    f"code {WATCHDOG_EXIT_CODE})\n"
                )
                sys.stderr.flush()
                os._exit(WATCHDOG_EXIT_CODE)


def all_finite(tensors: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None) -> bool:
    """Whether every element of ``tensors`` is finite on every rank of ``group`` (a
    collective: one all-reduce of a flag)."""
    tensors = [local_piece(t.detach()) for t in tensors]  # this rank's pieces; one all-reduce
    tensors = [t for t in tensors if t.numel()]
    local = all(bool(t.isfinite().all()) for t in tensors)
    device = tensors[0].device if tensors else torch.device("cpu")  # NCCL needs the GPU's
    flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


# A NaN or Inf loss is judged *globally* (:func:`global_loss`): one all-reduce per step carries the
# loss and a non-finite flag, so every rank takes the same decision (skip the step or stop) and no
# rank is left waiting in a collective the others skipped.
def global_loss(local_loss: torch.Tensor, group: dist.ProcessGroup | None = None) -> float:
    """The mean of every rank's loss, with a NaN/Inf anywhere making it non-finite everywhere.

    One all-reduce of ``[loss, non-finite flag]``: a non-finite loss is replaced by 0 in the sum
    (so the flag, not IEEE propagation, decides) and reported as ``nan`` on every rank.
    """
    value = local_loss.detach().float().reshape(())
    flag = (~torch.isfinite(value)).float()
    packed = torch.stack([torch.nan_to_num(value, nan=0.0, posinf=0.0, neginf=0.0), flag])
    dist.all_reduce(packed, group=group)
    total, bad = packed.tolist()
    return math.nan if bad else total / dist.get_world_size(group)


def crash_once(marker: Path) -> None:
    """Fault injection for tests: die by SIGKILL - no cleanup, no message, as a killed worker
    does - unless ``marker`` exists; create it first, so the worker that replaces this one after
    an elastic restart lives."""
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    with open(marker, "w") as f:
        f.write(f"pid {os.getpid()}\n")
        f.flush()
        os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)
