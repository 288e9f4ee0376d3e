"""``--tp`` / ``--ep`` without a launch: the options' checks, the mesh's ranks, the models'
checks (each a one-line ``ValueError`` naming the fault, before any rank meets another), and the
tensor-parallel split on the meta device. The runs themselves: tests/e2e/test_train_parallel.py.
"""

from __future__ import annotations

import pytest

from raggedfsdp.models import GPT, GPT_CONFIGS, GPTConfig
from raggedfsdp.models.tensor_parallel import check_tensor_parallel
from raggedfsdp.train.build import job_mesh
from raggedfsdp.train.config import TrainConfig
from raggedfsdp.train.mesh import JobMesh
from raggedfsdp.train.preflight import dry_run_report


def test_the_mesh_places_tp_innermost_and_ep_among_the_data_ranks():
    tp = [JobMesh(8, rank, tp=2) for rank in range(8)]
    assert [m.data_rank for m in tp] == [0, 0, 1, 1, 2, 2, 3, 3]  # tp peers share sequences
    assert (tp[0].dp, tp[0].data_ranks, tp[0].describe()) == (4, 4, {"dp": 4, "tp": 2})
    ep = [JobMesh(8, rank, ep=2) for rank in range(8)]
    assert [m.data_rank for m in ep] == list(range(8))  # ep borrows from data parallelism
    assert (ep[0].dp, ep[0].data_ranks, str(ep[0])) == (4, 8, "dp=4 x ep=2")
    assert JobMesh(8).describe() == {"dp": 8}  # what a checkpoint of FSDP alone recorded
    assert not JobMesh(8).parallel


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tp": 0}, r"^tp: must be an integer >= 1, got 0$"),
        ({"ep": True}, r"^ep: must be an integer >= 1, got True$"),
        ({"tp": 2, "ep": 2}, r"^tp: --tp 2 with --ep 2: .* not both at once; choose one$"),
        ({"tp": 2, "optimizer": "shampoo"}, r"^optimizer: shampoo .* --tp 2 splits .* muon$"),
        ({"ep": 2, "optimizer": "adamw8bit"}, r"^optimizer: adamw8bit .* --ep 2 splits"),
        ({"tp": 2, "compile": True}, r"^compile: --compile with --tp 2 is not supported yet"),
    ],
)
def test_options_are_checked_when_made(options, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(model="gpt-tiny", **options)


def test_the_world_and_the_batch_split_over_the_data_ranks():
    with pytest.raises(ValueError, match=r"tp=3 x ep=1 = 3 does not divide the world size 4"):
        job_mesh(TrainConfig(model="gpt-tiny", tp=3), 4)
    # 4 ranks at tp=2 are 2 data ranks: a batch of 2 splits, one of 3 does not
    job_mesh(TrainConfig(model="gpt-tiny", tp=2, batch_size=2), 4)
    with pytest.raises(ValueError, match=r"into 2 data rank\(s\) x 1 micro-batch\(es\)"):
        job_mesh(TrainConfig(model="gpt-tiny", tp=2, batch_size=3), 4)


def test_the_model_is_checked_against_the_split():
    with pytest.raises(ValueError, match=r"^tp=4 does not divide the 2 attention heads of gpt"):
        job_mesh(TrainConfig(model="gpt-tiny", tp=4, batch_size=16), 8)
    odd = GPT(GPTConfig(vocab_size=250, seq_len=8, n_layer=1, n_head=4, d_model=8), device="meta")
    with pytest.raises(ValueError, match=r"tp=4 does not divide the 250 vocabulary entries of x"):
        check_tensor_parallel(odd, 4, name="x")
    with pytest.raises(ValueError, match=r"^ep: .*no experts .* cannot take --ep"):
        job_mesh(TrainConfig(model="gpt-tiny", ep=2), 4)


def test_hf_models_are_checked_against_the_split():
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match=r"^tp: layer 0 of tiny-mixtral has no mlp.gate_proj"):
        job_mesh(TrainConfig(hf_config="tiny-mixtral", tp=2), 4)
    with pytest.raises(ValueError, match=r"tp=4 does not divide the 2 key/value heads"):
        job_mesh(TrainConfig(hf_config="tiny-llama", tp=4, batch_size=16), 8)
    with pytest.raises(ValueError, match=r"^ep: .* holds 4 experts, which 8 expert-parallel"):
        job_mesh(TrainConfig(hf_config="tiny-mixtral", ep=8, batch_size=16), 8)


def test_the_dry_run_plans_a_ranks_pieces():
    """gpt-tiny at (dp=2, tp=2): every block matrix and the vocabulary split in two, the
    positions and norms whole, each planned over dp = 2: a quarter of the model per rank, as at
    dp = 4 alone (the tied head once)."""
    cfg = GPT_CONFIGS["gpt-tiny"]
    d, v = cfg.d_model, cfg.vocab_size
    block = 12 * d * d // 2 + 4 * d  # q k v proj fc mlp.proj halved; four norm vectors
    root = v * d // 2 + cfg.seq_len * d + 2 * d
    report = dry_run_report(TrainConfig(model="gpt-tiny", tp=2, batch_size=8), 4)
    assert "on 4 rank(s) (dp=2 x tp=2; a rank's pieces)" in report
    assert f"{2 * block + root:>12,}{(2 * block + root) // 2:>12,}" in report
    assert "(micro-batch of 4)" in report  # 8 sequences over 2 data ranks
