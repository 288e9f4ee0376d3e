"""Hardware presets of the capacity planner: what one device computes, holds and sends.

Published figures (sources in docs/capacity.md): dense BF16 peak, HBM capacity and bandwidth, NVLink
per direction per GPU, one NIC per GPU between nodes (DGX/HGX: eight GPUs a node). ``cpu-gloo`` is
this repository's test machine, one thread per rank, measured by ``tools/calibrate_cpu_gloo.py``
(its "peak" a measured fp32 matmul rate, its "HBM" the host's memory). Any figure can be overridden
(:func:`hardware` keyword arguments, or ``raggedfsdp plan --link-gbit / --efficiency``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["HARDWARE", "Hardware", "hardware"]

_GB = 10**9

# Figures that are costs a preset may not have at all (the rest are rates and sizes: positive).
_MAY_BE_ZERO = frozenset({"link_cpu_s_per_byte"})


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One device and its links. Bandwidths are per device, per direction.

    Attributes:
        name: the preset's name.
        peak_flops: dense peak of the training dtype (BF16 tensor cores; fp32 matmul on CPU).
        efficiency: the fraction of ``peak_flops`` a training step's compute reaches (model FLOPs
            utilisation of the compute alone, communication excluded).
        memory_bytes: device memory (HBM; host RAM for CPU).
        memory_bytes_per_s: memory bandwidth (the optimizer step is bound by it).
        intra_bytes_per_s: bandwidth between devices of one node (NVLink; loopback on CPU).
        inter_bytes_per_s: bandwidth of one device to another node (its NIC).
        devices_per_node: devices that share the fast intra-node links.
        intra_latency_s: latency of one step of a ring inside a node.
        inter_latency_s: latency of one step of a ring across nodes.
        overlaps: whether communication runs beside the compute (GPUs: copy engines and
            NCCL's kernels on their own stream). On CPU (off) Gloo's transfers and the
            reduce-scatter's sums take the cores the compute needs: a collective's time at the
            host's own speed (``intra_*``) adds to the step, and only the waiting for a slower
            link (``inter_*``, e.g. ``--link-gbit``) overlaps the compute.
        native_reduce_scatter: whether the backend has a reduce-scatter of its own (NCCL).
            Gloo's clones its input, all-reduces it (a ring all-reduce: twice the steps and
            bytes of a ring reduce-scatter) and copies the rank's chunk out; FSDP2 runs it,
            raggedfsdp replaces it on Gloo with point-to-point transfers of the ring's bytes.
        pcie_bytes_per_s: the device's link to its host (PCIe), per direction: what CPU offload's
            copies of shards (host to device) and gradients (device to host) run at. ``None``
            where the device *is* the host (``cpu-gloo``): offload means nothing there.
        host_memory_bytes_per_s: the node's host memory bandwidth (all its sockets), shared by
            its ``devices_per_node`` ranks: what an offloaded optimizer step runs at. ``None``
            with ``pcie_bytes_per_s``.
        host_memory_bytes: the node's host RAM, which CPU offload fills with its ranks' shards,
            gradients and optimizer state (the same reserve kept free as on the device).
            ``None`` with ``pcie_bytes_per_s``.
        link_cpu_s_per_byte: host CPU a rank spends per byte it sends (and receives back) over
            the inter-node link, beyond what the host's own speed (``intra_*``) already costs:
            the kernel's per-packet work at that link's rate (TCP, a shaper's timers, waking
            Gloo's threads). On a host backend it takes the compute's core while the link is
            busy, so it lengthens the compute that overlaps a collective. 0 in every preset:
            accelerators leave it to NICs and copy engines, and ``cpu-gloo``'s loopback is its
            own host speed; measured on a throttled link by
            :func:`raggedfsdp.bench.link_probe.probe_link` (``cpu_s_per_byte``).
    """

    name: str
    peak_flops: float
    efficiency: float
    memory_bytes: int
    memory_bytes_per_s: float
    intra_bytes_per_s: float
    inter_bytes_per_s: float
    devices_per_node: int
    intra_latency_s: float
    inter_latency_s: float
    overlaps: bool = True
    native_reduce_scatter: bool = True
    link_cpu_s_per_byte: float = 0.0
    pcie_bytes_per_s: float | None = None
    host_memory_bytes_per_s: float | None = None
    host_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if field.name in _MAY_BE_ZERO and not value >= 0:
                raise ValueError(
                    f"hardware {self.name!r}: {field.name} must be >= 0, got {value!r}"
                )
            if field.name not in _MAY_BE_ZERO and not value > 0:
                raise ValueError(
                    f"hardware {self.name!r}: {field.name} must be positive, got {value!r}"
                )
        if self.efficiency > 1:
            raise ValueError(
                f"hardware {self.name!r}: efficiency is a fraction of peak (0, 1], "
                f"got {self.efficiency!r}"
            )

    def link_bytes_per_s(self, world_size: int) -> float:
        """The bandwidth a ring over ``world_size`` devices runs at: its slowest hop."""
        if world_size <= self.devices_per_node:
            return self.intra_bytes_per_s
        return min(self.intra_bytes_per_s, self.inter_bytes_per_s)

    def unthrottled(self) -> Hardware:
        """These figures with the inter-node link as fast as the intra-node one: for a host
        backend (:attr:`overlaps` off), the collectives at the speed the host's cores move the
        bytes, the part of their time that takes those cores."""
        return dataclasses.replace(
            self,
            inter_bytes_per_s=self.intra_bytes_per_s,
            inter_latency_s=self.intra_latency_s,
            link_cpu_s_per_byte=0.0,
        )

    def offload_rates(self, world_size: int) -> tuple[float, float]:
        """``(PCIe bytes/s per direction, host memory bytes/s)`` one rank of ``world_size`` gets
        under CPU offload: its own PCIe link, and its share of the node's host memory bandwidth
        (the ranks of a node step their optimizers at the same time).

        Raises:
            ValueError: the preset has no host link (``cpu-gloo``: the device is the host).
        """
        if self.pcie_bytes_per_s is None or self.host_memory_bytes_per_s is None:
            raise ValueError(
                f"--offload (CPU offload) needs a device with a host link, but {self.name!r} "
                f"has none: its device is the host already, so there is nothing to offload "
                f"to; use a GPU preset ({', '.join(n for n in HARDWARE if n != self.name)})"
            )
        sharing = min(world_size, self.devices_per_node)
        return self.pcie_bytes_per_s, self.host_memory_bytes_per_s / sharing

    def hop_latency_s(self, world_size: int) -> float:
        """The latency of one ring step over ``world_size`` devices."""
        if world_size <= self.devices_per_node:
            return self.intra_latency_s
        return self.inter_latency_s


