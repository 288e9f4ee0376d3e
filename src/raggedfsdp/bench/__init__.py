"""``raggedfsdp bench``: raggedfsdp against FSDP2, DDP and the compute floor, interleaved.

Offers the command (:func:`configure_parser`, :func:`run`), the library call behind it
(:func:`run_bench` with :class:`BenchOptions`) and the renderers of its results
(:func:`render`, :func:`render_markdown`). The phases live in ``systems`` (what is compared),
``profile`` (the profiled step), ``memory`` (the memory phase), ``report`` (tables) and
``slow_link`` (the rate-limited loopback of ``--link-gbit``).
"""

from .options import (
    BENCH_MODELS,
    DEFAULT_SYSTEMS,
    SYSTEMS,
    BenchOptions,
    configure_parser,
    options_from_args,
)
from .report import render, render_markdown
from .run import run, run_bench
from .systems import make_batches

__all__ = [
    "BENCH_MODELS",
    "DEFAULT_SYSTEMS",
    "SYSTEMS",
    "BenchOptions",
    "configure_parser",
    "make_batches",
    "options_from_args",
    "render",
    "render_markdown",
    "run",
    "run_bench",
]
