"""The streams a unit tree communicates on, and the events that order them against compute.

The root makes four communication streams for its device at lazy init, shared by every unit under
it, beside the compute stream; memory shared between streams lives until an event says its last
reader is done. On the CPU a stand-in takes the same calls and can log them, so tests check the
order a GPU would run in. The design: [Note: streams and events] at :class:`Streams`.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch

from ..facts.systems import Stream
from ._metrics import RuntimeStats

__all__ = ["HostEvent", "HostStream", "Streams", "wait_all"]

#: What the stand-in records, in order: ``("record" | "wait", stream, event id, label)``; tests
#: add entries of their own (what ran on which stream) to the same list.
Log = list[tuple[Any, ...]]


class _Waitable(Protocol):
    """An issued collective (``_collectives.Pending``)."""

    stats: RuntimeStats

    def wait(self, *, timed: bool = True) -> None: ...


class HostStream:
    """The CPU's stand-in for a stream: a name."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"HostStream({self.name})"


class HostEvent:
    """The CPU's stand-in for an event: which stream recorded it, when (``id``), and why."""

    def __init__(self, id: int, stream: str, label: str) -> None:
        self.id, self.stream, self.label = id, stream, label

    def __repr__(self) -> str:
        return f"HostEvent({self.id}, {self.stream}, {self.label})"


