"""One job per run folder: the lock ``OUT/.lock`` that ``raggedfsdp train``'s launchers take.

Taken before anything else touches ``--out`` and held for the job's life: who holds it, who may
share or take it over, and why ([Note: the run-folder lock] at :class:`RunLock`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .run_dir import LOCK

__all__ = ["Holder", "RunLock", "run_lock"]

_ATTEMPTS = 3  # tries to take the lock when others take or break it at the same moment
_READ_WAIT_S = 1.0  # how long a lock being written may stay unreadable


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from ``/proc``), or None where that
    cannot be read: with the PID it names a process, which a PID alone does not (PIDs are
    reused)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@dataclass(frozen=True)
class Holder:
    """The launcher that holds a run folder's lock, and its job."""

    host: str
    pid: int
    started: str | None  # the process's start (:func:`_process_start`)
    since: float  # when it took the lock, seconds since the epoch
    job: str  # the job's key: "HOST:PORT/ID" of a multi-node job, else the holder itself

    @classmethod
    def this_process(cls, job: str | None) -> Holder:
        """This launcher, for the job ``job`` (None: a job of one node, keyed by the
        launcher)."""
        host, pid, started = socket.gethostname(), os.getpid(), _process_start(os.getpid())
        return cls(host, pid, started, time.time(), job or f"{host}:{pid}:{started}")

    def describe(self) -> str:
        """``launcher PID 123 on HOST since 2026-01-31 12:00:00``."""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"launcher PID {self.pid} on {self.host} since {since}"

    def gone(self) -> bool | None:
        """Whether the holder's process has ended: None when it ran on another host."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # another user's process: alive, but is it the holder?
            pass
        return self.started is not None and _process_start(self.pid) != self.started


# [Note: the run-folder lock] The lock is a file created exclusively (``O_CREAT | O_EXCL``: atomic
# on local file systems and on NFS v3 and later) that names its holder: a launcher's host, PID and
# process start time, when it took the lock, and the job's key.
#
# - **One job, several nodes.** The launchers of a multi-node job share ``--rdzv-endpoint`` and
#   ``--rdzv-id`` (that is what makes torchrun's agents one job): they are its key. The first
#   launcher to create the lock holds it; the others find their key in it and go on under that
#   holder, so all agree on one. A single node's job has no key to share: its launcher's own
#   identity is its key. A launcher of another key is refused in one line naming the holder.
# - **For the job's life.** The holder deletes the lock when its launcher ends, whatever ends it
#   short of SIGKILL (a finished run, an error, a preemption).
# - **A dead job's lock** is taken over, in one line naming it: its holder ran on this host and its
#   PID is gone, or belongs to another process now (its start time differs). A holder on another
#   host cannot be checked: the launcher refuses, naming host and PID and the file to delete once
#   that job is known to be gone.
# - **A refused start leaves nothing.** The launcher made ``--out`` (and its missing parents) to
#   hold the lock; :meth:`RunLock.release` deletes the lock and those folders while empty.
#
# The key of the job that holds the lock is also what its workers record in every checkpoint
# (:data:`.run_dir.JOB_ENV`), so that a save never replaces a step folder another job wrote
# (:mod:`.checkpoints`).
@dataclass
class RunLock:
    """This launcher's part in a run folder's lock: it holds the lock, or joined the holder of
    its own job."""

    path: Path
    holder: Holder
    holding: bool  # this launcher took the lock (and deletes it at the end)
    made: list[Path]  # the folders this launcher made for it, outermost first
    taken_over: Holder | None = None  # the dead job whose lock it took over

    @property
    def job(self) -> str:
        """The job's key, as its checkpoints record it."""
        return self.holder.job

    def release(self) -> None:
        """Delete the lock if this launcher holds it (and it is still its own), then the
        folders it made for it, those still empty: a start refused after the lock leaves
        nothing behind."""
        with contextlib.suppress(ValueError):  # unreadable: not this launcher's
            if self.holding and _read(self.path) == self.holder:
                self.path.unlink(missing_ok=True)
        _remove_empty(self.made)


