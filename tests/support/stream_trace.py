"""The runtime's stream order, checked on the CPU: a trace of what each stream would run, and a
happens-before check of it.

On the CPU the runtime's streams are stand-ins that order nothing (``runtime/_streams.py``), so a
missing wait cannot show as a wrong value here. Instead the stand-in records every event and
wait, and a :class:`Trace` adds, on the same log, what ran on which stream:

- every read and write of tensor memory by an ATen op (:class:`_Accesses`, a dispatch mode), on
  the stream current then; a subclass tensor (the sharded parameters) as its inner tensors;
- every collective, as a stream of its own that starts where it was issued (NCCL's stream waits
  for the issuing stream) and ends where its ``wait()`` is called (the waiting stream waits for
  NCCL's), reading its input and writing its output in between;
- markers: a unit's forward starting, the pool's blocks taken and given back, the optimizer.

:func:`replay` gives every entry a vector clock (an event carries its stream's clock; a wait
joins it), so ``a`` happens before ``b`` on a GPU exactly when ``b``'s clock has seen ``a``
(:func:`happens_before`); :func:`races` lists each pair of accesses to the same bytes from two
streams, one a write, that no chain of events orders: what a GPU might run the other way round.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from collective_wrap import Call, wrapped_collectives
from harness import patched
from raggedfsdp.runtime._pool import BufferPool
from raggedfsdp.runtime._streams import Streams

__all__ = ["Stamped", "Trace", "describe", "happens_before", "races", "replay", "tracing"]

#: Ops whose tensor arguments are not read as data: metadata, and allocations shaped like them.
_NO_DATA = {
    "set_",
    "resize_",
    "detach",
    "detach_",
    "alias",
    "record_stream",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "new_empty",
    "new_empty_strided",
    "new_zeros",
    "new_ones",
    "new_full",
}


@dataclass
class Stamped:
    """A log entry that ran on a stream, with its vector clock."""

    index: int  # its place in the log
    entry: tuple[Any, ...]
    stream: str
    clock: dict[str, int]


def happens_before(a: Stamped, b: Stamped) -> bool:
    """Whether ``a`` is ordered before ``b`` on a GPU (program order on one stream, else a
    chain of events and waits)."""
    return a.clock[a.stream] <= b.clock.get(a.stream, 0)


def replay(log: list[tuple[Any, ...]]) -> list[Stamped]:
    """The entries that ran on a stream (accesses and markers), each with its vector clock."""
    clocks: dict[str, dict[str, int]] = {}
    events: dict[int, dict[str, int]] = {}
    collectives: dict[int, str] = {}  # id -> its stream's name
    out = []

    def tick(stream: str) -> dict[str, int]:
        clock = clocks.setdefault(stream, {})
        clock[stream] = clock.get(stream, 0) + 1
        return dict(clock)

    def join(stream: str, other: dict[str, int]) -> None:
        clock = clocks.setdefault(stream, {})
        for name, t in other.items():
            clock[name] = max(clock.get(name, 0), t)

    for index, entry in enumerate(log):
        kind, stream = entry[0], entry[1]
        if kind == "record":
            events[entry[2]] = tick(stream)
        elif kind == "wait":
            if entry[2] in events:
                join(stream, events[entry[2]])
        elif kind == "issue":  # a collective's own stream starts after its issuer's work
            collectives[entry[2]] = _collective(stream, entry[2])
            clocks[collectives[entry[2]]] = tick(stream)
        elif kind == "join":  # the waiting stream waits for the collective's work
            join(stream, clocks[collectives[entry[2]]])
        else:
            out.append(Stamped(index, entry, stream, tick(stream)))
    return out


def races(stamped: list[Stamped]) -> list[tuple[Stamped, Stamped]]:
    """Each pair of accesses to overlapping bytes of one storage, from two streams, one of them
    a write, that no event orders (the earlier access first): see :func:`describe`."""
    by_storage: dict[int, list[Stamped]] = {}
    for s in stamped:
        if s.entry[0] == "access":
            by_storage.setdefault(s.entry[2], []).append(s)
    found = []
    for accesses in by_storage.values():
        for i, b in enumerate(accesses):
            _, _, _, start, end, write, _ = b.entry
            for a in accesses[:i]:
                if a.stream == b.stream or not (write or a.entry[5]):
                    continue
                if a.entry[3] < end and start < a.entry[4] and not happens_before(a, b):
                    found.append((a, b))
    return found


def describe(pair: tuple[Stamped, Stamped]) -> str:
    """A race in words: which op on which stream, then which."""
    a, b = pair
    return f"{a.entry[6]} on {a.stream}, then {b.entry[6]} on {b.stream}"


class Trace:
    """The log of one root's stand-in streams, with what ran on them (module doc)."""

    def __init__(self, streams: Streams) -> None:
        assert streams.host, "the trace needs the CPU's stand-in streams"
        self.streams = streams
        self.log: list[tuple[Any, ...]] = []
        streams.log = self.log
        self._ids = itertools.count()
        #: every storage seen, kept alive so that no other storage takes its address
        self._storages: list[Any] = []

    @property
    def current(self) -> str:
        return self.streams.current().name

    def op(self, what: str, stream: str | None = None) -> None:
        """A marker on ``stream`` (default: the current one)."""
        self.log.append(("op", stream or self.current, what))

    def access(self, tensor: torch.Tensor, write: bool, what: str, stream: str | None = None):
        """``tensor``'s bytes read or written on ``stream`` (default: the current one)."""
        for t in _plain(tensor):
            if t.numel() == 0 or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            if storage.nbytes() == 0:
                continue
            self._storages.append(storage)
            start = t.storage_offset() * t.element_size()
            span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
            end = start + span * t.element_size()
            self.log.append(
                ("access", stream or self.current, storage._cdata, start, end, write, what)
            )

    def intercept(self, call: Call) -> Any:
        """The collectives (``collective_wrap.wrapped_collectives``): an asynchronous one as a
        stream of its own, from its issue to its ``wait()``."""
        if not call.asynchronous:
            self._touch(call, self.current)
            return call.issue()
        cid = next(self._ids)
        work = call.issue()  # what a wrapper outside (the emulation) queues at issue comes first
        self.log.append(("issue", self.current, cid))
        self._touch(call, _collective(self.current, cid))
        return _TracedWork(self, cid, work)

    def _touch(self, call: Call, stream: str) -> None:
        if call.input is not None:
            self.access(call.input, False, f"{call.kind} input", stream)
        if call.output is not None:
            self.access(call.output, True, f"{call.kind} output", stream)


