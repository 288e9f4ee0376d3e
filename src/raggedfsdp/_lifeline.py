"""A worker's lifeline to its launcher: the worker dies with it, from its first instruction.

torchrun starts each worker in a session of its own, so a launcher killed without its ``finally``
blocks would leave its workers training, unsupervised, while a multi-node job's other agents wait
for a node that never comes. ``import raggedfsdp`` (before torch loads) calls :func:`hold_from_env`,
and the worker dies when the launcher does: how, the comment at :func:`hold`. Only stdlib modules
load here.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

__all__ = ["LAUNCHER_PID", "POLL_S", "hold", "hold_from_env", "holding"]

#: The environment variable in which ``raggedfsdp train``'s launcher gives its workers its PID.
LAUNCHER_PID = "RAGGEDFSDP_LAUNCHER_PID"
#: Seconds between two looks at the parent where the kernel cannot watch it (not Linux).
POLL_S = 0.5

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_parent: int | None = None  # the process this one dies with, once held


def hold_from_env() -> None:
    """Die with the launcher named by :data:`LAUNCHER_PID`, if any. The variable is taken out
    of the environment: this worker's own children (compile workers, data loaders) have it for
    a parent, not the launcher."""
    text = os.environ.pop(LAUNCHER_PID, "")
    if text.isdigit():
        hold(int(text))


# So ``raggedfsdp train``'s launcher gives its workers its PID (:data:`LAUNCHER_PID`), and ``import
# raggedfsdp`` - the first thing ``python -m raggedfsdp.train`` runs, before torch loads, which
# takes seconds - calls :func:`hold_from_env`: on Linux the kernel then SIGKILLs the worker the
# moment its parent dies (``PR_SET_PDEATHSIG``); elsewhere a thread checks every :data:`POLL_S`.
# Either way the worker first checks that the launcher did not die between its fork and that call
# (the kernel signals only deaths after it). Only stdlib modules load here.
def hold(parent: int) -> None:
    """End this process (SIGKILL, as the kernel would) as soon as process ``parent``, which
    must be its parent, is gone - at once if it is gone already. Once per process: the first
    call decides."""
    global _parent
    if _parent is not None:
        return
    _parent = parent
    if not _kernel_watches():
        threading.Thread(target=_watch, name="raggedfsdp-lifeline", daemon=True).start()
    # The launcher may have died between the fork and the prctl: then this process has been
    # re-parented already, and the kernel will never signal it.
    if os.getppid() != parent:
        _die()


def holding() -> bool:
    """Whether this process already dies with its parent (:func:`hold` ran)."""
    return _parent is not None


def _kernel_watches() -> bool:
    """Ask Linux to SIGKILL this process when its parent dies; False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes  # stdlib, and cheap: a few milliseconds

    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0


def _watch() -> None:
    """The thread's loop where the kernel does not watch: a changed parent PID is a dead one."""
    while os.getppid() == _parent:
        time.sleep(POLL_S)
    _die()


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
