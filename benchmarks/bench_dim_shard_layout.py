"""What FSDP2's contiguous layout would cost a ``Shard(dim > 0)`` parameter (issue 35, item 5).

raggedfsdp gathers a ``Shard(d)`` parameter with ``d`` moved first and hands forward a strided
view of the gathered rows (``DimShard`` in ``runtime/_param_placement.py``): no copy. FSDP2
copies the gathered pieces out into a contiguous parameter after the all-gather and the
gradient back in before the reduce-scatter. This times, in one process (the collectives move the
same bytes either way), one forward and backward of a parameter both ways:

- ``strided``: forward computes with the view, autograd writes the gradient in the same strides;
- ``contiguous``: the copy-out (``torch.cat`` of the ``W`` pieces along ``d``), forward and
  backward with the contiguous parameter, the copy-in of its gradient (``W`` chunks along ``d``
  into the rank-major buffer).

Medians of interleaved repetitions, one thread. Usage::

    PYTHONPATH=src python3 benchmarks/bench_dim_shard_layout.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

WORLD = 4


def _gathered(shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """The all-gather's output: the ``W`` pieces of ``torch.chunk`` along ``dim``, rank-major."""
    full = torch.randn(shape)
    return torch.cat([c.contiguous().reshape(-1) for c in full.chunk(WORLD, dim)])


def _strided(shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """raggedfsdp's parameter: the rows along ``dim`` gathered contiguous, seen with ``dim``
    back in place."""
    moved = list(shape)
    moved.insert(0, moved.pop(dim))
    return torch.randn(moved).movedim(0, dim).requires_grad_()


def _step(
    compute: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, ...], dim: int
) -> dict[str, Callable[[], None]]:
    strided = _strided(shape, dim)
    gathered = _gathered(shape, dim)
    pieces = [
        p.view(c.shape)
        for p, c in zip(gathered.chunk(WORLD), torch.empty(shape).chunk(WORLD, dim), strict=True)
    ]
    buffer = torch.empty_like(gathered)

    def with_view() -> None:
        strided.grad = None
        compute(strided).sum().backward()

    def with_copies() -> None:
        param = torch.cat(pieces, dim).requires_grad_()  # copy-out
        compute(param).sum().backward()
        assert param.grad is not None
        torch.cat([c.reshape(-1) for c in param.grad.chunk(WORLD, dim)], out=buffer)  # copy-in

    return {"strided": with_view, "contiguous": with_copies}


#: name -> (parameter shape, shard dim, input shape, op)
CASES: dict[str, tuple[tuple[int, ...], int, tuple[int, ...], Callable[..., torch.Tensor]]] = {
    "linear 2048x2048 Shard(1), 512 tokens": ((2048, 2048), 1, (512, 2048), F.linear),
    "conv 256x256x3x3 Shard(1), 8x256x16x16": (
        (256, 256, 3, 3),
        1,
        (8, 256, 16, 16),
        lambda x, w: F.conv2d(x, w, padding=1),
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", help="write the medians (seconds) here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out: dict[str, dict[str, float]] = {}
    for name, (shape, dim, input_shape, op) in CASES.items():
        x = torch.randn(input_shape)
        steps = _step(lambda w, x=x, op=op: op(x, w), shape, dim)
        times: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(args.repeats):
            for kind, step in steps.items():  # interleaved: load drifts alike for both
                start = time.perf_counter()
                step()
                times[kind].append(time.perf_counter() - start)
        out[name] = {k: statistics.median(v) for k, v in times.items()}
        ratio = out[name]["contiguous"] / out[name]["strided"]
        print(
            f"{name}: strided {out[name]['strided'] * 1e3:.1f} ms, "
            f"contiguous with copies {out[name]['contiguous'] * 1e3:.1f} ms ({ratio:.2f}x)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
