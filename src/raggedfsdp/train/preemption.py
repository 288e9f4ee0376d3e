"""Graceful preemption: SIGTERM ends the job with a checkpoint, within a grace period.

A worker's :class:`Preemption` only notes the signal; at the end of every step the job asks whether
any rank got one (one small all-reduce), so all ranks finish the same step, save the same checkpoint
and leave with :data:`PREEMPTED_EXIT_CODE`. Who sends the signal, and what a late save leaves: the
comment at :class:`Preemption`.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType

import torch
import torch.distributed as dist

__all__ = ["PREEMPTED_EXIT_CODE", "Preempted", "Preemption"]

#: Exit status of a job stopped by SIGTERM (128 + 15, the shell's convention): launcher and
#: workers alike. With the checkpoint saved, ``--resume`` continues bit for bit.
PREEMPTED_EXIT_CODE = 143


class Preempted(Exception):
    """The job stopped for a SIGTERM after saving the checkpoint of ``step``."""

    def __init__(self, step: int) -> None:
        super().__init__(f"preempted after step {step}")
        self.step = step


# Schedulers announce the end of an allocation with SIGTERM and a grace period before SIGKILL
# (Slurm's ``--signal`` / ``KillWait``, Kubernetes' ``terminationGracePeriodSeconds``); Slurm sends
# it to every task, Kubernetes to the container's first process (here the launcher, whose torchrun
# agent passes it on to the workers). Should the save not be done within ``--preempt-grace-s`` of
# the signal, a timer thread ends the worker anyway: the unfinished save is only a ``.tmp`` folder,
# and the previous checkpoint stays the newest.
class Preemption:
    """Notes SIGTERM in this worker; :meth:`requested` makes every rank agree on it."""

    def __init__(self, grace_s: float, *, rank: int) -> None:
        self.grace_s = grace_s
        self.rank = rank
        self.signalled_at: float | None = None  # time.monotonic() of the first SIGTERM
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signalled_at is not None:
            return  # torchrun's agent passes the launcher's SIGTERM on: the same request
        self.signalled_at = time.monotonic()
        threading.Thread(target=self._deadline, name="raggedfsdp-preempt", daemon=True).start()

    def _deadline(self) -> None:
        time.sleep(self.grace_s)
        sys.stderr.write(
            f"raggedfsdp: error: rank {self.rank}: the checkpoint was not saved within "
            f"--preempt-grace-s={self.grace_s:g} of SIGTERM; the previous one stays the newest\n"
        )
        sys.stderr.flush()
        os._exit(PREEMPTED_EXIT_CODE)

    def requested(self, device: torch.device) -> bool:
        """Whether any rank has received SIGTERM (a collective: every rank calls it once per
        step, at the same point)."""
        flag = torch.tensor([0 if self.signalled_at is None else 1], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def seconds_since_signal(self) -> float:
        """Seconds since this rank's SIGTERM (0 for a rank that learnt of it from another)."""
        return 0.0 if self.signalled_at is None else time.monotonic() - self.signalled_at

    def close(self) -> None:
        """Restore the previous SIGTERM handler."""
        signal.signal(signal.SIGTERM, self._previous)
