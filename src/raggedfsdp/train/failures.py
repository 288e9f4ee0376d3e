"""How a worker ends in error: one line naming the cause, an exit status, torchrun's error file.

From the error file the launcher names the rank that failed first. A user error (a ``ValueError``)
and a run that gave up on non-finite losses meet every rank alike: rank 0 says it and exits with
status 2 (user error) or 1; another rank says only what rank 0 did not (:func:`report_error`).
Anything else (a full disk, a lost peer, a bug) is one line per rank, status 1, and its traceback in
``OUT/logs/rank_N.log`` (:func:`report_failure`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch.distributed.checkpoint as dcp

from .._console import USAGE_ERROR, format_bytes, one_line
from .checkpoints import describe_failure
from .run_dir import free_space, has_outputs

__all__ = ["ERROR_GRACE_S", "report_error", "report_failure"]

#: Seconds a rank other than 0 waits before reporting a user error (see report_error()).
ERROR_GRACE_S = 3.0


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def report_error(err: ValueError | RuntimeError) -> int:
    """Say a user error (``ValueError``: status 2) or a run that gave up (status 1) in one
    line; the exit status. Ranks meet such errors alike: rank 0 says it, and its exit makes
    torchrun stop the others during their wait; a rank still alive after the wait met an error
    of its own, and says it."""
    message = one_line(err)
    rank = _rank()
    if rank != 0:
        # torchrun's SIGTERM must end this rank during the wait, as it did before the job
        # handled SIGTERM (Preemption): the default action again.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(ERROR_GRACE_S)
        message = f"rank {rank}: {message}"
    sys.stderr.write(f"raggedfsdp: error: {message}\n")
    _tell_agent(message, err)
    return USAGE_ERROR if isinstance(err, ValueError) else 1


def report_failure(err: BaseException, out: str | None) -> int:
    """One line naming the cause (e.g. ``OSError: [Errno 28] No space left on device``, a
    peer's lost connection) and this rank; the traceback goes to ``OUT/logs/rank_N.log`` rather
    than the terminal, and the line to torchrun's error file, whence the launcher names the
    rank that failed first and why. Status 1."""
    rank = _rank()
    # Into the run's folder once the run writes there; before, a file there would make the
    # corrected command's folder "not empty", so a private temporary folder instead (made
    # by tempfile: a name nobody could plant beforehand, mode 0700).
    where = ""
    try:
        if out is not None and has_outputs(out):
            logs = Path(out) / "logs"
            logs.mkdir(exist_ok=True)
        else:
            logs = Path(tempfile.mkdtemp(prefix="raggedfsdp-"))
        log = logs / f"rank_{rank:05d}.log"
        log.write_text("".join(traceback.format_exception(err)))
        where = f" (traceback in {log})"
    except OSError:  # the disk that is full may be this one: the line alone, then
        pass
    # DCP's failures name the rank that failed first already.
    cause = describe_failure(err)
    full = _full_disk(out)
    if full is not None and "No space left" not in cause:
        # torch.save (inside DCP too) reports a full disk as "unexpected pos": say what it is.
        cause = f"No space left on device ({full}): {cause}"
    who = "" if isinstance(err, dcp.CheckpointException) else f"rank {rank}: "
    sys.stderr.write(f"raggedfsdp: error: {who}{cause}{where}\n")
    _tell_agent(f"{who}{cause}", err)
    return 1


def _tell_agent(cause: str, err: BaseException) -> None:
    """Write torchrun's error file (``TORCHELASTIC_ERROR_FILE``, in the format of its
    ``ErrorHandler.record_exception``, with the cause as said here rather than ``Type: str``):
    the agent reads it into the launcher's ``ChildFailedError``, which names it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path is None:
        return
    extra = {
        "py_callstack": "".join(traceback.format_exception(err)),
        "timestamp": str(int(time.time())),
    }
    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps({"message": {"message": cause, "extraInfo": extra}}))


def _full_disk(out: str | None) -> str | None:
    """``"N bytes free on PATH"`` when the file system of ``out`` is (nearly) full, else None."""
    if out is None:
        return None
    where, free = free_space(out)
    return f"{format_bytes(free)} free on {where}" if free < 1 << 20 else None
