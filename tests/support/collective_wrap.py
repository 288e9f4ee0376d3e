"""Wrappers of the process-group calls the runtime makes: a recorder, and NCCL's asynchrony
emulated on Gloo.

The runtime's bucket collectives find torch's functions on ``torch.distributed`` at each call
([Note: torch's collectives looked up per call] in ``runtime/_transport.py``), so replacing
those attributes for the length of a ``with`` block (:func:`wrapped_collectives`) sees every
call: ``all_gather_single``, ``reduce_scatter_single``, ``all_to_all_single``, ``all_reduce``,
``isend`` and ``irecv``, whoever issues them (the runtime, an optimizer, the test itself).

- :class:`Recorder` keeps, per call, what NCCL needs every member of the communicator to agree
  on: the kind, the dtype and the sizes (and the group, where the buffers start). NCCL matches
  collectives by their order alone (it has no tags), so a member whose sequence differs hangs
  or corrupts: tests compare the members' sequences group by group (:func:`first_difference`).
- :class:`AsyncEmulation` gives Gloo NCCL's contract for an asynchronous collective: its
  outputs hold garbage (poison: every byte 0xFF, a NaN in every float dtype) until its
  ``Work.wait()`` returns, and its inputs must stay unchanged until then; and it poisons every
  block the runtime's :class:`~raggedfsdp.runtime._pool.BufferPool` takes back. A runtime that
  reads a buffer before waiting, writes an input in flight or hands back a block a collective
  still reads then computes with NaN or is reported, where plain Gloo (whose ``wait`` follows
  the data closely) would hide it. ``use_before_wait`` plants that bug (negative controls).

Synchronous calls (``async_op=False``) run as they are: they complete before returning on
NCCL too.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from raggedfsdp.runtime._pool import BufferPool

__all__ = [
    "AsyncEmulation",
    "Call",
    "Record",
    "Recorder",
    "emulated_asynchrony",
    "emulated_when",
    "first_difference",
    "poison_",
    "recording",
    "wrapped_collectives",
]

#: Every byte of a poisoned buffer: 0xFF is NaN in fp32, bf16 and fp16, and a NaN scale in a
#: compressed message (which the runtime then reports as a non-finite value).
POISON_BYTE = 0xFF


@dataclass(frozen=True)
class _Kind:
    """How one of torch's functions names its buffers."""

    kind: str  # what the records call it
    output: str | None  # the argument it writes (None: it writes nothing)
    input: str | None  # the argument it reads (the output too for an in-place call)


def _kinds() -> dict[str, _Kind]:
    """torch's function names -> their :class:`_Kind`; the tensor forms under the names this
    torch has, as ``_transport`` picks them."""
    gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    scatter = (
        "reduce_scatter_single"
        if hasattr(dist, "reduce_scatter_single")
        else "reduce_scatter_tensor"
    )
    return {
        gather: _Kind("all_gather", "output_tensor", "input_tensor"),
        scatter: _Kind("reduce_scatter", "output", "input"),
        "all_to_all_single": _Kind("all_to_all", "output", "input"),
        "all_reduce": _Kind("all_reduce", "tensor", "tensor"),
        "isend": _Kind("send", None, "tensor"),
        "irecv": _Kind("recv", "tensor", None),
    }


@dataclass
class Call:
    """One intercepted call: its kind and bound arguments; :meth:`issue` makes it."""

    kind: str
    spec: _Kind
    arguments: inspect.BoundArguments
    original: Callable[..., Any]

    @property
    def output(self) -> torch.Tensor | None:
        return None if self.spec.output is None else self.arguments.arguments[self.spec.output]

    @property
    def input(self) -> torch.Tensor | None:
        return None if self.spec.input is None else self.arguments.arguments[self.spec.input]

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.arguments.arguments.get("group")

    @property
    def asynchronous(self) -> bool:
        """Whether the caller gets a handle to wait on (point-to-point calls always do)."""
        return self.kind in ("send", "recv") or bool(self.arguments.arguments.get("async_op"))

    def issue(self, **buffers: torch.Tensor) -> Any:
        """Make the call with torch's function, some buffers replaced (by argument name)."""
        arguments = {**self.arguments.arguments, **buffers}
        return self.original(**arguments)


#: ``interceptor(call) -> what torch's function returns``
Interceptor = Callable[[Call], Any]


@contextlib.contextmanager
def wrapped_collectives(interceptor: Interceptor) -> Iterator[None]:
    """Route the process-group calls made on ``torch.distributed`` inside the block through
    ``interceptor``; blocks nest (the inner interceptor sees the calls first)."""
    saved = {}
    for name, spec in _kinds().items():
        original = getattr(dist, name)
        saved[name] = original
        setattr(dist, name, _wrapper(spec, original, interceptor))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)


