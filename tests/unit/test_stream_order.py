"""The CPU's stand-in streams (``runtime/_streams.py``) and the pool's events, as pure logic:
what is recorded and waited for, on which stream; and the trace's happens-before replay
(``tests/support/stream_trace.py``) on hand-made logs, a missing wait included; the
accelerator branch on a stand-in for ``torch.cuda`` (the calls it makes, not a GPU's order)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import ClassVar

import torch

from raggedfsdp.runtime._metrics import RuntimeStats
from raggedfsdp.runtime._pool import BufferPool
from raggedfsdp.runtime._streams import HostEvent, Streams
from stream_trace import happens_before, races, replay

CPU = torch.device("cpu")


def _streams() -> Streams:
    streams = Streams(CPU)
    streams.log = []
    return streams


def test_the_all_gather_streams_wait_for_compute_once_until_it_moves_on():
    streams = _streams()
    streams.order_gathers()
    streams.order_gathers()  # nothing new to wait for
    assert streams.log == [
        ("record", "compute", 0, "compute"),
        ("wait", "all_gather_copy_in", 0, "compute"),
        ("wait", "all_gather", 0, "compute"),
    ]
    streams.compute_moved()
    streams.order_gathers()
    assert [e[:3] for e in streams.log[3:]] == [
        ("record", "compute", 1),
        ("wait", "all_gather_copy_in", 1),
        ("wait", "all_gather", 1),
    ]


def test_a_post_optim_event_replaces_the_compute_wait_once():
    streams = _streams()
    with streams.use(streams.reduce_scatter):  # an optimizer on a stream of its own, say
        event = streams.record(label="post_optim")
    streams.set_post_optim_event(event)
    streams.compute_moved()
    streams.order_gathers()
    assert streams.log == [
        ("record", "reduce_scatter", 0, "post_optim"),
        ("wait", "all_gather_copy_in", 0, "post_optim"),
        ("wait", "all_gather", 0, "post_optim"),
    ]
    streams.compute_moved()
    streams.order_gathers()  # used up: the compute stream again
    assert streams.log[3][:2] == ("record", "compute")
    # A user's torch.Event (CPU events exist): waited for, as an event the stand-in cannot see
    streams.set_post_optim_event(torch.Event(device="cpu"))
    streams.order_gathers()
    assert streams.log[-2:] == [
        ("wait", "all_gather_copy_in", None, ""),
        ("wait", "all_gather", None, ""),
    ]


def test_streams_nest_and_one_stream_records_nothing():
    streams = _streams()
    with streams.use(streams.all_gather):
        assert streams.current().name == "all_gather"
        with streams.use(None):  # stays where it is
            assert streams.current().name == "all_gather"
    assert streams.current().name == "compute"
    single = Streams(CPU, separate=False)
    single.log = []
    assert single.copy_in is None and single.record() is None
    single.order_gathers()
    single.wait(None)
    assert single.log == []


def test_a_pool_block_is_taken_after_the_event_of_the_stream_that_gave_it_back():
    streams = _streams()
    pool = BufferPool(RuntimeStats(), streams=streams)
    block = pool.take(8, torch.float32, CPU)  # allocated on compute
    with streams.use(streams.reduce_scatter):
        pool.give(block)  # its last reader
    with streams.use(streams.all_gather):
        assert pool.take(8, torch.float32, CPU) is block
        pool.give(block)
    pool.clear()
    assert [e[:3] for e in streams.log] == [
        ("record", "reduce_scatter", 0),
        ("wait", "all_gather", 0),  # the taker waits
        ("record", "all_gather", 1),
        ("wait", "compute", 1),  # freed only once the stream it was allocated on waits
    ]


def test_replay_orders_through_events_and_collectives():
    log = [
        ("op", "compute", "a"),
        ("record", "compute", 0, ""),
        ("wait", "side", 0, ""),
        ("op", "side", "b"),
        ("issue", "side", 7),
        ("access", "side/collective7", 1, 0, 8, True, "recv"),
        ("op", "compute", "c"),
        ("join", "compute", 7),
        ("op", "compute", "d"),
    ]
    a, b, recv, c, d = replay(log)
    assert happens_before(a, b) and happens_before(b, recv) and happens_before(recv, d)
    assert not happens_before(recv, c) and not happens_before(c, b)
    assert isinstance(HostEvent(0, "compute", ""), HostEvent)


def test_races_finds_an_unordered_write_and_read_only_without_the_wait():
    ordered = [
        ("access", "all_gather", 5, 0, 16, True, "dequantize"),
        ("record", "all_gather", 0, ""),
        ("wait", "compute", 0, ""),
        ("access", "compute", 5, 8, 24, False, "mm"),
    ]
    assert races(replay(ordered)) == []
    missing = [e for e in ordered if e[0] != "wait"]  # the planted bug
    assert len(races(replay(missing))) == 1
    disjoint = [*missing[:-1], ("access", "compute", 5, 16, 24, False, "mm")]
    assert races(replay(disjoint)) == []  # other bytes of the same storage


class _FakeStream:
    """A device stream that records what is asked of it (for the accelerator branch)."""

    calls: ClassVar[list[tuple[str, ...]]] = []

    def __init__(self, device: object = None, priority: int = 0, name: str = "") -> None:
        self.name = name or f"side{priority}"

    def record_event(self) -> str:
        event = f"event@{self.name}"
        _FakeStream.calls.append(("record", self.name))
        return event

    def wait_event(self, event: str) -> None:
        _FakeStream.calls.append(("wait", self.name, event))


class _FakeModule:
    """``torch.cuda`` as far as ``Streams`` uses it."""

    Stream = _FakeStream

    def __init__(self) -> None:
        self.compute = _FakeStream(name="compute")
        self.stack = [self.compute]

    def current_stream(self, device: object = None) -> _FakeStream:
        return self.stack[-1]

    @contextlib.contextmanager
    def stream(self, stream: _FakeStream) -> Iterator[None]:
        self.stack.append(stream)
        try:
            yield
        finally:
            self.stack.pop()


def test_on_an_accelerator_the_device_modules_streams_and_events_are_used(monkeypatch):
    module = _FakeModule()
    monkeypatch.setattr(torch, "get_device_module", lambda device=None: module)
    _FakeStream.calls = []
    streams = Streams(torch.device("cuda", 0))
    assert not streams.host and isinstance(streams.copy_in, _FakeStream)
    streams.order_gathers()
    assert _FakeStream.calls == [
        ("record", "compute"),
        ("wait", streams.copy_in.name, "event@compute"),
        ("wait", streams.all_gather.name, "event@compute"),
    ]
    with streams.use(streams.reduce_scatter):
        assert streams.current() is streams.reduce_scatter
    # An unpooled block given back on another stream is held until the stream it was
    # allocated on waits for its event (its memory goes back to that stream's allocations).
    _FakeStream.calls = []
    pool = BufferPool(RuntimeStats(), retain=False, streams=streams)
    block = pool.take(4, torch.float32, CPU)
    with streams.use(streams.reduce_scatter):
        pool.give(block)
    assert pool._releasing and _FakeStream.calls == [("record", streams.reduce_scatter.name)]
    pool.take(4, torch.float32, CPU)
    assert not pool._releasing
    assert _FakeStream.calls[-1] == ("wait", "compute", f"event@{streams.reduce_scatter.name}")
