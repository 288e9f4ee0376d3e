"""Metrics and memory figures that stay right on a GPU, checked on this CPU machine through
explicit devices and stand-ins for CUDA (a GPU run, where there is one, checks the real thing):

- waits on an accelerator are timed by events recorded around ``wait()`` on the compute stream
  and read when the stats are, never at each wait ([Note: timing waits on an accelerator]);
  on the CPU by ``perf_counter``;
- ``reset_stats`` restarts the device's peak memory, and a record of ``metrics.jsonl`` takes the
  largest peak of its window's steps;
- the preflight's budget is each local rank's own GPU, the tightest of them, not GPU 0's.
"""

from __future__ import annotations

import time
from typing import ClassVar

import pytest
import torch

from raggedfsdp.runtime import RuntimeStats
from raggedfsdp.train import preflight
from raggedfsdp.train.monitor import window_peaks


class FakeEvent:
    """A timing event on the host's clock that records who asked it what."""

    log: ClassVar[list[str]] = []

    def __init__(self) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()
        FakeEvent.log.append("record")

    def synchronize(self) -> None:
        FakeEvent.log.append("synchronize")

    def elapsed_time(self, end: FakeEvent) -> float:
        FakeEvent.log.append("elapsed_time")
        return 1000 * (end.at - self.at)


@pytest.fixture
def cuda_memory(monkeypatch):
    """CUDA's peak-memory calls, recorded (none are made on a CPU device)."""
    calls: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(("reset", d)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: calls.append(("max", d)) or 7)
    return calls


def test_waits_on_an_accelerator_are_read_only_with_the_stats(cuda_memory):
    FakeEvent.log = []
    stats = RuntimeStats(device=torch.device("cuda", 1), make_event=FakeEvent)
    for _ in range(3):
        with stats.waiting():
            time.sleep(0.01)
    # Three waits: an event before and after each, nothing read back (no host sync per wait).
    assert FakeEvent.log == ["record"] * 6
    assert stats.comm_wait_seconds == 0.0
    snapshot = stats.snapshot()
    assert FakeEvent.log[6:] == ["synchronize", "elapsed_time"] * 3
    assert 0.03 <= snapshot["comm_wait_seconds"] < 1.0
    assert snapshot["cuda_max_allocated_bytes"] == 7
    assert cuda_memory == [("max", torch.device("cuda", 1))]
    # Read once: a second snapshot adds nothing more.
    assert stats.snapshot()["comm_wait_seconds"] == snapshot["comm_wait_seconds"]


def test_reset_drops_pending_waits_and_restarts_the_device_peak(cuda_memory):
    FakeEvent.log = []
    stats = RuntimeStats(device="cuda:0", make_event=FakeEvent)
    with stats.waiting():
        pass
    stats.reset()
    assert cuda_memory == [("reset", torch.device("cuda", 0))]
    assert stats.snapshot()["comm_wait_seconds"] == 0.0
    assert "elapsed_time" not in FakeEvent.log


def test_waits_on_the_cpu_are_timed_on_the_host(cuda_memory):
    stats = RuntimeStats(device="cpu")
    with stats.waiting():
        time.sleep(0.01)
    assert stats.comm_wait_seconds >= 0.01  # at once: the thread itself was blocked
    stats.reset()
    assert "cuda_max_allocated_bytes" not in stats.snapshot()
    assert cuda_memory == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_stalled_compute_stream_is_timed_on_a_gpu():
    stats = RuntimeStats(device=torch.device("cuda", torch.cuda.current_device()))
    with stats.waiting():
        torch.cuda._sleep(50_000_000)  # the stream stalls; the host goes on at once
    assert stats.snapshot()["comm_wait_seconds"] > 0.001


def test_a_record_takes_the_largest_device_peak_of_its_window():
    window = [
        {"framework_bytes": 5.0, "cuda_peak_bytes": 30.0},
        {"framework_bytes": 9.0, "cuda_peak_bytes": 10.0},
    ]
    stats = {"process_peak_rss_bytes": 100.0, "cuda_max_allocated_bytes": 10.0}
    assert window_peaks(window, stats, 3) == [100.0, 9.0, 3, 30.0]


GIB = 2**30


@pytest.fixture
def four_gpus(monkeypatch):
    """A node of four 80 GiB GPUs with 10, 20, 5 and 30 GiB in use."""
    used = [10 * GIB, 20 * GIB, 5 * GIB, 30 * GIB]
    props = type("Props", (), {"total_memory": 80 * GIB})()
    monkeypatch.setattr(preflight.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(preflight.torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(preflight.torch.cuda, "get_device_properties", lambda _: props)
    monkeypatch.setattr(preflight.torch.cuda, "device_memory_used", lambda index: used[index])
    return used


def test_each_rank_is_budgeted_on_its_own_gpu(four_gpus):
    budget, source = preflight._memory_per_rank(4)
    assert budget == 50 * GIB  # GPU 3, the fullest, bounds every rank
    assert source == (
        "GPU 3's free memory, 50.0 GiB of 80.0 GiB (the least of the 4 GPUs this node's ranks use)"
    )
    budget, source = preflight._memory_per_rank(2)  # ranks on GPUs 0 and 1 only
    assert budget == 60 * GIB and source.startswith("GPU 1's free memory, 60.0 GiB")
    assert preflight._memory_per_rank(1) == (70 * GIB, "GPU 0's free memory, 70.0 GiB of 80.0 GiB")


def test_gpu_0_alone_is_not_the_budget(four_gpus):
    """Negative control: GPU 0 has the most free memory here; reading it alone (as before)
    would promise every rank 70 GiB where rank 3 has 50."""
    assert preflight._memory_per_rank(4)[0] < 80 * GIB - four_gpus[0]