def _wrapper(
    spec: _Kind, original: Callable[..., Any], interceptor: Interceptor
) -> Callable[..., Any]:
    signature = inspect.signature(original)  # torch's own, through any wrapper's __wrapped__

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return interceptor(Call(spec.kind, spec, bound, original))

    return call


# -- the recorder --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """What NCCL needs every member of a communicator to agree on, for one call."""

    kind: str
    group: str  # the group's name: the same on every member (groups are made in one order)
    ranks: tuple[int, ...]  # the group's global ranks
    dtype: str
    input_numel: int
    output_numel: int
    #: the byte offset of each buffer's start modulo 16 (NCCL's vector loads want 0)
    misalignment: tuple[int, ...]

    @property
    def key(self) -> tuple[str, str, int, int]:
        """What every member must issue alike: kind, dtype and sizes."""
        return (self.kind, self.dtype, self.input_numel, self.output_numel)

    @property
    def nbytes(self) -> tuple[int, int]:
        """The input's and the output's bytes."""
        itemsize = getattr(torch, self.dtype.removeprefix("torch.")).itemsize
        return (self.input_numel * itemsize, self.output_numel * itemsize)


@dataclass
class Recorder:
    """Keeps a :class:`Record` of every call while :attr:`on` (turn it on for the steps to
    compare, off for set-up a test does not judge)."""

    records: list[Record] = field(default_factory=list)
    on: bool = True

    def __call__(self, call: Call) -> Any:
        if self.on:
            self.records.append(_record(call))
        return call.issue()

    def take(self) -> list[Record]:
        """The records so far, and start afresh."""
        out, self.records = self.records, []
        return out


def _record(call: Call) -> Record:
    group = call.group if call.group is not None else dist.group.WORLD
    buffers = [t for t in (call.input, call.output) if t is not None]
    return Record(
        kind=call.kind,
        group=group.group_name,
        ranks=tuple(dist.get_process_group_ranks(group)),
        dtype=str(buffers[0].dtype),
        input_numel=0 if call.input is None else call.input.numel(),
        output_numel=0 if call.output is None else call.output.numel(),
        misalignment=tuple(t.data_ptr() % 16 for t in buffers),
    )


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    """A :class:`Recorder` of the calls made inside the block."""
    recorder = Recorder()
    with wrapped_collectives(recorder):
        yield recorder


def first_difference(per_rank: Mapping[int, Sequence[Record]]) -> str | None:
    """``None`` when, on every communicator, its members among ``per_rank`` (global rank ->
    its records) issued the same sequence of calls (:attr:`Record.key`), else the first
    difference, naming the group, the ranks and the call. NCCL matches calls by their order
    on a communicator alone, so any difference there hangs or corrupts a run."""
    on_group: dict[str, dict[int, list[Record]]] = {}
    for rank, records in per_rank.items():
        for record in records:
            members = on_group.setdefault(record.group, {r: [] for r in record.ranks})
            members[rank].append(record)
    for name, members in on_group.items():
        seen = {rank: calls for rank, calls in members.items() if rank in per_rank}
        (first, reference), *others = seen.items()
        for rank, calls in others:
            for i, (want, got) in enumerate(zip(reference, calls, strict=False)):
                if want.key != got.key:
                    return (
                        f"group {name} {_ranks(want.ranks)}, call {i}: rank {first} issued "
                        f"{_short(want)}, rank {rank} {_short(got)}"
                    )
            if len(calls) != len(reference):
                return (
                    f"group {name} {_ranks(reference[0].ranks if reference else calls[0].ranks)}:"
                    f" rank {first} issued {len(reference)} calls, rank {rank} {len(calls)}"
                )
    return None


def _ranks(ranks: tuple[int, ...]) -> str:
    return f"[{ranks[0]}..{ranks[-1]}] ({len(ranks)} ranks)" if len(ranks) > 4 else str(list(ranks))


def _short(record: Record) -> str:
    kind, dtype, numel, out = record.key
    return f"{kind}({dtype}, {numel} -> {out})"


# -- the asynchrony emulation --------------------------------------------------------------------


