"""Tensor and expert parallelism in the capacity planner (pure logic, one process): each rank's
pieces against hand-computed shapes (torchtitan's plans), the planner's FSDP groups, the tp and
ep bytes by hand, degree 1 as today's figures exactly, the search over (tp, ep), and the
one-line errors before any planning."""

from __future__ import annotations

import math

import pytest
import torch

from raggedfsdp.capacity.capacity import (
    CapacityOptions,
    capacity_report,
    plan_capacity,
    search_mesh,
)
from raggedfsdp.capacity.cost import StepShape, unit_bytes
from raggedfsdp.capacity.hardware import HARDWARE, hardware
from raggedfsdp.capacity.parallel import ParallelDims, UnsplittableModel, split_model
from raggedfsdp.capacity.parallel_comm import parallel_bytes
from raggedfsdp.capacity.shapes import model_shape
from raggedfsdp.cli import main
from raggedfsdp.layout import RaggedShard
from raggedfsdp.models import build_model
from raggedfsdp.models.zoo import DeepSeekConfig, DeepSeekHF, DeepSeekV3, Llama3
from raggedfsdp.planner import StructAwarePlanner, model_buckets

#: A small DeepSeek-V3: one dense layer, two MoE layers of 8 fused experts.
TINY_MOE = DeepSeekConfig(
    hidden=64,
    n_layers=3,
    n_dense_layers=1,
    dense_inner=128,
    moe_inner=32,
    n_routed=8,
    n_shared=1,
    n_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_dim=8,
    qk_rope_dim=8,
    v_dim=8,
    vocab=256,
    correction_bias=True,
)


def _tiny_moe() -> DeepSeekV3:
    with torch.device("meta"):
        return DeepSeekV3(TINY_MOE)


def _options(**kw: object) -> CapacityOptions:
    base: dict[str, object] = {"batch": 1, "seq_len": 64, "param_dtype": torch.bfloat16}
    return CapacityOptions(**{**base, **kw})  # type: ignore[arg-type]


def test_llama3_8b_at_tp2_holds_the_halves_torchtitan_gives_it():
    """Column-parallel q/k/v, w1/w3 and head: half the rows; row-parallel wo, w2: half the
    columns; the vocabulary-parallel embedding half its rows; norms whole."""
    split = split_model(build_model("llama3-8b"), ParallelDims(tp=2))
    want = {
        "tok_embeddings.weight": (64128, 4096),
        "layers.7.attention.wq.weight": (2048, 4096),
        "layers.7.attention.wk.weight": (512, 4096),
        "layers.7.attention.wv.weight": (512, 4096),
        "layers.7.attention.wo.weight": (4096, 2048),
        "layers.7.feed_forward.w1.weight": (7168, 4096),
        "layers.7.feed_forward.w3.weight": (7168, 4096),
        "layers.7.feed_forward.w2.weight": (4096, 7168),
        "layers.7.attention_norm.weight": (4096,),
        "layers.7.ffn_norm.weight": (4096,),
        "norm.weight": (4096,),
        "output.weight": (64128, 4096),
    }
    assert {name: split.local_shape(name) for name in want} == want
    norms = (2 * 32 + 1) * 4096  # replicated
    local = sum(math.prod(s.local or ()) for s in split.params.values())
    assert local == (8_030_261_248 - norms) // 2 + norms


