"""The slow-link bed: ranks whose traffic crosses a rate-limited loopback.

Loopback here moves ~10 Gbit/s and hides every communication feature. A network namespace has
a loopback of its own; a token-bucket filter on it (``tc qdisc ... tbf``) throttles everything
the ranks inside send each other. :func:`throttled_loopback` makes one, the ranks join it
(:func:`raggedfsdp.spawn.run_on_ranks`, ``netns=``) and it is always removed afterwards. Only
loopback addresses are used, inside the namespace. Needs root and iproute2 (``ip``, ``tc``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

__all__ = ["throttled_loopback"]

# Token bucket: 256 KiB bursts, packets dropped after 50 ms in the queue (the settings,
# which measured 1.00 and 3.94 Gbit/s at 1 and 4 Gbit/s here).
_BURST, _LATENCY = "256kb", "50ms"


def _check_can_throttle() -> None:
    if os.geteuid() != 0:
        raise ValueError(
            "--link-gbit needs root: it creates a network namespace and a tc qdisc; run as "
            "root, or without --link-gbit"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ValueError(
            f"--link-gbit needs the {' and '.join(missing)} command(s) (iproute2), which are "
            f"not on PATH"
        )


def _run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode:
        raise ValueError(
            f"--link-gbit: `{' '.join(argv)}` failed: {proc.stderr.strip() or proc.returncode}"
        )


@contextlib.contextmanager
def throttled_loopback(rate_gbit: float | None) -> Iterator[str | None]:
    """The name of a fresh network namespace whose loopback is up and limited to
    ``rate_gbit`` Gbit/s, deleted on exit whatever happens; ``None`` (no namespace) when
    ``rate_gbit`` is ``None``."""
    if rate_gbit is None:
        yield None
        return
    _check_can_throttle()
    name = f"raggedfsdp-bench-{os.getpid()}"
    _run("ip", "netns", "add", name)
    try:
        _run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        rate = f"{rate_gbit * 1000:g}mbit"
        _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
             "rate", rate, "burst", _BURST, "latency", _LATENCY)  # fmt: skip
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
