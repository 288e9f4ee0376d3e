"""The codec's accelerator shape, forced on the CPU ([Note: codec kernels per device] in
``runtime/compression/_quant.py``): regions in chunks of 2^24 elements and fp8 codes converted
rather than looked up give, bit for bit, the codes, scales, residuals and dequantized values of
the CPU shape (chunks of 2^18, the table), with far fewer kernels; every message is 16-byte
aligned, and the capacity model's message size is the codec's."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import raggedfsdp as rf
from raggedfsdp.capacity.wire import message_bytes
from raggedfsdp.planner import MessageLayout
from raggedfsdp.runtime.compression import BucketCodec, Kernels, _quant
from raggedfsdp.runtime.compression._reduce_scatter import quantize_gradient

CODE_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
DEVICE_SHAPE = Kernels.for_device("cuda")

#: (shapes, policy): a large matrix (more than one CPU chunk), edges, runs, a 1-D parameter
CASES = [
    ({"w": (700, 600), "b": (600,), "v": (37, 53)}, rf.RaggedShard(block_size=4)),
    ({"w": (520, 1024), "x": (300,)}, rf.RaggedShard()),  # element policy: runs of 256
    ({"w": (640, 640)}, rf.RaggedShard(block_size=128)),
]


class _OpCount(TorchDispatchMode):
    """Counts ATen ops: on an accelerator, about one kernel launch each."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _codecs(shapes, policy, world, dtype):
    comp = rf.CommCompression(reduce_scatter=dtype)  # e5m2: reduce-scatter codes only
    plan = rf.StructAwarePlanner(shard_policy=policy, compression=comp).plan(shapes, world)
    cpu = BucketCodec(plan, policy, None)
    device = BucketCodec(plan, policy, None, kernels=DEVICE_SHAPE)
    return plan, cpu, device


def _bucket(plan, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-4, 4, plan.total_numel)[torch.randperm(plan.total_numel, generator=gen)]
    return torch.randn(plan.total_numel, generator=gen) * scale


@pytest.mark.parametrize("dtype", CODE_DTYPES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_device_shape_encodes_the_same_bits(case, dtype):
    shapes, policy = CASES[case]
    world = 3
    plan, cpu, device = _codecs(shapes, policy, world, dtype)
    flat = _bucket(plan, case)
    size = plan.shard_numel
    for rank in range(world):
        shard = flat[rank * size : (rank + 1) * size]
        messages, residuals, decoded = [], [], []
        for codec in (cpu, device):
            message = torch.zeros(codec.message_bytes, dtype=torch.uint8)
            residual = torch.zeros(size)
            codec.encode(shard, rank, message, dtype, residual=residual)
            out = torch.full((size,), 7.0)
            codec.decode(message, rank, out, dtype, accumulate=True)
            messages.append(message)
            residuals.append(residual)
            decoded.append(out)
        assert torch.equal(messages[0], messages[1])  # codes, scales and padding, byte for byte
        assert torch.equal(residuals[0], residuals[1])
        assert torch.equal(decoded[0], decoded[1])


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e5m2])
def test_device_shape_seals_gradients_the_same(dtype):
    """The reduce-scatter's messages (one per owner, sealed) with error feedback, both shapes."""
    shapes, policy = CASES[0]
    plan, cpu, device = _codecs(shapes, policy, 2, dtype)
    gradient = _bucket(plan, 5)
    sent = []
    for codec in (cpu, device):
        outgoing = torch.zeros(2 * codec.message_bytes, dtype=torch.uint8)
        quantize_gradient(codec, dtype, None, gradient, outgoing)
        sent.append(outgoing)
    assert torch.equal(sent[0], sent[1])


def test_device_shape_launches_far_fewer_kernels():
    """One 700 x 600 parameter in 4 x 4 tiles (420,000 elements): the CPU cuts it into two
    chunks, the device shape into one; fp8 decoding skips the table's index and gather."""
    shapes, policy = {"w": (700, 600)}, rf.RaggedShard(block_size=4)
    plan, cpu, device = _codecs(shapes, policy, 1, torch.float8_e4m3fn)
    flat = _bucket(plan, 0)
    ops = []
    for codec in (cpu, device):
        message = torch.zeros(codec.message_bytes, dtype=torch.uint8)
        with _OpCount() as count:
            codec.encode(flat, 0, message, torch.float8_e4m3fn)
            codec.decode(message, 0, torch.empty_like(flat), torch.float8_e4m3fn)
        ops.append(count.ops)
    assert plan.shard_numel > _quant.CHUNK and plan.shard_numel < _quant.DEVICE_CHUNK
    assert ops[1] < ops[0] / 1.5, ops


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_messages_are_16_byte_aligned_and_the_planners(case, world):
    shapes, policy = CASES[case]
    plan, codec, _ = _codecs(shapes, policy, world, torch.int8)
    assert codec.code_bytes % 16 == 0 and codec.message_bytes % 16 == 0
    assert codec.code_bytes >= plan.shard_numel
    assert codec.message_bytes >= codec.code_bytes + 4 * max(codec.scale_counts)
    assert codec.message_bytes - codec.code_bytes - 4 * max(codec.scale_counts) < 16
    assert message_bytes(plan, policy, None) == codec.message_bytes
    buffer = torch.zeros(world * codec.message_bytes, dtype=torch.uint8)
    for k in range(world):
        message = buffer[k * codec.message_bytes : (k + 1) * codec.message_bytes]
        assert codec.scales(message).data_ptr() % 16 == 0
        assert message.data_ptr() % 16 == 0


@pytest.mark.parametrize(("numel", "blocks"), [(1, 0), (16, 1), (17, 3), (4096, 31), (0, 0)])
def test_message_layout(numel, blocks):
    layout = MessageLayout(numel, blocks)
    assert layout.code_bytes == 16 * math.ceil(numel / 16)
    assert layout.message_bytes == 16 * math.ceil((layout.code_bytes + 4 * blocks) / 16)
    assert layout.scale_slots * 4 == layout.message_bytes - layout.code_bytes
