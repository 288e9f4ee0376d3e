"""QLoRA's parts without a process group: the NF4 weight (``models/nf4.py``) against a reference
written here from QLoRA's definition, the adapters (``models/lora.py``), the capacity model's tensor
bytes per rank (``capacity/lora.py``) against hand counts, and the job's option checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raggedfsdp.capacity.cost import buffer_bytes
from raggedfsdp.capacity.lora import lora_bytes, lora_units
from raggedfsdp.facts import RAGGEDFSDP
from raggedfsdp.models.lora import LoRALinear, apply_lora
from raggedfsdp.models.nf4 import NF4_CODE_BOOK, NF4Weight, nf4_bytes
from raggedfsdp.planner import StructAwarePlanner
from raggedfsdp.train.config import TrainConfig


def _reference_nf4(weight: torch.Tensor, block: int) -> tuple[list[int], torch.Tensor]:
    """Each element's index of the nearest code-book value to it over its block's absmax, and
    the absmaxes: QLoRA's quantization, element by element."""
    book = torch.tensor(NF4_CODE_BOOK, dtype=torch.float64)
    flat = weight.double().reshape(-1, block)
    scales = flat.abs().amax(dim=1)
    index = [int((book - x).abs().argmin()) for x in (flat / scales[:, None]).reshape(-1)]
    return index, scales.float()


def test_nf4_codes_and_scales_are_qloras_packed_two_a_byte() -> None:
    weight = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    q = NF4Weight.quantize(weight, 32)
    index, scales = _reference_nf4(weight, 32)
    assert q.codes.dtype == torch.uint8 and q.codes.numel() == weight.numel() // 2
    unpacked = [c >> 4 for c in q.codes.tolist()], [c & 15 for c in q.codes.tolist()]
    assert [v for pair in zip(*unpacked, strict=True) for v in pair] == index
    assert torch.equal(q.scales, scales)
    book = torch.tensor(NF4_CODE_BOOK)
    want = (book[torch.tensor(index)].reshape(-1, 32) * scales[:, None]).reshape(6, 64)
    assert torch.equal(q.dequantize(), want)
    assert nf4_bytes(weight.numel(), 32) == (q.codes.numel(), q.scales.numel() * 4)


def test_nf4_computes_as_its_value_and_is_frozen() -> None:
    q = NF4Weight.quantize(torch.randn(4, 64))
    x = torch.randn(3, 64)
    assert torch.equal(nn.functional.linear(x, q), nn.functional.linear(x, q.dequantize()))
    assert q.to(torch.bfloat16).dequantize().dtype == torch.bfloat16
    with pytest.raises(TypeError, match="frozen weight"):
        q.add_(1.0)
    with pytest.raises(ValueError, match="cut a 64-block"):
        NF4Weight.quantize(torch.randn(4, 32))[:1]


def test_nf4_copy_of_its_values_gives_back_the_same_codes_and_scales() -> None:
    """What a checkpoint holds (the dequantized values) loads back bit for bit; a shard of
    whole rows quantizes alone to the rows of the whole."""
    q = NF4Weight.quantize(torch.randn(8, 64))
    other = NF4Weight.quantize(torch.randn(8, 64))
    assert not torch.equal(other.codes, q.codes)  # the negative control
    other.copy_(q.dequantize())
    assert torch.equal(other.codes, q.codes) and torch.equal(other.scales, q.scales)
    rows = NF4Weight.quantize(q.dequantize()[3:5])
    assert torch.equal(rows.codes, q[3:5].codes) and torch.equal(rows.scales, q[3:5].scales)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 64)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 41, bias=True), nn.ReLU(), nn.Linear(41, 64, bias=False))
            for _ in range(2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return h


def test_adapters_start_at_the_base_model_and_alone_train() -> None:
    torch.manual_seed(0)
    net = _Net()
    base_names = {n for n, _ in net.named_parameters()}
    plain = {n: p.detach().clone() for n, p in net.named_parameters()}
    apply_lora(net, list(net.blocks), rank=3)  # no NF4: the outputs equal the base model's
    x = torch.tensor([[1, 2, 3]])
    reference = _Net()
    reference.load_state_dict(plain)
    assert torch.equal(net(x), reference(x))
    trainable = {n for n, p in net.named_parameters() if p.requires_grad}
    assert trainable == {f"blocks.{i}.{j}.lora_{ab}" for i in (0, 1) for j in (0, 2) for ab in "ab"}
    assert base_names <= {n for n, _ in net.named_parameters()}  # names kept
    assert isinstance(net.blocks[0][0], LoRALinear) and net.blocks[0][0].lora_b.abs().sum() == 0


def test_an_nf4_block_that_does_not_divide_in_features_names_the_linear() -> None:
    net = _Net()
    with pytest.raises(ValueError, match=r"64 does not divide the 41 in-features.*'blocks.0.2'"):
        apply_lora(net, list(net.blocks), rank=2, nf4_block=64)


def _qlora_net() -> nn.Module:
    """Two blocks of Linear(64, 64) (NF4, 4096 elements) with a bias each, an embedding."""
    net = nn.Module()
    net.embed = nn.Embedding(10, 64, device="meta")
    net.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64, device="meta")) for _ in range(2))
    apply_lora(net, list(net.blocks), rank=2, nf4_block=64)
    return net