def _gpu(
    name: str,
    *,
    tflops: float,
    hbm_gb: float,
    hbm_tb_per_s: float,
    nvlink_gb_per_s: float,
    nic_gbit: float,
    pcie_gb_per_s: float,
    host_gb_per_s: float,
    host_tb: float,
) -> Hardware:
    # Latencies: NCCL's per-step figures are a few microseconds over NVLink and InfiniBand; the
    # same value for every GPU generation (the link protocol, not the GPU, sets it).
    return Hardware(
        name=name,
        peak_flops=tflops * 1e12,
        efficiency=0.5,  # a typical large-model MFU of the compute alone
        memory_bytes=int(hbm_gb * _GB),
        memory_bytes_per_s=hbm_tb_per_s * 1e12,
        intra_bytes_per_s=nvlink_gb_per_s * _GB,
        inter_bytes_per_s=nic_gbit * _GB / 8,
        devices_per_node=8,
        intra_latency_s=3e-6,
        inter_latency_s=6e-6,
        pcie_bytes_per_s=pcie_gb_per_s * _GB,
        host_memory_bytes_per_s=host_gb_per_s * _GB,
        host_memory_bytes=int(host_tb * 1024**4),
    )


HARDWARE: dict[str, Hardware] = {
    # NVIDIA H100 SXM5 80GB: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3, NVLink 4 900 GB/s
    # bidirectional, ConnectX-7 400 Gb/s per GPU (DGX H100). Host link: PCIe Gen5 x16, "128GB/s"
    # bidirectional in the datasheet, 64 GB/s each way. Host memory: DGX H100's two Xeon
    # Platinum 8480C, 8 channels of DDR5-4800 each: 2 x 8 x 4.8 GT/s x 8 B = 614.4 GB/s; 2 TB
    # of it ("System Memory 2TB", DGX H100 datasheet).
    "h100": _gpu(
        "h100",
        tflops=989,
        hbm_gb=80,
        hbm_tb_per_s=3.35,
        nvlink_gb_per_s=450,
        nic_gbit=400,
        pcie_gb_per_s=64,
        host_gb_per_s=614.4,
        host_tb=2,
    ),
    # NVIDIA H200 SXM 141GB: the H100's compute with 4.8 TB/s HBM3e; the same PCIe Gen5 x16
    # ("128GB/s", H200 datasheet) and DGX H200's host, the same two Xeon Platinum 8480C, 2 TB.
    "h200": _gpu(
        "h200",
        tflops=989,
        hbm_gb=141,
        hbm_tb_per_s=4.8,
        nvlink_gb_per_s=450,
        nic_gbit=400,
        pcie_gb_per_s=64,
        host_gb_per_s=614.4,
        host_tb=2,
    ),
    # NVIDIA A100 SXM4 80GB: 312 TFLOP/s dense BF16, 2.04 TB/s, NVLink 3 600 GB/s bidirectional,
    # HDR 200 Gb/s per GPU (DGX A100). Host link: PCIe Gen4 x16, "64GB/s" bidirectional in the
    # datasheet, 32 GB/s each way. Host memory: DGX A100's two AMD EPYC 7742, 8 channels of
    # DDR4-3200 each: 2 x 8 x 3.2 GT/s x 8 B = 409.6 GB/s; 2 TB of it (DGX A100 640GB
    # datasheet; the 320GB system has 1 TB).
    "a100": _gpu(
        "a100",
        tflops=312,
        hbm_gb=80,
        hbm_tb_per_s=2.039,
        nvlink_gb_per_s=300,
        nic_gbit=200,
        pcie_gb_per_s=32,
        host_gb_per_s=409.6,
        host_tb=2,
    ),
    # NVIDIA B200 (DGX B200: 180 GB usable HBM3e per GPU, 8 TB/s): 2.25 PFLOP/s dense BF16,
    # NVLink 5 1.8 TB/s bidirectional, ConnectX-7 400 Gb/s per GPU. Host link: the GPU speaks
    # PCIe Gen6 x16, but DGX B200's hosts, two Xeon Platinum 8570 (DGX B200 datasheet), are PCIe
    # Gen5, so the link runs Gen5 x16: 64 GB/s each way. Host memory: the 8570's 8 channels of
    # DDR5-5600 (Intel ARK), two sockets: 2 x 8 x 5.6 GT/s x 8 B = 716.8 GB/s; 2 TB of it
    # ("2TB, configurable to 4TB", DGX B200 datasheet).
    "b200": _gpu(
        "b200",
        tflops=2250,
        hbm_gb=180,
        hbm_tb_per_s=8.0,
        nvlink_gb_per_s=900,
        nic_gbit=400,
        pcie_gb_per_s=64,
        host_gb_per_s=716.8,
        host_tb=2,
    ),
    # This repository's 2-core CPU machine, one thread per rank (tools/calibrate_cpu_gloo.py,
    # three runs on the quiet machine, load average under 1.2, medians): a 1024^3 fp32 matmul at
    # 158 GFLOP/s (157-161; the step-time model fits its efficiency to a measured floor run
    # anyway); Gloo loopback at 1.37 GB/s each way with both ranks sending (1.12-1.54), 0.70 ms
    # per collective however small (a one-element all-gather, 0.61-0.73; a bare message is 0.1
    # ms); an in-place add at 22.5 GB/s (20.6-25.3). Every rank is a "node" of its own: Gloo, no
    # NVLink. (Measured under a load average of 11, the link was 258 MB/s and 2.4 ms.) No host
    # link: the device is the host, so CPU offload means nothing here (offload_rates says so).
    "cpu-gloo": Hardware(
        name="cpu-gloo",
        peak_flops=158e9,
        efficiency=0.5,
        memory_bytes=8 * 1024**3,
        memory_bytes_per_s=22.5e9,
        intra_bytes_per_s=1.37e9,
        inter_bytes_per_s=1.37e9,
        devices_per_node=1,
        intra_latency_s=0.70e-3,
        inter_latency_s=0.70e-3,
        overlaps=False,
        native_reduce_scatter=False,
    ),
}
"""The named presets of ``raggedfsdp plan --gpu``."""


def hardware(name: str, **overrides: float | bool) -> Hardware:
    """The preset ``name`` with some figures replaced (``link_gbit=``: the inter-node bandwidth
    in Gbit/s; any :class:`Hardware` field by its name).

    Raises:
        ValueError: an unknown preset (the message lists them) or field, or a non-positive
            figure (the message names it).
    """
    preset = HARDWARE.get(name)
    if preset is None:
        raise ValueError(f"unknown hardware preset {name!r}; known presets: {', '.join(HARDWARE)}")
    changes = dict(overrides)
    if "link_gbit" in changes:
        gbit = changes.pop("link_gbit")
        if not gbit > 0:
            raise ValueError(f"link bandwidth must be positive Gbit/s, got {gbit!r}")
        changes["inter_bytes_per_s"] = gbit * _GB / 8
    fields = {f.name for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise ValueError(f"unknown hardware figure(s) {', '.join(unknown)}; known: {fields}")
    return dataclasses.replace(preset, **changes)
