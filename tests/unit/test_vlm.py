"""Vision-language models in the job, in this process: scikit-learn's digits as image-text
samples and their mixing with text (world-size independent, the fraction asked), the built-in
tiny-llava and tiny-qwen2-vl (sharded by decoder layer and vision block, a loss equal to
transformers' own forward; Qwen2-VL's patches equal to its image processor's), and the one-line
errors of bad input. (The job launched: tests/e2e/test_train_vlm.py; W=2 against one process:
tests/distributed/test_vlm_parity.py.)"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from launches import one_error_line
from raggedfsdp import digits as dg
from raggedfsdp.models import hf
from raggedfsdp.train.build import build_model, job_mesh
from raggedfsdp.train.config import TrainConfig

pytest.importorskip("transformers")
pytest.importorskip("sklearn")

VLMS = ("tiny-llava", "tiny-qwen2-vl")
TOKENS = torch.arange(5000, dtype=torch.int64).remainder(251).to(torch.uint8)


def _sampler(fmt: dg.ImageFormat, rank: int = 0, world: int = 1, **kwargs) -> dg.ImageTextSampler:
    train, _ = dg.load_digits()
    options = {"image_fraction": 0.5, "seq_len": 64, "global_batch": 12, "seed": 3, **kwargs}
    return dg.ImageTextSampler(TOKENS, train, fmt, rank=rank, world_size=world, **options)


def test_digits_split_and_samples():
    train, held = dg.load_digits()
    assert (len(train), len(held)) == (1498, 299)
    assert sorted(held.labels.unique().tolist()) == list(range(10))
    assert float(train.images.min()) == 0.0 and float(train.images.max()) == 1.0
    fmt = hf.image_format("tiny-llava")
    assert (len(fmt.prefix), fmt.size, fmt.channels) == (16, 16, 3)
    x, y, pixels = dg.digit_rows(held, torch.tensor([0, 7]), fmt, seq_len=40)
    for row, label in enumerate(held.labels[[0, 7]].tolist()):
        assert bytes(x[row, 16 : fmt.sample_len - 1].tolist()) == dg.PROMPT
        assert not x[row, fmt.sample_len - 1 :].any()  # padding
        assert x[row, :16].tolist() == [hf.BYTE_VOCAB] * 16
        assert y[row, fmt.answer_position] == ord(str(label))
        assert x[row, fmt.answer_position] == ord(" ")
        # Targets: the text after the image and the digit; never an image token or padding.
        assert (y[row, :15] == dg.IGNORE_INDEX).all()
        assert (y[row, fmt.sample_len - 1 :] == dg.IGNORE_INDEX).all()
        assert y[row, 15] == dg.PROMPT[0]
    # Upscaled bilinearly from the 8x8 digit to [-1, 1], the same on every channel.
    assert pixels.shape == (2, 3, 16, 16)
    assert torch.equal(pixels[:, 0], pixels[:, 2])
    assert pixels.min() >= -1.0 and pixels.max() <= 1.0
    down = F.avg_pool2d(pixels[:, :1], 2).flatten()  # back to 8x8: the digit, a little blurred
    assert torch.corrcoef(torch.stack([down, held.images[[0, 7]].flatten()]))[0, 1] > 0.95
    with pytest.raises(ValueError, match=r"^seq_len: 30 tokens cannot hold .* of 36"):
        dg.digit_rows(held, torch.tensor([0]), fmt, seq_len=30)


def test_mixing_is_world_size_independent_and_the_fraction_asked():
    fmt = hf.image_format("tiny-qwen2-vl")
    whole = _sampler(fmt)
    for step in (0, 5, 17):
        want = whole.batch(step)
        for world in (2, 3, 4):
            pieces = [_sampler(fmt, r, world).batch(step) for r in range(world)]
            for got, expected in zip(zip(*pieces, strict=True), want, strict=True):
                assert torch.equal(torch.cat(got), expected), (step, world)
    images = torch.stack([(whole.batch(k)[0] == 256).any(1) for k in range(400)])  # [step, row]
    assert 0.45 < images.float().mean() < 0.55
    # Drawn per row: at W=2 (6 rows a rank) some steps give one rank images and the other none.
    halves = images.reshape(400, 2, 6).any(2)
    assert (halves[:, 0] != halves[:, 1]).any()
    # A text row is the corpus window sample_batch draws, its pixels zero.
    x, y, pixels = whole.batch(1)
    text = ~(x == 256).any(1)
    assert torch.equal(x[text, 1:], y[text, :-1]) and not pixels[text].any()
    for fraction, rows in ((0.0, 0), (1.0, 12)):
        x, _, _ = _sampler(fmt, image_fraction=fraction).batch(4)
        assert int((x == 256).any(1).sum()) == rows


def test_accuracy_batches_hold_every_held_out_digit_once():
    fmt = hf.image_format("tiny-llava")
    _, held = dg.load_digits()
    for world in (1, 2, 7):
        seen: list[int] = []
        counts = set()
        for rank in range(world):
            batches = _sampler(fmt, rank, world, global_batch=14).accuracy_batches(held)
            counts.add(len(batches))  # a collective each: the same count on every rank
            for x, pixels, labels, counted in batches:
                assert (x == 256).any(1).all() and pixels.shape[0] == labels.shape[0]
                seen += labels[counted].tolist()
        assert len(counts) == 1
        assert sorted(seen) == sorted(held.labels.tolist())


@pytest.mark.parametrize("name", VLMS)
def test_vlms_shard_by_layer_and_block_and_match_transformers(group_of_one, corpus, name):
    import transformers

    cfg = TrainConfig(hf_config=name, data=str(corpus))
    model = build_model(cfg, torch.device("cpu"))
    units = sorted({plan.name.split("/")[0] for plan in model.shard_plans()})
    vision = {
        "tiny-llava": ["model.vision_tower.embeddings"]
        + [f"model.vision_tower.encoder.layers.{i}" for i in range(2)],
        "tiny-qwen2-vl": [f"model.visual.blocks.{i}" for i in range(2)],
    }[name]
    assert units == sorted(
        ["<root>", *vision, "model.language_model.layers.0", "model.language_model.layers.1"]
    )
    x, y, pixels = _sampler(cfg.image_format(), global_batch=4, image_fraction=0.5).batch(2)
    loss = model(x, y, pixels)
    loss.backward()
    assert 2.0 < loss.item() < 6.0  # ln 264 = 5.58 at initialisation, on the targets counted
    # The same weights in transformers' own class, fed as its processor would.
    torch.manual_seed(cfg.seed)
    reference = transformers.AutoModelForImageTextToText.from_config(hf.hf_config(name))
    rows = (x == 256).any(1)
    inputs = model._image_inputs(x, pixels)
    logits = reference(input_ids=x, **inputs).logits
    token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
    want = token.mean()  # over every position, an ignored target's loss 0
    assert (token[y.reshape(-1) == dg.IGNORE_INDEX] == 0).all()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    assert rows.any() and not rows.all()
    if name == "tiny-qwen2-vl":
        _check_qwen_patches(pixels[rows], inputs)


def _check_qwen_patches(images: torch.Tensor, inputs: dict) -> None:
    """hf's patches are what transformers' own Qwen2-VL image processor makes of the images."""
    from transformers import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor(
        do_resize=False, do_rescale=False, do_normalize=False, patch_size=4, merge_size=2
    )
    want = processor(images=list(images.numpy()), return_tensors="pt")
    torch.testing.assert_close(inputs["pixel_values"], want["pixel_values"])
    assert torch.equal(inputs["image_grid_thw"], want["image_grid_thw"])


def test_conv_patch_embedding_keeps_whole_filters():
    """tiny-llava's Conv2d and tiny-qwen2-vl's Conv3d are planned in whole output channels."""
    from raggedfsdp.train.build import build_planner, meta_model

    for name, path in (
        ("tiny-llava", "model.vision_tower.embeddings.patch_embedding.weight"),
        ("tiny-qwen2-vl", "model.visual.patch_embed.proj.weight"),
    ):
        weight = dict(meta_model(TrainConfig(hf_config=name)).named_parameters())[path]
        assert weight.dim() in (4, 5)
        unit = build_planner(TrainConfig(hf_config=name)).unit_numel(path, weight.shape)
        assert unit == weight[0].numel(), name


def test_tp_splits_the_language_model_alone():
    mesh = job_mesh(TrainConfig(hf_config="tiny-llava", tp=2), 4)
    assert (mesh.tp, mesh.data_ranks) == (2, 2)
    model = hf.build_hf_model("tiny-llava", "meta")
    assert [type(m).__name__ for m in hf.text_layers(model)] == ["LlamaDecoderLayer"] * 2
    assert len(hf.decoder_layers(model)) == 5


def test_bad_input_is_one_line_before_launch(command, tmp_path):
    out = f"--out={tmp_path / 'o'}"
    status, _, err = command("train", "--hf-config=tiny-llava", "--image-fraction=1.5", out)
    assert status == 2
    one_error_line(err, "image_fraction: must be in [0, 1], got 1.5")
    status, _, err = command("train", "--hf-config=tiny-llava", "--image-size=20", out)
    one_error_line(err, "image_size: 20 does not fit the vision tower", "16x16")
    status, _, err = command("train", "--hf-config=tiny-qwen2-vl", "--image-size=12", out)
    one_error_line(err, "image_size: 12 does not fit", "multiple of 8")
    status, _, err = command("train", "--hf-config=tiny-llava", "--seq-len=30", out)
    one_error_line(err, "seq_len: 30 tokens cannot hold an image-text sample")
    status, _, err = command("train", "--hf-config=tiny-llama", "--image-size=16", out)
    one_error_line(err, "not a vision-language model")
    vision = tmp_path / "blip"
    vision.mkdir()
    (vision / "config.json").write_text('{"model_type": "blip-2"}')
    status, _, err = command("train", f"--hf-config={vision}", out)
    one_error_line(
        err,
        "an image-text-to-text model the job cannot feed yet",
        "LlavaForConditionalGeneration, Qwen2VLForConditionalGeneration",
    )
    assert not (tmp_path / "o").exists()


def test_without_scikit_learn_one_line(monkeypatch, command, tmp_path):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ValueError, match=r"scikit-learn: pip install 'raggedfsdp\[vlm\]'$"):
        dg.load_digits()
    monkeypatch.setitem(sys.modules, "sklearn", None)  # as if not installed: before launch
    status, _, err = command("train", "--hf-config=tiny-llava", f"--out={tmp_path / 'o'}")
    assert status == 2
    one_error_line(err, "pip install 'raggedfsdp[vlm]'")
    assert not (tmp_path / "o").exists()


def test_a_unit_first_run_after_the_first_step_trains_as_one_process(group_of_one, corpus):
    """A job whose first batches hold no image runs its vision units first in a later step:
    their gradients (the patch embedding's, whose input needs none) are reduced as every
    unit's, and training equals the unsharded model's step for step (it was lost: ``None``)."""
    cfg = TrainConfig(hf_config="tiny-llava", data=str(corpus), lr=1e-2)
    text = _sampler(cfg.image_format(), global_batch=4, image_fraction=0.0)
    images = _sampler(cfg.image_format(), global_batch=4, image_fraction=1.0)
    batches = [text.batch(0), text.batch(1), images.batch(2), images.batch(3)]
    sharded = build_model(cfg, torch.device("cpu"))
    torch.manual_seed(cfg.seed)
    plain = hf.build_hf_model("tiny-llava", "cpu")
    patch = "model.vision_tower.embeddings.patch_embedding.weight"
    for model in (sharded, plain):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model.losses, model.graded = [], []
        for batch in batches:  # text, text, then images
            loss = model(*batch)
            loss.backward()
            model.losses.append(loss.item())
            model.graded.append(dict(model.named_parameters())[patch].grad is not None)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert sharded.graded == plain.graded == [False, False, True, True]
    torch.testing.assert_close(sharded.losses, plain.losses, rtol=1e-6, atol=0)
    got = dict(sharded.named_parameters())[patch].full_tensor()
    torch.testing.assert_close(got, dict(plain.named_parameters())[patch], rtol=1e-6, atol=0)
