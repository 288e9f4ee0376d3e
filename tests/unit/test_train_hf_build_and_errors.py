"""Hugging Face causal LMs as the training job builds them, in this process on a group of one:
every built-in config (Qwen2-MoE too) shards by decoder layer and takes a step; the one-line
errors of ``--hf-config`` (without ``transformers``, with ``--model``, a bad name), a config
file naming a folder, and the dry run. (The launches, and ``--compile``, whose compiler takes
minutes while its cache is cold: tests/e2e/test_train_hf.py.)"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from launches import one_error_line
from raggedfsdp.data import eval_batches, load_corpus
from raggedfsdp.models import hf
from raggedfsdp.train import build_parser
from raggedfsdp.train.build import build_model
from raggedfsdp.train.config import TrainConfig, config_from_args


def test_every_builtin_config_shards_by_decoder_layer(group_of_one, corpus):
    pytest.importorskip("transformers")
    x, y = eval_batches(load_corpus(corpus, seed=0).val, 1, seq_len=32, global_batch=2, seed=0)[0]
    for name in hf.TINY_CONFIGS:
        if hf.is_vlm(hf.hf_config(name)):
            continue  # with their vision blocks: tests/unit/test_vlm.py
        model = build_model(TrainConfig(hf_config=name), torch.device("cpu"))
        units = sorted({plan.name.split("/")[0] for plan in model.shard_plans()})
        assert units == ["<root>", "model.layers.0", "model.layers.1"], (name, units)
        loss = model(x, y)
        loss.backward()
        assert 5.0 < loss.item() < 6.0, name  # about ln 256 = 5.55 at initialisation
        assert all(p.grad is not None for p in model.parameters()), name


def test_without_transformers_one_line(command, monkeypatch, tmp_path):
    # ``import transformers`` fails when its sys.modules entry is None, as if not installed.
    monkeypatch.setitem(sys.modules, "transformers", None)
    hf.hf_config.cache_clear()
    status, _, err = command("train", "--hf-config=tiny-llama", f"--out={tmp_path / 'o'}")
    assert status == 2
    one_error_line(err, "pip install 'raggedfsdp[hf]'")
    assert not (tmp_path / "o").exists()
    hf.hf_config.cache_clear()


def test_hf_config_and_model_exclude_each_other(command, tmp_path):
    pytest.importorskip("transformers")
    for args in (["--model=gpt-tiny"], ["--model=gpt-small"]):
        status, _, err = command("train", "--hf-config=tiny-llama", *args, f"--out={tmp_path}")
        assert status == 2
        one_error_line(err, "--model and --hf-config")
    config = tmp_path / "run.toml"
    config.write_text('model = "gpt-tiny"\n')
    status, _, err = command("train", f"--config={config}", "--hf-config=tiny-llama")
    one_error_line(err, "--model and --hf-config")
    with pytest.raises(ValueError, match="give only one"):
        TrainConfig(model="gpt-tiny", hf_config="tiny-llama")


def test_bad_hf_configs_one_line(command, tmp_path):
    pytest.importorskip("transformers")
    status, _, err = command("train", "--hf-config=tiny-gpt5", f"--out={tmp_path / 'o'}")
    assert status == 2
    one_error_line(err, "tiny-gpt5", "tiny-llama-tied")
    vision = tmp_path / "vit"
    vision.mkdir()
    (vision / "config.json").write_text(json.dumps({"model_type": "vit"}))
    status, _, err = command("train", f"--hf-config={vision}", f"--out={tmp_path / 'o'}")
    one_error_line(err, "neither a causal LM nor an image-text-to-text model")
    status, _, err = command("train", "--hf-config=tiny-llama", "--seq-len=300")
    one_error_line(err, "seq_len", "[1, 256]")


def test_config_file_key_folder_and_dry_run(command, tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "qwen"
    big = transformers.AutoConfig.for_model(**hf.TINY_CONFIGS["tiny-qwen2-moe"])
    big.vocab_size, big.max_position_embeddings = 151_936, 32_768
    big.save_pretrained(folder)
    config = tmp_path / "run.toml"
    config.write_text(f'hf_config = "{folder}"\ncompile = true\n')
    cfg = config_from_args(build_parser().parse_args(["--config", str(config)]))
    assert (cfg.hf_config, cfg.compile, cfg.tokens_per_seq) == (str(folder), True, 1024)
    assert hf.hf_config(str(folder)).vocab_size == hf.BYTE_VOCAB
    status, out, err = command("train", "--dry-run", f"--config={config}", "--nproc=2")
    assert status == 0, err
    assert "model.layers.1/" in out and "estimated memory per rank" in out
    status, out, _ = command("train", "--help")
    assert "--hf-config" in out and "--compile" in out


@pytest.mark.parametrize("model_type", ["llama", "evil"])
def test_a_config_pointing_at_code_runs_none(command, tmp_path, model_type):
    """A config whose ``auto_map`` names code of its folder (which would write a marker when
    imported) is one line before launch, whether or not transformers has a class of its
    model_type; transformers never asks on the terminal whether to run it."""
    pytest.importorskip("transformers")
    hf.hf_config.cache_clear()
    marker = tmp_path / "MARKER"
    folder = tmp_path / "remote"
    folder.mkdir()
    for module in ("configuration_evil", "modeling_evil"):
        (folder / f"{module}.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    auto_map = {
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
    }
    config = {**hf.TINY_CONFIGS["tiny-llama"], "model_type": model_type, "auto_map": auto_map}
    (folder / "config.json").write_text(json.dumps(config))
    status, _, err = command("train", f"--hf-config={folder}", f"--out={tmp_path / 'o'}")
    assert status == 2
    one_error_line(err, "auto_map", "configuration_evil.EvilConfig")
    assert ("delete 'auto_map'" in err) == (model_type == "llama"), err
    assert not marker.exists() and not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match="auto_map"):  # the config a checkpoint records, too
        hf.build_hf_model(config, "meta")
    assert not marker.exists()
