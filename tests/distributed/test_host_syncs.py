"""Host synchronisations as a budget: what a training step makes the host wait for on a GPU,
counted on this CPU machine with :class:`raggedfsdp.runtime.HostSyncCounter` (the ops that read
a tensor's value on the host, data-dependent sizes, device-to-host copies) and the host reads
that dispatch no op on the CPU (``tolist``), 2 Gloo ranks.

- uncompressed (fp32 and bf16 mixed precision): none in forward or an SGD step, one in backward:
  the read of the agreement on what each rank's backward runs and uses (``runtime/_usage.py``);
  none at all after ``set_static_graph()``;
- a parameter no rank uses, a block rank 1 skips (ranks whose graphs differ): that same one read,
  on every rank, and the same collectives on both;
- compressed: one more per compressed direction and forward+backward, at the end of the root's
  forward (all-gather) and of backward (reduce-scatter) ([Note: one finiteness check per step]);
- negative control: with the per-message checks the runtime made before (one host read per
  all-gather message, ``W`` per reduce-scatter received and one per sealed send), the counter
  sees exactly those too: ``W`` more per all-gather, ``W + 1`` more per reduce-scatter.

benchmarks/host_syncs.py counts the same on a 16-layer GPT (docs/results/compression.md).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import raggedfsdp as rf
from harness import patched, run_distributed
from raggedfsdp.models import GPT
from raggedfsdp.models.gpt import GPTConfig
from raggedfsdp.runtime import HostSyncCounter
from raggedfsdp.runtime.compression import BucketCodec

pytestmark = pytest.mark.slow

FP8, INT8 = torch.float8_e4m3fn, torch.int8
#: name -> (all-gather codes, reduce-scatter codes, param_dtype)
SETTINGS: dict[str, tuple[torch.dtype | None, torch.dtype | None, torch.dtype | None]] = {
    "fp32": (None, None, None),
    "bf16": (None, None, torch.bfloat16),
    "all_gather": (FP8, None, None),
    "reduce_scatter": (None, INT8, None),
    "both": (FP8, INT8, None),
}


@contextlib.contextmanager
def _syncs() -> Iterator[list[int]]:
    """Counts the host syncs of the block: HostSyncCounter's ops, and ``Tensor.tolist()`` and
    ``numpy()``, which on the CPU read memory without an op but on an accelerator copy to the
    host first. Those are counted by wrapping the methods: the autograd engine runs the
    end-of-backward callback without the caller's torch-function modes."""
    counted: list[int] = []
    reads = [0]

    def counting(method: Any) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            reads[0] += 1
            return method(self, *args, **kwargs)

        return read

    methods = {name: counting(getattr(torch.Tensor, name)) for name in ("tolist", "numpy")}
    with patched(torch.Tensor, **methods), HostSyncCounter() as ops:
        yield counted
    counted.append(ops.total + reads[0])


def _count(
    setting: str, *, spare: bool = False, skip: int | None = None, static: bool = False
) -> dict[str, Any]:
    """Host syncs of the forward, the backward and an SGD step of the second step of a
    4-block GPT (the first forward checks the plans across ranks once), and the collectives;
    ``spare``: the first block has a parameter that no rank uses; ``skip``: the rank whose second
    forward skips the second block; ``static``: after ``set_static_graph()``."""
    all_gather, reduce_scatter, param_dtype = SETTINGS[setting]
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=2, d_model=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    if spare:
        model.blocks[0].register_parameter("spare", torch.nn.Parameter(torch.ones(8)))
    compression = None
    if all_gather is not None or reduce_scatter is not None:
        compression = rf.CommCompression(all_gather=all_gather, reduce_scatter=reduce_scatter)
    mp = rf.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        rf.fully_shard(block, compression=compression, mp_policy=mp)
    rf.fully_shard(model, compression=compression, mp_policy=mp)
    if static:
        model.set_static_graph()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.randint(cfg.vocab_size, (2, cfg.seq_len + 1))
    counts: dict[str, Any] = {}
    for _ in range(2):
        model.reset_stats()
        skipping = skip == torch.distributed.get_rank() and bool(counts)  # the second step
        blocks = [b for i, b in enumerate(model.blocks) if not (skipping and i == 1)]
        run = functools.partial(iter, blocks)
        with _syncs() as forward, patched(type(model.blocks), __iter__=lambda _, run=run: run()):
            loss = model(idx[:, :-1], idx[:, 1:])
        with _syncs() as backward:
            loss.backward()
        with _syncs() as step:
            optimizer.step()
            optimizer.zero_grad()
        counts = {"forward": forward[0], "backward": backward[0], "step": step[0]}
    stats = model.stats()
    counts["gathers"] = int(stats["all_gather_calls"])
    counts["reductions"] = int(stats["reduce_scatter_calls"])
    return counts


