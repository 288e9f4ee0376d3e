"""Hugging Face accelerate's FSDP2 plugin on 2 CPU processes (Gloo) preparing a
``transformers`` Llama with ``rf.fully_shard`` in place of torch's -- and, in the same launch,
with torch's FSDP2: activation checkpointing (``activation_checkpointing=True``: accelerate wraps
each decoder layer in torch's ``checkpoint_wrapper`` before sharding) and
``cpu_ram_efficient_loading=True`` (accelerate moves the model to meta, shards it there, then
broadcasts rank 0's weights and places each with ``distribute_tensor`` over the parameters' own
placements, and ``load_state_dict(assign=True)``). Both train 3 steps with
``accelerator.clip_grad_norm_``, judged against one process on the global batch.

How accelerate reaches raggedfsdp (docs/migrating-from-fsdp2.md, "Frameworks"): its
``fsdp2_prepare_model`` imports ``fully_shard`` from ``torch.distributed.fsdp`` when it runs, so
``torch.distributed.fsdp.fully_shard`` is patched to ``rf.fully_shard`` around
``accelerator.prepare``. accelerate 1.15 leaves a CPU run at ``MULTI_CPU`` and ignores the FSDP
plugin there; the test switches the state to FSDP after making the ``Accelerator`` (FSDP2
needs that too).

The silent failures of the framework-recipes issue, each with its negative control:

- activation checkpointing: "already sharded by raggedfsdp" (the ``checkpoint_wrapper``
  forwards attribute lookups to the layer it wraps, which was taken for sharded twice); the
  control: sharding one module twice still says exactly that;
- ``cpu_ram_efficient_loading`` failed on ``device_mesh`` (parameters were plain tensors); the
  values loaded are rank 0's (rank 1 builds different ones); the control: torch's own
  ``distribute_tensor``, which ``import raggedfsdp`` routes ragged placements away from,
  refuses them.

Needs the optional extras ``raggedfsdp[frameworks,hf]``; skipped (one line) without them.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate", reason="the optional extra raggedfsdp[frameworks] is missing")
pytest.importorskip("transformers", reason="the optional extra raggedfsdp[hf] is missing")

from harness import assert_close_dicts, run_distributed

WORLD = 2
BATCH = 2  # sequences per rank
SEQ = 8
VOCAB = 64
STEPS = 3
MAX_NORM = 0.5  # below the gradient norms: every step clips
IMPLS = ("rf", "fsdp2")
CASES = {
    "checkpointing": {"activation_checkpointing": True, "cpu_ram_efficient_loading": False},
    "ram_efficient": {"activation_checkpointing": False, "cpu_ram_efficient_loading": True},
}


def _model(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH * WORLD, SEQ), generator=g) for _ in range(STEPS)]


def _reference() -> dict[str, Any]:
    """One process on the global batches, clipped by torch's clip_grad_norm_."""
    model = _model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norms = []
    for ids in _batches():
        model(input_ids=ids, labels=ids).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    return {"norms": norms, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@contextlib.contextmanager
def _fully_shard_is(impl: str) -> Any:
    """accelerate's fsdp2_prepare_model imports fully_shard from torch.distributed.fsdp as it
    runs: the name there is what it calls."""
    import torch.distributed.fsdp as torch_fsdp

    import raggedfsdp as rf

    if impl == "fsdp2":
        yield
        return
    torch_fully_shard = torch_fsdp.fully_shard
    torch_fsdp.fully_shard = rf.fully_shard
    try:
        yield
    finally:
        torch_fsdp.fully_shard = torch_fully_shard


def _accelerate_run(impl: str, rank: int, options: dict[str, bool]) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    AcceleratorState._reset_state(True)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", **options
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    # accelerate 1.15 on a CPU: MULTI_CPU, the plugin ignored; FSDP as on an accelerator
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    # with cpu_ram_efficient_loading only rank 0's weights count: rank 1 builds others
    model = _model(0 if rank == 0 or not options["cpu_ram_efficient_loading"] else 99)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with _fully_shard_is(impl):
        model, optimizer = accelerator.prepare(model, optimizer)
    norms = []
    for ids in _batches():
        mine = ids[rank * BATCH : (rank + 1) * BATCH]
        accelerator.backward(model(input_ids=mine, labels=mine).loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
        norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        optimizer.step()
        optimizer.zero_grad()
    full = StateDictOptions(full_state_dict=True)  # on every rank
    return {
        "checkpoint_wrappers": sum(isinstance(m, CheckpointWrapper) for m in model.modules()),
        "units": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
        "norms": norms,
        "state": get_model_state_dict(model, options=full),
    }


def _raised(fn: Callable[[], object]) -> str:
    """What ``fn()`` raises on this rank (its type and message), or ``"no error"``."""
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _controls() -> dict[str, str]:
    import torch.distributed.tensor._api as dtensor_api
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    import raggedfsdp as rf

    block = torch.nn.Linear(4, 4)
    rf.fully_shard(block)
    wrapper = checkpoint_wrapper(block)
    sharded = rf.fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 6)))
    weight = sharded[0].weight
    # torch's own distribute_tensor, as it was before import raggedfsdp routed ragged placements
    torch_distribute = dtensor_api.distribute_tensor.__wrapped__
    whole = torch.zeros(weight.shape)
    return {
        "twice": _raised(lambda: rf.fully_shard(block)),
        "wrapper": _raised(lambda: rf.fully_shard(wrapper)),
        "torch_distribute": _raised(
            lambda: torch_distribute(whole, weight.device_mesh, weight.placements)
        ),
        "routed_distribute": _raised(
            lambda: dtensor_api.distribute_tensor(whole, weight.device_mesh, weight.placements)
        ),
    }