def test_llama3_8b_at_tp2_plans_the_local_shapes_over_dp():
    """W=4, tp=2: every bucket over dp=2 ranks; a block's S is half its local elements
    (element granularity, 8-element bf16 alignment: no padding)."""
    module = build_model("llama3-8b")
    split = split_model(module, ParallelDims(tp=2))
    shape = model_shape(module, split=split)
    block = (2048 + 512 + 512) * 4096 + 4096 * 2048 + 3 * 7168 * 4096 + 2 * 4096
    root = 2 * 64128 * 4096 + 4096
    assert (block, root) == (109_060_096, 525_340_672)
    assert (shape.hidden, shape.vocab) == (2048, 64128)
    assert shape.blocks[0].matmul_numel == block - 2 * 4096
    # q,k,v,o,w1,w3,w2: in + out of each (k and v read q's input, w3 w1's: out only), over tp
    kept = 8192 + 1024 + 1024 + 8192 + 18432 + 14336 + 18432
    assert shape.blocks[0].activation_per_token == kept / 2
    cost = plan_capacity(module, shape, 4, HARDWARE["h100"], _options(tp=2), split=split)
    assert cost.dp == 2 and cost.parallel is not None
    ours = cost.systems["raggedfsdp"]
    assert ours.memory.params == 4 * (32 * block // 2 + root // 2)  # fp32 masters
    assert ours.bytes.reduce_scatter_bytes == 2 * 2 * (32 * block // 2 + root // 2)
    assert ours.time.tokens_per_s == pytest.approx(64 / 2 / ours.time.total_s)


def test_small_moe_at_ep2_shards_experts_over_dp_and_the_rest_over_dp_times_ep():
    module = _tiny_moe()
    split = split_model(module, ParallelDims(ep=2), experts_per_token=2)
    assert split.local_shape("layers.1.ffn.experts.w1") == (4, 32, 64)
    assert split.local_shape("layers.1.ffn.experts.w2") == (4, 64, 32)
    assert split.local_shape("layers.1.ffn.shared_experts.w1.weight") == (32, 64)  # dense
    assert split.local_shape("layers.0.ffn.w1.weight") == (128, 64)
    assert split.local_shape("layers.1.ffn.gate.weight") == (8, 64)  # the router: whole
    buckets = model_buckets(module, wrap=split.wrap_policy, local=split.local)
    units = {b.name.rsplit("/", 2)[0]: split.fsdp_size(b.name, 8) for b in buckets}
    # W=8, ep=2: experts over dp=4 ranks, every other unit over dp x ep = 8; experts are units
    # of their own, nested in their blocks (before them)
    assert units == {
        "layers.0": 8,
        "layers.1.ffn.experts": 4,
        "layers.1": 8,
        "layers.2.ffn.experts": 4,
        "layers.2": 8,
        "<root>": 8,
    }
    planner = StructAwarePlanner()
    plans = [planner.plan_bucket(b, split.fsdp_size(b.name, 8)) for b in buckets]
    experts = unit_bytes(plans)[1]
    assert (experts.path, experts.world_size) == ("layers.1.ffn.experts", 4)
    assert experts.shard_numel == 3 * 4 * 32 * 64 // 4
    # the rank's work is the whole model's: 4 experts, each seeing k / 4 of the tokens
    whole = model_shape(module, experts_per_token=2)
    mine = model_shape(module, experts_per_token=2, split=split)
    flops = [whole.forward_flops_per_token(u, 64) for u in whole.units]
    assert sum(mine.forward_flops_per_token(u, 64) for u in mine.units) == sum(flops)


def test_both_expert_layouts_cost_the_same_rank():
    """The small MoE with fused [E, out, in] stacks and with one nn.Linear per expert (Hugging
    Face names): at tp=2, ep=2 the rank holds, computes and keeps the same."""
    with torch.device("meta"):
        unfused = DeepSeekHF(TINY_MOE)
    hw, options = HARDWARE["h100"], _options(tp=2, ep=2)
    costs = []
    for module in (_tiny_moe(), unfused):
        split = split_model(module, ParallelDims(tp=2, ep=2), experts_per_token=2)
        shape = model_shape(module, experts_per_token=2, split=split)
        world = plan_capacity(module, shape, 8, hw, options, split=split)
        costs.append((world.systems["raggedfsdp"], world.parallel))
    (fused, fused_comm), (linear, linear_comm) = costs
    assert fused.memory.params == linear.memory.params
    assert fused.memory.activations == linear.memory.activations
    assert fused.time.compute_s == pytest.approx(linear.time.compute_s)
    assert fused_comm == linear_comm


@pytest.mark.parametrize("model", ["gpt-tiny", "llama3-8b", "tiny-moe"])
def test_degree_one_is_todays_model_exactly(model: str):
    """Negative control: a split at tp = ep = 1 changes no shape and no figure."""
    module = _tiny_moe() if model == "tiny-moe" else build_model(model)
    k = 2 if model == "tiny-moe" else None
    split = split_model(module, ParallelDims(), experts_per_token=k)
    assert not split.splits
    assert all(s.local == s.shape for s in split.params.values())
    today = model_shape(module, experts_per_token=k)
    assert model_shape(module, experts_per_token=k, split=split) == today
    hw, options = HARDWARE["h100"], _options(checkpointing=True)
    plain = plan_capacity(module, today, 8, hw, options)
    split_one = plan_capacity(module, today, 8, hw, options, split=split)
    assert plain.parallel is None and split_one.parallel is None
    assert plain.systems == split_one.systems


def test_llama3_70b_at_degree_one_keeps_the_published_figures():
    """Negative control against the figures the land branch computed before tensor and expert
    parallelism existed (docs/results/capacity.md: W=64, 8k tokens, full checkpointing)."""
    options = _options(seq_len=8192, checkpointing=True)
    report = capacity_report("llama3-70b", [64], HARDWARE["h100"], options, find_smallest=False)
    ours = report.worlds[0].systems["raggedfsdp"]
    fsdp2 = report.worlds[0].systems["fsdp2"]
    assert (ours.memory.peak, fsdp2.memory.peak) == PEAKS_70B
    assert (ours.bytes.wire_bytes, fsdp2.bytes.wire_bytes) == WIRE_70B
    assert (ours.time.total_s, fsdp2.time.total_s) == STEP_70B


#: llama3-70b, h100, W=64, batch 1 x 8192, full checkpointing, bf16: raggedfsdp and FSDP2, from
#: the land branch (commit 3a33110) before this change
PEAKS_70B = (42_756_772_172, 42_756_772_172)
WIRE_70B = (410_886_217_728, 412_570_787_328)
STEP_70B = (10.407568667952791, 10.495342656480556)


def test_tp_and_ep_bytes_by_hand():
    """gpt-tiny (2 blocks, d=64) at tp=2, bf16, 1 x 64 tokens: 4 all-reduces a block and 2 for
    the embedding and head, each of b s d x 2 bytes; 2 more a block with checkpointing. The
    small MoE at ep=2, k=2: 4 all-to-alls a MoE layer of T k d x 2 bytes, half leaving."""
    hw = HARDWARE["h100"]
    module = build_model("gpt-tiny")
    split = split_model(module, ParallelDims(tp=2))
    shape = model_shape(module, split=split)
    step = StepShape(batch=1, seq_len=64, param_dtype=torch.bfloat16)
    message = 64 * 64 * 2
    tp = parallel_bytes(shape, step, hw, split)
    assert (tp.tp_calls, tp.tp_bytes, tp.tp_wire_bytes) == (10, 10 * message, 10 * message)
    assert tp.tp_s == pytest.approx(10 * 2 * (3e-6 + message / 2 / 450e9))
    assert (tp.ep_calls, tp.ep_bytes, tp.ep_s) == (0, 0, 0.0)
    ckpt = StepShape(batch=1, seq_len=64, param_dtype=torch.bfloat16, checkpointing=True)
    assert parallel_bytes(shape, ckpt, hw, split).tp_calls == 14

    moe = _tiny_moe()
    split = split_model(moe, ParallelDims(ep=2), experts_per_token=2)
    ep = parallel_bytes(model_shape(moe, experts_per_token=2, split=split), step, hw, split)
    tokens = 64 * 2 * 64 * 2  # T k d x 2 bytes
    assert (ep.ep_calls, ep.ep_bytes, ep.ep_wire_bytes) == (8, 8 * tokens, 8 * tokens // 2)
    assert ep.ep_s == pytest.approx(8 * (3e-6 + tokens / 2 / 450e9))
    assert ep.tp_calls == 0


def test_gpt_tiny_dp_bytes_at_tp2_by_hand():
    """W=4, tp=2: each rank holds per block 4 LayerNorm vectors [64], q k v 3x[32,64], attn.proj
    [64,32], fc [128,64], mlp.proj [64,128] = 24,832 elements; the root tok_emb [128,64],
    pos_emb [64,64] (whole), ln_f 2x[64] = 12,416. Over dp=2: S 12,416 and 6,208."""
    module = build_model("gpt-tiny")
    split = split_model(module, ParallelDims(tp=2))
    shape = model_shape(module, split=split)
    cost = plan_capacity(module, shape, 4, HARDWARE["h100"], _options(tp=2), split=split)
    moved = cost.systems["raggedfsdp"].bytes
    block, root = 12_416, 6_208
    # forward: every unit; backward: the first block again (the last is kept); bf16
    assert moved.all_gather_bytes == 2 * (2 * block + root + block)
    assert moved.reduce_scatter_bytes == 2 * 2 * (2 * block + root)
    assert moved.wire_bytes == 2 * (2 * block + root + block) + 2 * (2 * block + root)


def test_tp_activations_are_a_tp_th():
    """gpt-small (d=128, 4 heads, vocabulary 256, tied head) at tp 2 and 4."""
    module = build_model("gpt-small")
    whole = model_shape(module)
    for tp in (2, 4):
        mine = model_shape(module, split=split_model(module, ParallelDims(tp=tp)))
        for a, b in zip(whole.blocks, mine.blocks, strict=True):
            assert b.activation_per_token == a.activation_per_token / tp
            assert b.widest_per_token == a.widest_per_token // tp
            assert b.matmul_numel == a.matmul_numel / tp  # every block matrix is split
        assert (mine.hidden, mine.vocab) == (128 // tp, 256 // tp)
        assert mine.tied_numel == whole.tied_numel // tp  # the rank's vocabulary slice


def test_errors_name_what_is_at_fault():
    with pytest.raises(ValueError, match=r"tp=3 x ep=2 = 6 does not divide the world size 8"):
        ParallelDims(tp=3, ep=2).check_world(8)
    llama = build_model("llama3-8b")
    with pytest.raises(UnsplittableModel, match="llama3-8b has no routed experts"):
        split_model(llama, ParallelDims(ep=2), model_name="llama3-8b")
    with pytest.raises(UnsplittableModel, match="tp=3 does not divide the 32 attention heads"):
        split_model(llama, ParallelDims(tp=3))
    with pytest.raises(UnsplittableModel, match="tp=16 does not divide the 8 key/value heads"):
        split_model(llama, ParallelDims(tp=16))
    with pytest.raises(UnsplittableModel, match="ep=3 does not divide the 8 routed experts"):
        split_model(_tiny_moe(), ParallelDims(ep=3))
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        ParallelDims(tp=0)


def test_a_tp_split_that_cuts_a_tile_is_named_before_planning():
    """tp=3 with 128x128 tiles: q/k/v/o and the embedding split on whole tiles (384 = 3 x 128),
    but w1's 640 rows split at 214, inside a tile: the error names it. Element granularity
    (no tiles) takes the same split: the negative control."""
    with torch.device("meta"):
        model = Llama3(hidden=384, n_layers=1, n_heads=3, n_kv_heads=3, ffn=640, vocab=384)
    tiles = RaggedShard(block_size=(128, 128))
    with pytest.raises(
        UnsplittableModel,
        match=r"'layers.0.feed_forward.w1.weight' of shape \[640, 384\] is split by tensor "
        r"parallelism \(tp=3\) at index 214 of dim 0, inside a block .*\(128, 128\)",
    ):
        split_model(model, ParallelDims(tp=3), policy=tiles)
    assert split_model(model, ParallelDims(tp=3)).local_shape(
        "layers.0.feed_forward.w2.weight"
    ) == (
        384,
        214,
    )
    # the same shapes with a width of whole tiles pass
    with torch.device("meta"):
        model = Llama3(hidden=384, n_layers=1, n_heads=3, n_kv_heads=3, ffn=768, vocab=384)
    split_model(model, ParallelDims(tp=3), policy=tiles)


def test_cli_errors_are_one_line_before_planning(capsys, monkeypatch):
    def no_planning(*args: object, **kwargs: object) -> None:
        raise AssertionError("planned before checking the split")

    monkeypatch.setattr(StructAwarePlanner, "plan_bucket", no_planning)
    cases = [
        (["--model", "llama3-8b", "--world", "8,12", "--tp", "8"], "does not divide the world"),
        (["--model", "llama3-8b", "--world", "8", "--ep", "2"], "llama3-8b has no routed experts"),
        (["--model", "llama3-8b", "--world", "6", "--tp", "3"], "32 attention heads"),
        (["--model", "deepseek-v3-671b", "--world", "48", "--ep", "3"], "256 routed experts"),
        (["--model", "gpt-tiny", "--world", "4", "--tp", "0"], "--tp must be positive"),
    ]
    for args, message in cases:
        assert main(["plan", "--gpu", "h100", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_search_finds_the_least_model_parallelism_that_fits():
    """llama3-8b on 8 devices of 40 GB at 8k tokens, no checkpointing: the search's smallest
    (dp, tp, ep) is the smallest tp whose plan fits, its fastest the one with the most tokens
    per second per device."""
    hw = hardware("h100", memory_bytes=40 * 10**9)
    options = _options(seq_len=8192)
    module = build_model("llama3-8b")
    search = search_mesh(module, 8, hw, options, model_name="llama3-8b")
    costs = {}
    for tp in (1, 2, 4, 8):
        split = split_model(module, ParallelDims(tp=tp))
        shape = model_shape(module, split=split if tp > 1 else None)
        opts = _options(seq_len=8192, tp=tp)
        world = plan_capacity(module, shape, 8, hw, opts, split=split if tp > 1 else None)
        costs[tp] = world.systems["raggedfsdp"]
    fitting = [tp for tp, c in costs.items() if c.fits]
    assert search.tried == 4 and fitting and fitting != [1, 2, 4, 8]  # the search has work
    assert search.smallest is not None and search.fastest is not None
    assert (search.smallest.tp, search.smallest.ep, search.smallest.dp) == (
        fitting[0],
        1,
        8 // fitting[0],
    )
    # per device: a tp group's devices share its tokens
    fastest = max(fitting, key=lambda tp: costs[tp].time.tokens_per_s)
    assert search.fastest.tp == fastest


def test_cli_prints_the_dimensions(capsys):
    assert main(["plan", "--model", "gpt-tiny", "--world", "4", "--gpu", "h100", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "dp 2 x ep 1 x tp 2" in out
    assert "tp all-reduce input per step (10 calls)" in out
    assert "smallest (dp, tp, ep) that fits" in out