# [Note: streams and events] As FSDP2 (``_fsdp_param_group.py``, ``_fsdp_collectives.py``), the root
# makes four streams for its device at lazy init, shared by every unit under it, beside the
# *compute* stream (whichever stream is current when the hooks run):
#
# - **all-gather copy-in**: a bucket's unsharded storage is allocated here and what this rank sends
#   is made here (the cast of the master shard into its slot, the host shard's copy under offload,
#   the quantized message, the copy of ``zero_copy=False``);
# - **all-gather**: waits for the copy-in, issues the collective; when the unit waits for its
#   parameters (``wait_for_unshard``), this stream waits for the collective's work and runs what
#   follows it (the dequantize of a compressed all-gather), then records an event, and the compute
#   stream waits for that event before the unit's forward or backward reads them;
# - **reduce-scatter**: waits for the compute stream at the unit's post-backward (its unsharded
#   gradients are written), casts them to ``reduce_dtype``, issues the collective; finishing it (the
#   Gloo sum, the dequantize-sum, the division and the attaching of the sharded gradients) runs here
#   too;
# - **all-reduce** (HSDP): waits for the reduce-scatter stream, adds what earlier backwards kept and
#   all-reduces over the replicas; the reduced shards are attached here.
#
# Before an unshard issues, both all-gather streams wait for the compute stream: the optimizer may
# have written the shards, and memory a resharded unit freed may still be read by compute
# (:meth:`Streams.order_gathers`; once until compute moves on, :meth:`Streams.compute_moved`). An
# event given by ``FSDPModule.set_post_optim_event`` replaces that wait once, as in FSDP2: the next
# all-gathers wait for the optimizer step only, not for whatever the compute stream queued after it.
# At the end of backward the compute stream waits for each unit's post-reduce event before the
# optimizer reads the gradients.
#
# Memory shared between streams is kept alive until an event says its last reader is done, never
# with ``record_stream``: a block handed back to the :class:`~._pool.BufferPool` carries an event
# recorded on the stream that gave it back, and the stream that takes it next waits for that event
# (:meth:`Streams.record`, :meth:`Streams.wait`).
#
# On the CPU there are no streams: a stand-in takes the same calls, orders nothing (every op runs in
# program order) and, when :attr:`Streams.log` is set, records each event and wait, so that tests
# check on this machine the order a GPU would run in (``tests/distributed/test_streams.py``).
class Streams:
    """The compute stream and the four communication streams of one root's units ([Note:
    streams and events]). With ``separate=False`` every side stream is the compute stream and
    nothing is recorded or waited for (one stream, as before streams existed)."""

    def __init__(self, device: torch.device, *, separate: bool = True) -> None:
        self.device = device
        self.separate = separate
        self.host = device.type in ("cpu", "meta") or not _has_streams(device)
        #: the stand-in's record (host only): ``None`` records nothing
        self.log: Log | None = None
        self._ids = itertools.count()
        # the stand-in's current stream; names as the systems' descriptions give them
        self._stack: list[HostStream] = [HostStream(Stream.COMPUTE.value)]
        self.copy_in = self._new(Stream.COPY_IN.value, priority=-1)
        self.all_gather = self._new(Stream.ALL_GATHER.value, priority=-1)
        self.reduce_scatter = self._new(Stream.REDUCE_SCATTER.value, priority=-1)
        self.all_reduce = self._new(Stream.ALL_REDUCE.value, priority=0)
        #: FSDPModule.set_post_optim_event's, until the next all-gathers wait for it
        self._post_optim_event: Any = None
        #: whether the all-gather streams have waited for compute since it last moved on
        self._gathers_current = False

    def _new(self, name: str, *, priority: int) -> Any:
        if not self.separate:
            return None  # ``stream(None)``: the current stream
        if self.host:
            return HostStream(name)
        # The communication streams at high priority, as FSDP2's: their copies in and out
        # are not left behind compute kernels that the communication holds up.
        return torch.get_device_module(self.device).Stream(device=self.device, priority=priority)

    def current(self) -> Any:
        """The stream ops are queued on now."""
        if self.host:
            return self._stack[-1]
        return torch.get_device_module(self.device).current_stream(self.device)

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        """Queue the ops of the block on ``stream`` (``None``: stay on the current one)."""
        if stream is None:
            yield
        elif self.host:
            self._stack.append(stream)
            try:
                yield
            finally:
                self._stack.pop()
        else:
            with torch.get_device_module(self.device).stream(stream):
                yield

    def record(self, stream: Any = None, label: str = "") -> Any:
        """An event recorded on ``stream`` (default: the current one), marking what was queued
        there so far; ``None`` on one stream, where nothing needs waiting for."""
        if not self.separate:
            return None
        stream = self.current() if stream is None else stream
        if not self.host:
            return stream.record_event()
        event = HostEvent(next(self._ids), stream.name, label)
        if self.log is not None:
            self.log.append(("record", stream.name, event.id, label))
        return event

    def wait(self, event: Any, stream: Any = None) -> None:
        """``stream`` (default: the current one) runs what it is given next only after
        ``event``; nothing for ``None``."""
        if event is None:
            return
        stream = self.current() if stream is None else stream
        if not self.host:
            stream.wait_event(event)
        elif self.log is not None:
            known = isinstance(event, HostEvent)
            self.log.append(
                ("wait", stream.name, event.id if known else None, event.label if known else "")
            )

    def join(self, event: Any, stats: RuntimeStats) -> None:
        """The current (compute) stream waits for ``event``: on an accelerator this is where
        compute stalls on communication, so the wait is timed there ([Note: timing waits on an
        accelerator] in ``_metrics.py``); on the CPU the thread blocked in ``Work.wait()``."""
        if event is None:
            return
        if stats.on_device:
            with stats.waiting():
                self.wait(event)
        else:
            self.wait(event)

    def set_post_optim_event(self, event: Any) -> None:
        """The next all-gathers wait for ``event`` instead of the compute stream."""
        self._post_optim_event = event

    def order_gathers(self) -> None:
        """Before an unshard issues: both all-gather streams wait for the post-optimizer event
        if one was set, else for the compute stream now, unless they have since it last moved
        on (:meth:`compute_moved`): a wait then would order nothing new."""
        event, self._post_optim_event = self._post_optim_event, None
        if event is None:
            if self._gathers_current:
                return
            event = self.record(self.current(), "compute")
        self.wait(event, self.copy_in)
        self.wait(event, self.all_gather)
        self._gathers_current = True

    def compute_moved(self) -> None:
        """Compute is past something the next all-gathers must wait for: a unit resharded (its
        storage, which compute read, is freed and may be reused by the copy-in stream), or a
        root forward starts (an optimizer step may have written the shards)."""
        self._gathers_current = False


def wait_all(pendings: Iterable[_Waitable]) -> None:
    """Wait for issued collectives on the current (communication) stream: on the CPU the thread
    blocks and that is timed as exposed communication; on an accelerator only the stream waits,
    and the compute stream's wait is what is timed (:meth:`Streams.join`)."""
    for pending in pendings:
        pending.wait(timed=not pending.stats.on_device)


def _has_streams(device: torch.device) -> bool:
    """Whether ``device``'s torch module has streams (CUDA, XPU, MTIA, ...)."""
    try:
        module = torch.get_device_module(device)
    except RuntimeError:
        return False
    return hasattr(module, "Stream") and hasattr(module, "stream") and device.type != "cpu"
