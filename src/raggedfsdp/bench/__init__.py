"""The benchmark behind ``raggedfsdp bench``: raggedfsdp against FSDP2, DDP and the compute floor.

The systems run interleaved. Offers the library call (:func:`run_bench` with :class:`BenchOptions`),
which returns the results as a JSON-ready dict; the command and its tables are
:mod:`raggedfsdp.cli.bench`. The phases live in ``systems`` (what is compared), ``profile`` (the
profiled step), ``memory`` (the memory phase) and ``slow_link`` (the rate-limited loopback of
``--link-gbit``).
"""

from .options import BENCH_MODELS, DEFAULT_SYSTEMS, SYSTEMS, BenchOptions
from .run import run_bench
from .systems import make_batches

__all__ = [
    "BENCH_MODELS",
    "DEFAULT_SYSTEMS",
    "SYSTEMS",
    "BenchOptions",
    "make_batches",
    "run_bench",
]