class _TracedWork:
    def __init__(self, trace: Trace, cid: int, work: Any) -> None:
        self.trace, self.cid, self.work = trace, cid, work

    def wait(self, timeout: Any = None) -> bool:
        self.trace.log.append(("join", self.trace.current, self.cid))
        if self.work is not None:
            self.work.wait()
        return True

    def is_completed(self) -> bool:
        return True


def _collective(issuer: str, cid: int) -> str:
    """The stream of collective ``cid``, named after the stream that issued it."""
    return f"{issuer}/collective{cid}"


def _plain(tensor: torch.Tensor) -> list[torch.Tensor]:
    """``tensor``, or the plain tensors inside a subclass (a DTensor's local tensor)."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    inner = [getattr(tensor, name) for name in names]
    return [t for x in inner if isinstance(x, torch.Tensor) for t in _plain(x)]


class _Accesses(TorchDispatchMode):
    """Every ATen op's reads and writes, on the current stream; collectives are the
    interceptor's."""

    def __init__(self, trace: Trace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        namespace = func.namespace
        name = func.overloadpacket.__name__
        if namespace != "c10d" and name not in _NO_DATA:
            for i, arg in enumerate(func._schema.arguments):
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                alias = arg.alias_info
                if alias is not None and not alias.is_write:
                    continue  # a view of it is made, not its data read
                for t in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(t, torch.Tensor):
                        self.trace.access(t, alias is not None, name)
        return func(*args, **kwargs)


def _pool_markers(trace: Trace) -> contextlib.AbstractContextManager[None]:
    """Markers of each pool block taken and given back, by the block's storage."""
    take, give = BufferPool.take, BufferPool.give

    def taking(pool: BufferPool, *args: Any, **kwargs: Any) -> torch.Tensor:
        block = take(pool, *args, **kwargs)
        trace.op(f"take {block.untyped_storage()._cdata}")
        return block

    def giving(pool: BufferPool, block: torch.Tensor) -> None:
        trace.op(f"give {block.untyped_storage()._cdata}")
        give(pool, block)

    return patched(BufferPool, take=taking, give=giving)


@contextlib.contextmanager
def tracing(streams: Streams) -> Iterator[Trace]:
    """Trace the runtime's streams inside the block (module doc)."""
    trace = Trace(streams)
    with wrapped_collectives(trace.intercept), _pool_markers(trace), _Accesses(trace):
        yield trace
    streams.log = None
