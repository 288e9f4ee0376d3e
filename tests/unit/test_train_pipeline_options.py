"""``--pp`` without a launch: the options' and the mesh's checks (each a one-line ``ValueError``
naming the fault, before any rank meets another), the mesh's ranks, and the stages the job cuts,
run one after the other in one process against the whole model. The runs themselves:
tests/e2e/test_train_pp.py.
"""

from __future__ import annotations

import json
import typing

import pytest
import torch

from raggedfsdp.facts import PP_SCHEDULES, PPSchedule
from raggedfsdp.models import GPT, GPT_CONFIGS, hf
from raggedfsdp.train.build import job_mesh, new_model
from raggedfsdp.train.config import TrainConfig
from raggedfsdp.train.mesh import JobMesh
from raggedfsdp.train.stages import cut


def test_the_mesh_places_pp_outermost():
    """(pp=2, dp=2, tp=2) over 8 ranks: a pipeline's stages 4 ranks apart, tp peers adjacent;
    the ranks of a pipeline and of a tp group read the same sequences."""
    meshes = [JobMesh(8, rank, tp=2, pp=2) for rank in range(8)]
    assert [m.pp_rank for m in meshes] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [m.data_rank for m in meshes] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert (meshes[0].dp, meshes[0].data_ranks) == (2, 2)
    assert meshes[0].describe() == {"pp": 2, "dp": 2, "tp": 2}
    assert str(JobMesh(4, pp=2)) == "pp=2 x dp=2" and JobMesh(4, pp=2).parallel


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pp": 0}, r"^pp: must be an integer >= 1, got 0$"),
        ({"pp": 2, "microbatches": 0}, r"^microbatches: must be >= 1, got 0$"),
        ({"pp": 2, "microbatches": 1}, r"^microbatches: 1f1b over --pp 2 needs at least 2 micro"),
        (
            {"pp": 2, "pp_schedule": "interleaved-1f1b", "microbatches": 5},
            r"^microbatches: interleaved-1f1b runs its 5 micro-batches in 2 rounds .* of 2$",
        ),
        ({"pp": 2, "ep": 2}, r"^ep: 2 with --pp: .* not expert parallelism yet$"),
        ({"pp": 2, "grad_accum": 2}, r"^grad_accum: 2 with --pp: .* leave --grad-accum at 1$"),
        (
            {"pp": 2, "compress_reduce_scatter": "int8", "error_feedback": True},
            r"^error_feedback: True with --pp: .* not checkpointed yet$",
        ),
        ({"pp": 2, "lora_rank": 4}, r"^lora_rank: --lora-rank with --pp is not supported yet$"),
    ],
)
def test_options_are_checked_when_made(options, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(model="gpt-tiny", **options)


def test_the_options_schedules_are_the_facts():
    """``--pp-schedule``'s type (the option's check and the CLI's choices) names exactly the
    schedules facts/schedules.py maps to torch's classes."""
    assert typing.get_args(PPSchedule) == tuple(PP_SCHEDULES)
    with pytest.raises(ValueError, match=r"^unknown pipeline schedule 'dualpipe'; known: gpipe, "):
        TrainConfig(model="gpt-tiny", pp=2, pp_schedule="dualpipe")  # type: ignore[arg-type]


def test_gpipe_takes_fewer_microbatches_than_stages():
    assert TrainConfig(model="gpt-tiny", pp=2, pp_schedule="gpipe", microbatches=1)
    assert (
        TrainConfig(model="gpt-small", pp=2, pp_schedule="zero-bubble").pipeline_microbatches == 4
    )


def test_the_world_and_the_batch_split_over_stages_and_microbatches():
    with pytest.raises(
        ValueError, match=r"^tp=2 x pp=2 x ep=1 = 4 does not divide the world size 6"
    ):
        job_mesh(TrainConfig(model="gpt-tiny", tp=2, pp=2), 6)
    # 4 ranks at pp=2 are 2 data ranks, each batch split into 2 micro-batches (the default)
    job_mesh(TrainConfig(model="gpt-tiny", pp=2, batch_size=4), 4)
    with pytest.raises(ValueError, match=r"of 6 .* into 2 data rank\(s\) x 2 micro-batch\(es\)"):
        job_mesh(TrainConfig(model="gpt-tiny", pp=2, batch_size=6), 4)
    with pytest.raises(ValueError, match=r"of 8 .* into 2 data rank\(s\) x 3 micro-batch"):
        job_mesh(TrainConfig(model="gpt-tiny", pp=2, microbatches=3, batch_size=8), 4)


def test_the_layers_must_split_into_the_stages():
    with pytest.raises(ValueError, match=r"^pp: gpt-tiny has 2 layers, which 4 pipeline stages"):
        job_mesh(TrainConfig(model="gpt-tiny", pp=4, batch_size=16), 4)
    with pytest.raises(ValueError, match=r"4 pipeline stages \(2 x 2 per rank, interleaved-1f1b\)"):
        job_mesh(TrainConfig(model="gpt-tiny", pp=2, pp_schedule="interleaved-1f1b"), 4)
    job_mesh(TrainConfig(model="gpt-small", pp=2, pp_schedule="interleaved-1f1b"), 4)


def test_hf_models_that_cannot_be_cut(tmp_path):
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match=r"^hf_config: .* with --pp: .* vision-language model"):
        TrainConfig(hf_config="tiny-llava", pp=2)
    gpt2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64}
    (tmp_path / "config.json").write_text(json.dumps(gpt2))
    with pytest.raises(ValueError, match=r"^pp: .* \(GPT2LMHeadModel\) cannot be cut .* lacks"):
        job_mesh(TrainConfig(hf_config=str(tmp_path), pp=2), 4)


def _stages_in_turn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss of ``model`` cut into 2 stages, run one after the other."""
    first, last = cut(model, 0, 2), cut(model, 1, 2)
    return hf.mean_token_loss(last(first(x)), y)


@pytest.mark.parametrize("spec", ["gpt-tiny", "tiny-llama"])
def test_stages_in_turn_are_the_whole_model(spec):
    """The stages keep the whole model's names (their state dicts together are its state dict,
    the tied head in the last) and, run in turn, compute its loss; a stage alone does not."""
    if spec.startswith("tiny"):
        pytest.importorskip("transformers")
    cfg = TrainConfig(**({"model": spec} if spec.startswith("gpt") else {"hf_config": spec}))
    torch.manual_seed(0)
    model = new_model(cfg, "cpu")
    x, y = (
        torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(i)) for i in (1, 2)
    )
    whole = model(x, y)
    first, last = cut(model, 0, 2), cut(model, 1, 2)
    keys = first.state_dict().keys() | last.state_dict().keys()
    assert keys == model.state_dict().keys()
    assert not first.state_dict().keys() & last.state_dict().keys()
    torch.testing.assert_close(_stages_in_turn(model, x, y), whole, rtol=0, atol=1e-6)
    # Negative control: the last stage given the embedded tokens only, skipping the first's
    # layers, is another loss.
    if isinstance(model, GPT):
        skipped = model.tok_emb(x) + model.pos_emb(torch.arange(16))
    else:
        skipped = model.model.embed_tokens(x)
    assert abs(hf.mean_token_loss(last(skipped), y) - whole) > 1e-3
    if isinstance(model, GPT):  # gpt-tiny ties its head: the last stage's head is a copy
        assert GPT_CONFIGS["gpt-tiny"].tie_embeddings and last.head.weight is not model.head.weight