def test_capacity_lora_bytes_against_hand_counts() -> None:
    """At W=1 every byte by hand; at W=2, 3 the ranks share them (each has its own AdamW
    ``step`` per adapter), the base whole rows of 64: 32/32 rows, then 22/21/21."""
    planner = StructAwarePlanner()
    (one,) = lora_bytes(_qlora_net(), planner, 1)
    adapters = 2 * (2 * 64 + 64 * 2) * 4
    assert one.as_dict() == {
        "base": 2 * (64 * 64 // 2 + 64 * 4),
        "frozen": (10 * 64 + 2 * 64) * 4,  # the embedding and the biases
        "adapters": adapters,
        "grads": adapters,
        "optimizer": 2 * adapters + 4 * 4,  # two moments, and a 4-byte step per adapter
        "total": one.total,
    }
    for world, rows in ((2, [32, 32]), (3, [22, 21, 21])):
        ranks = lora_bytes(_qlora_net(), planner, world)
        assert [r.base for r in ranks] == [2 * (n * 64 // 2 + n * 4) for n in rows]
        for key in ("frozen", "adapters", "grads"):
            assert sum(getattr(r, key) for r in ranks) == getattr(one, key)
        assert sum(r.optimizer for r in ranks) == one.optimizer + (world - 1) * 4 * 4


def test_capacity_lora_units_gather_the_base_as_codes_and_scales() -> None:
    """At W=2 each block unit's buckets hold its bias and adapters (no NF4 weight), and its
    NF4 weight all-gathers whole as codes and scales: 4096 / 2 + 4096 / 64 * 4 bytes, no
    gradient; the embedding's unit has none."""
    *blocks, root = lora_units(_qlora_net(), StructAwarePlanner(), 2)
    for unit in blocks:
        assert unit.subclass_bytes == 64 * 64 // 2 + 64 * 4
        assert unit.param_numel == 64 + 2 * (2 * 64)  # the bias, the adapters
        assert unit.trainable == (False, True)
    assert root.subclass_bytes == 0 and root.param_numel == 10 * 64
    held = buffer_bytes(blocks[:1], 4, 2, RAGGEDFSDP)  # fp32, unsharded
    assert held.params == [(64 + 256) * 4 + 64 * 64 // 2 + 64 * 4]  # + codes and scales
    assert held.grads == [256 * 4]  # the adapters' alone


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lora_rank": 0}, "lora_rank: must be an integer >= 1, got 0"),
        ({"base_weights": "nf4"}, "base_weights: .* give --lora-rank R too"),
        ({"lora_rank": 2, "nf4_block_size": 32}, "nf4_block_size: only with --base-weights"),
        ({"lora_rank": 2, "base_weights": "nf4", "nf4_block_size": 5}, "must be even"),
        ({"lora_rank": 2, "optimizer": "muon"}, "optimizer: --lora-rank trains with adamw"),
        ({"lora_rank": 2, "tp": 2}, "lora_rank: --lora-rank with --tp"),
        ({"lora_rank": 2, "base_weights": "nf4", "compile": True}, "compile: --compile with"),
        (
            {"lora_rank": 2, "base_weights": "nf4", "compress_all_gather": "fp8"},
            "compress_all_gather: --compress-\\* with --base-weights nf4",
        ),
    ],
)
def test_bad_options_are_one_error_naming_the_option(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**options)


def test_the_dry_run_shows_the_lora_runs_own_tensor_bytes() -> None:
    """Tiny Llama at W=2: 73,728 NF4 elements, half on each rank: 18,432 bytes of codes and
    288 scales (20,736 bytes = 20.2 KiB)."""
    pytest.importorskip("transformers")
    from raggedfsdp.train.preflight import dry_run_report

    cfg = TrainConfig(hf_config="tiny-llama", lora_rank=4, base_weights="nf4", seq_len=64)
    last = dry_run_report(cfg, 2).splitlines()[-1]
    assert last.startswith("LoRA tensors of the largest rank: base 20.2 KiB, frozen 64.6 KiB")
