"""Host syncs of an optimizer step, counted on the CPU (tests/unit/test_optim_host_syncs.py).

A host sync is an operation after which the host waits for an accelerator: reading a tensor's
data (``item()``, ``bool()``, ``float()``: ``aten._local_scalar_dense``, ``aten.equal``,
``aten.is_nonzero``), copying to the host (``.tolist()``, ``.cpu()``, ``.numpy()``; ``_to_copy``
or ``copy_`` to the CPU from another device) and the symmetric eigensolvers (``linalg.eigh``,
``eigvalsh``: the solver's status is read back). On the CPU the same operations run, so counting
them there counts what a step would make an accelerator's host wait for. Copies to the host are
seen where Python asks for them (a ``TorchFunctionMode``: on the CPU they dispatch nothing),
reads and solvers where they dispatch (a ``TorchDispatchMode``). A ``.to(device)`` is not
counted: on the CPU the parameters' device and the host are one, so it cannot tell a copy to
the host from a cast on the device.
Every read counts, including those of the ``step`` counters that torch's optimizers keep on the
host on an accelerator too, so the figures bound the accelerator's syncs from above; torch's
``AdamW`` reads one (``foreach=False``) or two (``foreach=True``) per parameter per step.

``python tests/support/host_syncs.py`` prints the counts per optimizer (docs/results/optimizers.md).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
#: Ops that read a tensor's data on the host, or solve on it and read the status back.
_READS = {_aten._local_scalar_dense.default, _aten.equal.default, _aten.is_nonzero.default}
_SOLVERS = {"_linalg_eigh", "linalg_eigh", "linalg_eigvalsh"}
#: Python-level copies to the host.
_TO_HOST = {torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy}


def _is_cpu(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == "cpu"
    return isinstance(value, (str, torch.device)) and torch.device(value).type == "cpu"


class _Copies(TorchFunctionMode):
    """Counts copies to the host as Python asks for them."""

    def __init__(self, counter: HostSyncs) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func not in _TO_HOST:
            return func(*args, **kwargs)
        self.counter.count(getattr(func, "__name__", str(func)))
        self.counter.inside += 1  # what the copy dispatches is not counted again
        try:
            return func(*args, **kwargs)
        finally:
            self.counter.inside -= 1


class _Dispatched(TorchDispatchMode):
    """Counts reads, solvers and device-to-host copies as they dispatch."""

    def __init__(self, counter: HostSyncs) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        device_to_host = (
            name in ("_to_copy", "copy_")
            and _is_cpu(kwargs.get("device", args[0]))
            and any(isinstance(a, torch.Tensor) and not _is_cpu(a) for a in args)
        )
        if not self.counter.inside and (func in _READS or name in _SOLVERS or device_to_host):
            self.counter.count(name)
        return func(*args, **kwargs)


class HostSyncs:
    """A context manager that counts host syncs (module docstring): ``total`` and ``by_op``."""

    def __init__(self) -> None:
        self.total = 0
        self.by_op: dict[str, int] = {}
        self.inside = 0
        self._modes = (_Copies(self), _Dispatched(self))

    def count(self, name: str) -> None:
        self.total += 1
        self.by_op[name] = self.by_op.get(name, 0) + 1

    def __enter__(self) -> HostSyncs:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


#: The parameters every optimizer is counted on: matrices of three shapes (two of them large
#: enough for AdamW8bit's 8-bit moments) and two vectors.
SHAPES = ((128, 64), (64, 128), (96, 40), (128,), (64,))


def make_params(seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=gen)) for shape in SHAPES]


def syncs_per_step(
    make: Callable[[list[nn.Parameter]], torch.optim.Optimizer], *, steps: int, warmup: int = 1
) -> list[int]:
    """The host syncs of each of ``steps`` steps of ``make(params)``, after ``warmup`` steps
    that are not counted (they make the state and the caches); fresh random gradients each."""
    params = make_params()
    optimizer = make(params)
    gen = torch.Generator().manual_seed(1)
    counts = []
    for step in range(warmup + steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        with HostSyncs() as syncs:
            optimizer.step()
        if step >= warmup:
            counts.append(syncs.total)
    return counts


def optimizers() -> dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]]:
    """Each optimizer counted, by name, with its defaults (Muon's auxiliary AdamW takes the
    vectors)."""
    import raggedfsdp as rf

    return {
        "torch AdamW foreach=False": lambda ps: torch.optim.AdamW(ps, foreach=False),
        "torch AdamW foreach=True": lambda ps: torch.optim.AdamW(ps, foreach=True),
        "rf Muon": lambda ps: rf.optim.Muon(ps, adamw_params=lambda p, shape: len(shape) < 2),
        "rf Shampoo": lambda ps: rf.optim.Shampoo(ps),
        "rf Shampoo precondition_frequency=1": lambda ps: rf.optim.Shampoo(
            ps, precondition_frequency=1, start_preconditioning_step=1
        ),
        "rf AdamW8bit": lambda ps: rf.optim.AdamW8bit(ps),
    }


def mean(counts: Sequence[int]) -> float:
    return statistics.fmean(counts) if counts else math.nan


def main() -> None:
    """Print the mean host syncs per step of every optimizer over 100 steps."""
    torch.set_num_threads(1)
    print(f"parameters: {', '.join(str(list(s)) for s in SHAPES)}; mean of steps 2-101")
    for name, make in optimizers().items():
        try:
            counts = syncs_per_step(make, steps=100)
        except (TypeError, ValueError) as err:  # an option this version does not have
            print(f"| {name} | n/a ({err}) |")
            continue
        print(f"| {name} | {mean(counts):.2f} | max {max(counts)} |")


if __name__ == "__main__":
    main()