@contextlib.contextmanager
def run_lock(out: str | Path, *, job: str | None) -> Iterator[RunLock]:
    """Hold the lock of run folder ``out`` for job ``job`` (None: a job of one node) while the
    block runs (module Note). ``ValueError``, in one line naming the holder, when another job
    holds it."""
    lock = _acquire(Path(out), job)
    try:
        yield lock
    finally:
        lock.release()


def _acquire(out: Path, job: str | None) -> RunLock:
    """Make ``out`` if need be, then take its lock, or join the holder of this job."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: {str(out)!r} exists and is not a folder")
    made = [p for p in (out, *out.parents) if not p.exists()][::-1]
    try:
        out.mkdir(parents=True, exist_ok=True)
        return _take(out / LOCK, Holder.this_process(job), made)
    except OSError as err:
        _remove_empty(made)
        raise ValueError(f"out: cannot use {str(out)!r}: {err.strerror or err}") from None
    except ValueError:
        _remove_empty(made)
        raise


def _take(path: Path, me: Holder, made: list[Path]) -> RunLock:
    """The lock at ``path`` for ``me``: created, joined (its holder runs this job), or taken
    over from a dead job; ``ValueError`` naming the holder of a live other job."""
    taken_over = None
    for _ in range(_ATTEMPTS):
        if _create(path, me):
            return RunLock(path, me, True, made, taken_over)
        other = _wait_readable(path)
        if other is None:  # released meanwhile
            continue
        gone = other.gone()
        if gone:
            _break(path, other)
            taken_over = other
        elif other.job == me.job:  # another node of this job holds it
            return RunLock(path, other, False, made)
        else:
            where = (
                f"if that job is gone (it ran on another host, where its PID cannot be "
                f"checked), delete {str(path)!r}"
                if gone is None
                else "wait for it to end"
            )
            raise ValueError(
                f"output folder {str(path.parent)!r} is in use by another job: "
                f"{other.describe()} holds its lock; {where}, or choose another --out"
            )
    raise ValueError(f"out: could not take the lock {str(path)!r}: other launchers keep taking it")


def _remove_empty(folders: list[Path]) -> None:
    """Remove ``folders`` (outermost first), innermost first, while they are empty."""
    for folder in reversed(folders):
        with contextlib.suppress(OSError):  # not empty: a run's outputs are there
            folder.rmdir()


def _create(path: Path, me: Holder) -> bool:
    """Create the lock naming ``me``; False when it exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(dataclasses.asdict(me), f)
        f.flush()
        os.fsync(f.fileno())
    return True


def _read(path: Path) -> Holder | None:
    """The holder a lock names; None when there is no lock. ``ValueError`` when it cannot be
    read (or is being written: created, not yet filled)."""
    try:
        record = json.loads(path.read_text())
        return Holder(**record)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"{type(err).__name__}: {err}") from None


def _wait_readable(path: Path) -> Holder | None:
    """:func:`_read`, giving a lock that another launcher is writing a moment to be complete;
    one that stays unreadable is refused in one line."""
    deadline = time.monotonic() + _READ_WAIT_S
    while True:
        try:
            return _read(path)
        except ValueError as err:
            if time.monotonic() > deadline:
                raise ValueError(
                    f"the lock {str(path)!r} cannot be read ({err}); if no job is using "
                    f"{str(path.parent)!r}, delete it"
                ) from None
        time.sleep(0.05)


def _break(path: Path, dead: Holder) -> None:
    """Delete the lock of the dead job ``dead``, unless another launcher took it meanwhile: the
    lock is moved aside first (a rename: one launcher wins) and put back when it turns out to
    be a live one."""
    aside = path.with_name(f"{LOCK}.{socket.gethostname()}.{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:  # another launcher broke it first
        return
    try:
        live = _read(aside) != dead
    except ValueError:  # unreadable: a lock being written, so a live one
        live = True
    try:
        if live:
            with contextlib.suppress(FileExistsError):  # a third launcher took it meanwhile
                os.link(aside, path)
    finally:
        aside.unlink(missing_ok=True)