def poison_(tensor: torch.Tensor) -> None:
    """Fill ``tensor`` (any dtype) with the poison byte."""
    if tensor.numel():
        _bytes(tensor).fill_(POISON_BYTE)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a 1-D uint8 view (the runtime's buffers are contiguous)."""
    return tensor.reshape(-1).view(torch.uint8)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bytes(a), _bytes(b))


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share bytes (an in-place all-gather's input is its
    rank's slot of the output)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


@dataclass
class AsyncEmulation:
    """The interceptor of :func:`emulated_asynchrony` (module doc): the real call runs on
    private copies of the buffers; the caller's output is poisoned until ``wait()``."""

    #: kinds whose handles' wait() returns with the output still poisoned: what a runtime that
    #: read the buffer before waiting would see (the planted bug of negative controls)
    use_before_wait: frozenset[str] = frozenset()
    #: what went wrong, one line each: an input changed or an output written before wait()
    violations: list[str] = field(default_factory=list)
    issued: int = 0  # asynchronous calls emulated
    waited: int = 0  # of those, how many were waited for
    planted: int = 0  # of those, how many returned with the output poisoned (use_before_wait)

    @property
    def unwaited(self) -> int:
        """Asynchronous calls issued and never waited for: their outputs stay poisoned."""
        return self.issued - self.waited

    def failure(self) -> str | None:
        """``None`` when the caller kept NCCL's contract, else what it broke (first three)."""
        if not self.violations and not self.unwaited:
            return None
        return f"{self.unwaited} calls never waited for; {self.violations[:3]}"

    def __call__(self, call: Call) -> Any:
        if not call.asynchronous:
            return call.issue()
        self.issued += 1
        return _EmulatedWork(self, call)

    def poisoning_pool(self) -> contextlib.AbstractContextManager[None]:
        """Poison every block handed back to a :class:`BufferPool` inside the block."""
        return _poisoned_pool_returns()


class _EmulatedWork:
    """The handle of one emulated asynchronous call: the real call is in flight on private
    copies; ``wait()`` checks what the caller must not have touched, then delivers."""

    def __init__(self, emulation: AsyncEmulation, call: Call) -> None:
        self.emulation, self.call = emulation, call
        out, inp = call.output, call.input
        in_place = out is not None and inp is not None and out is inp
        #: the real call's buffers: the input as it is now, a fresh output
        self.real_input = None if inp is None else inp.clone()
        self.real_output = None if out is None else torch.empty_like(out)
        buffers = {}
        if inp is not None:
            buffers[call.spec.input] = self.real_input if not in_place else self.real_output
        if out is not None:
            if in_place:
                self.real_output.copy_(inp)
            buffers[call.spec.output] = self.real_output
        self.work = call.issue(**buffers)
        if out is not None:
            poison_(out)
            if inp is not None and not in_place and _overlap(inp, out):
                inp.copy_(self.real_input)  # NCCL's in-place all-gather keeps the input slot
        #: what the caller's buffers must still hold when it waits
        self.frozen_input = None if inp is None or in_place else inp.clone()
        self.frozen_output = None if out is None else out.clone()
        self.done = False

    def wait(self, timeout: Any = None) -> bool:
        if self.done:
            return True
        self.done = True
        self.emulation.waited += 1
        if self.work is not None:
            self.work.wait()
        call = self.call
        if self.frozen_input is not None and not _same_bytes(call.input, self.frozen_input):
            self._violation("its input changed before wait()")
        if self.frozen_output is not None and not _same_bytes(call.output, self.frozen_output):
            self._violation("its output was written before wait()")
        if call.output is None:
            return True
        if call.kind in self.emulation.use_before_wait:
            self.emulation.planted += 1
        else:
            call.output.copy_(self.real_output)
        return True

    def is_completed(self) -> bool:
        return self.done

    def _violation(self, what: str) -> None:
        call = self.call
        tensor = call.output if call.output is not None else call.input
        self.emulation.violations.append(
            f"{call.kind} of {tensor.numel()} x {tensor.dtype}: {what}"
        )


@contextlib.contextmanager
def _poisoned_pool_returns() -> Iterator[None]:
    give = BufferPool.give

    def poisoning_give(pool: BufferPool, block: torch.Tensor) -> None:
        poison_(block)  # whatever still reads it (a collective in flight) reads NaN now
        give(pool, block)

    BufferPool.give = poisoning_give  # type: ignore[method-assign]
    try:
        yield
    finally:
        BufferPool.give = give  # type: ignore[method-assign]


@contextlib.contextmanager
def emulated_asynchrony(use_before_wait: Sequence[str] = ()) -> Iterator[AsyncEmulation]:
    """NCCL's asynchrony on the calls made inside the block (module doc); the emulation's
    ``violations`` and ``unwaited`` say what the caller did wrong. ``use_before_wait`` (kinds,
    e.g. ``("all_gather",)``) plants a use-before-wait for negative controls."""
    emulation = AsyncEmulation(use_before_wait=frozenset(use_before_wait))
    with wrapped_collectives(emulation), emulation.poisoning_pool():
        yield emulation


def emulated_when(enabled: bool) -> contextlib.AbstractContextManager[AsyncEmulation | None]:
    """:func:`emulated_asynchrony` when ``enabled`` (a case on the NCCL branch), else a block
    that changes nothing and yields ``None``."""
    return emulated_asynchrony() if enabled else contextlib.nullcontext()