def _per_message_checks(codec_cls: type[BucketCodec]) -> dict[str, Any]:
    """BucketCodec's finders and seal, each preceded by the host reads the runtime made before
    issue 23 (one ``bool(isfinite(...).all())`` per message, and one per sealed send)."""
    find_non_finite, find_poison, seal = (
        codec_cls.find_non_finite,
        codec_cls.find_poison,
        codec_cls.seal,
    )

    def old_find_non_finite(self, messages):
        for k, message in enumerate(messages):
            bool(torch.isfinite(self.scales(message)[: self.scale_counts[k]]).all())
        return find_non_finite(self, messages)

    def old_find_poison(self, received):
        for message in received:
            bool(torch.isfinite(self.scales(message)).all())
        return find_poison(self, received)

    def old_seal(self, outgoing):
        seal(self, outgoing)
        bool(torch.isfinite(outgoing.view(self.world_size, -1)[:, self.code_bytes :]).all())

    return {
        "find_non_finite": old_find_non_finite,
        "find_poison": old_find_poison,
        "seal": old_seal,
    }


def _cases(rank: int, world: int) -> dict[str, Any]:
    out = {setting: _count(setting) for setting in SETTINGS}
    out["spare"] = _count("fp32", spare=True)
    out["skip"] = _count("fp32", skip=1)
    out["static"] = _count("fp32", static=True)
    originals = {name: getattr(BucketCodec, name) for name in ("find_non_finite", "find_poison")}
    originals["seal"] = BucketCodec.seal
    for name, old in _per_message_checks(BucketCodec).items():
        setattr(BucketCodec, name, old)
    try:
        out["both_per_message"] = _count("both")
    finally:
        for name, original in originals.items():
            setattr(BucketCodec, name, original)
    return out


@pytest.fixture(scope="module")
def counts() -> list[dict[str, Any]]:
    return run_distributed(_cases, 2, timeout=300.0)


@pytest.mark.parametrize("setting", ["fp32", "bf16", "spare", "skip"])
def test_uncompressed_steps_wait_once_for_the_agreement(counts, setting):
    """The agreement at the start of backward ([Note: ranks whose graphs differ] in
    ``runtime/_sequence.py``) is read on the host by every rank, once, whether its graph is
    static, leaves a parameter unused or skips a block; the skipping rank catches up, so both
    issue the same collectives."""
    for rank_counts in counts:
        got = rank_counts[setting]
        assert (got["forward"], got["backward"], got["step"]) == (0, 1, 0), got
    gathers = [(c[setting]["gathers"], c[setting]["reductions"]) for c in counts]
    assert gathers[0] == gathers[1], gathers
    if setting == "skip":
        assert gathers[0] == (counts[0]["fp32"]["gathers"], 5), gathers


def test_a_static_graph_never_waits_for_the_device(counts):
    """``set_static_graph()``: no agreement, so no host sync in forward, backward or the step."""
    for rank_counts in counts:
        got = rank_counts["static"]
        assert (got["forward"], got["backward"], got["step"]) == (0, 0, 0), got


@pytest.mark.parametrize(
    ("setting", "expected"),
    [("all_gather", (1, 1)), ("reduce_scatter", (0, 2)), ("both", (1, 2))],
)
def test_compressed_steps_wait_once_per_direction(counts, setting, expected):
    """One per compressed direction, besides the agreement's one in backward."""
    for rank_counts in counts:
        got = rank_counts[setting]
        assert (got["forward"], got["backward"]) == expected, got
        assert got["step"] == 0, got  # SGD adds none


def test_per_message_checks_are_counted(counts):
    """Negative control: the old checks cost W per all-gather and W + 1 per reduce-scatter."""
    world = len(counts)
    for rank_counts in counts:
        new, old = rank_counts["both"], rank_counts["both_per_message"]
        assert (old["gathers"], old["reductions"]) == (new["gathers"], new["reductions"])
        extra = world * old["gathers"] + (world + 1) * old["reductions"]
        assert old["forward"] + old["backward"] == new["forward"] + new["backward"] + extra
        assert extra > 0
