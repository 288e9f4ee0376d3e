"""The slow-link bed (``raggedfsdp bench --link-gbit``): a network namespace whose loopback is
rate-limited by a token bucket. Measured with two real Gloo ranks inside it: the rate holds with
the small bucket the capacity validation uses, and it is shared by both directions (each rank
gets rate / W when both send), which is what :func:`per_rank_gbit` tells the planner."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from raggedfsdp.bench.link_probe import probe_link
from raggedfsdp.bench.options import BenchOptions
from raggedfsdp.bench.slow_link import per_rank_gbit, throttled_loopback

can_throttle = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")),
    reason="the bed needs root and iproute2",
)


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@can_throttle
def test_the_bed_gives_each_rank_its_share_of_the_rate():
    # The fastest of up to three probes: the bucket caps the rate, and the suite's other worker
    # can only slow a sender below it (measured: 107.6 of 125 MB/s once, under a launch beside).
    one_way = both_ways = 0.0
    for _ in range(3):
        probe = probe_link(1.0, burst_kb=32, timeout=120)
        one_way, both_ways = max(one_way, probe["one_way"]), max(both_ways, probe["both_ways"])
        if one_way >= 0.9 * 1e9 / 8 and both_ways >= 0.9 * per_rank_gbit(1.0, 2) * 1e9 / 8:
            break
    assert one_way == pytest.approx(1e9 / 8, rel=0.1)  # bytes/s
    # both ranks sending at once share the bucket: each gets rate / 2
    assert both_ways == pytest.approx(per_rank_gbit(1.0, 2) * 1e9 / 8, rel=0.1)
    assert "raggedfsdp-bench" not in _namespaces()  # removed afterwards


@can_throttle
def test_the_bed_is_removed_when_the_body_fails():
    with pytest.raises(RuntimeError, match="inside"), throttled_loopback(1.0) as netns:
        assert netns in _namespaces()
        raise RuntimeError("inside")
    assert netns not in _namespaces()


def test_a_bucket_too_small_for_a_packet_is_refused():
    with pytest.raises(ValueError, match="--link-burst-kb must be >= 16, got 8"):
        BenchOptions(link_gbit=1.0, link_burst_kb=8)
    with pytest.raises(ValueError, match="--link-burst-kb must be >= 16, got 8"):  # noqa: SIM117
        with throttled_loopback(1.0, burst_kb=8):
            pass
