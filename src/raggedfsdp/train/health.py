"""Fault tolerance of a training job: collective timeouts, a step watchdog, non-finite losses.

- A collective that waits on a dead or stuck peer fails after the process group's timeout
  (``--comm-timeout-s``, given to :func:`init_process_group`) instead of hanging forever; and a
  worker restarted by torchrun meets its peers under a fresh store prefix.
- A step that hangs somewhere else (a deadlock, a stuck file system, a collective the timeout does
  not cover) is caught by :class:`StepWatchdog`: a daemon thread per rank that ends the process
  with :data:`WATCHDOG_EXIT_CODE` and one line on stderr. ``os._exit`` is deliberate: the main
  thread may be blocked in C++ where no Python exception can reach it. torchrun's elastic agent
  then sees a failed worker and stops the job, or restarts it from the last checkpoint when
  ``--max-restarts`` allows.
- A NaN or Inf loss is judged *globally* (:func:`global_loss`): one all-reduce per step carries
  the loss and a non-finite flag, so every rank takes the same decision (skip the step or stop)
  and no rank is left waiting in a collective the others skipped.
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

__all__ = [
    "WATCHDOG_EXIT_CODE",
    "NonFiniteLossError",
    "StepWatchdog",
    "all_finite",
    "crash_once",
    "global_loss",
    "init_process_group",
]

#: Exit status of a process the watchdog ended (distinct from Python's 1 and argparse's 2).
WATCHDOG_EXIT_CODE = 3


class NonFiniteLossError(RuntimeError):
    """The loss (or gradient norm) was NaN or Inf under ``--on-nan stop``."""


def init_process_group(backend: str, *, timeout_s: float, device: torch.device) -> None:
    """The default process group, with every collective timing out after ``timeout_s``.

    Under torchrun (``MASTER_ADDR`` set) the group meets in the store torchrun names, under a
    prefix of the restart attempt: torchrun's agent serves ONE store for all attempts of a job
    (torch 2.13 adds no per-attempt prefix, although ``torch/distributed/rendezvous.py`` says it
    creates a new store per retry), so a restarted worker could read the Gloo addresses its
    predecessors left there and wait forever on a dead peer. Without torchrun: a group of one.
    On GPUs the group is bound to ``device`` (NCCL then knows each rank's GPU up front).
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
        return
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not agent_store,  # the agent hosts the store when it says so
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefixed = dist.PrefixStore(f"raggedfsdp/attempt_{attempt}/", store)
    dist.init_process_group(
        backend,
        store=prefixed,
        rank=rank,
        world_size=world,
        timeout=timeout,
        device_id=device_id,
    )


class StepWatchdog:
    """Ends this process when one step runs longer than ``timeout_s`` (``0`` disables it).

    Use :meth:`step` around each training step. The thread checks twice per second at most, so
    the abort comes within about half a second of the deadline.
    """

    def __init__(self, timeout_s: float, *, rank: int) -> None:
        self.timeout_s = timeout_s
        self.rank = rank
        self._lock = threading.Lock()
        self._step: int | None = None
        self._started = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if timeout_s > 0:
            self._thread = threading.Thread(
                target=self._watch, name="raggedfsdp-step-watchdog", daemon=True
            )
            self._thread.start()

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Arm the watchdog for ``step`` while the block runs."""
        with self._lock:
            self._step, self._started = step, time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._step = None

    def close(self) -> None:
        """Stop watching (the thread ends at its next check)."""
        self._stop.set()

    def _watch(self) -> None:
        poll = min(0.5, self.timeout_s / 4)
        while not self._stop.wait(poll):
            with self._lock:
                step, started = self._step, self._started
            if step is None:
                continue
            elapsed = time.monotonic() - started
            if elapsed > self.timeout_s:
                sys.stderr.write(
                    f"raggedfsdp: error: rank {self.rank}: step {step} has run for "
                    f"{elapsed:.1f} s, over --step-timeout-s={self.timeout_s:g}; the job is "
                    f"stuck, aborting this worker (exit code {WATCHDOG_EXIT_CODE})\n"
                )
                sys.stderr.flush()
                os._exit(WATCHDOG_EXIT_CODE)


def all_finite(tensors: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None) -> bool:
    """Whether every element of ``tensors`` is finite on every rank of ``group`` (a
    collective: one all-reduce of a flag)."""
    tensors = [t.detach() for t in tensors if t.numel()]
    local = all(bool(t.isfinite().all()) for t in tensors)
    device = tensors[0].device if tensors else torch.device("cpu")  # NCCL needs the GPU's
    flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


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