def _cases(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"reference": _reference(), "controls": _controls()}
    for case, options in CASES.items():
        for impl in IMPLS:
            # a failure is this case's, reported by its own test (every rank fails alike)
            try:
                out[f"{impl}/{case}"] = _accelerate_run(impl, rank, options)
            except Exception:
                out[f"{impl}/{case}"] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def grid() -> list[dict[str, Any]]:
    return run_distributed(_cases, WORLD, timeout=900)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("impl", IMPLS)
def test_prepare_trains_and_clips_as_one_process(grid, impl, case):
    for rank in grid:
        run, reference = rank[f"{impl}/{case}"], rank["reference"]
        assert not isinstance(run, str), run
        assert run["dtensors"] and run["units"] >= 4  # layers, embedding, [norm, head], root
        assert run["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        assert min(reference["norms"]) > MAX_NORM  # every step clipped
        assert_close_dicts(run["state"], reference["state"], atol=1e-6)


def test_activation_checkpointing_wraps_then_shards(grid):
    for rank in grid:
        for impl in IMPLS:
            assert not isinstance(rank[f"{impl}/checkpointing"], str), rank[f"{impl}/checkpointing"]
            assert rank[f"{impl}/checkpointing"]["checkpoint_wrappers"] == 2, impl
            assert rank[f"{impl}/ram_efficient"]["checkpoint_wrappers"] == 0, impl
        # negative control: a module sharded twice is refused with the message the issue met;
        # a checkpoint_wrapper around a sharded module is not that module
        controls = rank["controls"]
        assert "already sharded by raggedfsdp" in controls["twice"]
        assert controls["wrapper"] == "no error"


def test_ram_efficient_loading_places_rank_0s_weights(grid):
    for rank in grid:
        # rank 1 built other weights; training from them would not match the reference
        for impl in IMPLS:
            assert not isinstance(rank[f"{impl}/ram_efficient"], str), rank[f"{impl}/ram_efficient"]
        assert_close_dicts(
            rank["fsdp2/ram_efficient"]["state"], rank["reference"]["state"], atol=1e-6
        )
        assert_close_dicts(rank["rf/ram_efficient"]["state"], rank["reference"]["state"], atol=1e-6)
        # negative control: torch's distribute_tensor refuses a ragged placement; the one
        # import raggedfsdp installs takes it
        controls = rank["controls"]
        assert controls["torch_distribute"] != "no error"
        assert controls["routed_distribute"] == "no error"
