"""What a training run exports loads where users will load it: LoRA into the family pipeline,
full weights with from_pretrained; LTX-Video image-to-video trains and validates with its i2v pipeline."""

from __future__ import annotations

import json

import numpy as np
import torch

from vt.shared.config import load_config

from helpers.cli_runs import write_config


def precompute_and_train(tmp_path, model_path, raw, family: str, **sections):
    from vt.precompute.service import Precompute
    from vt.train.trainer import Trainer

    sections.setdefault("train", {}).update(max_steps=3, lr=5e-2, checkpoint_every=0)
    sections.setdefault("precompute", {}).update(workers=0)
    sections.setdefault("model", {}).update(family=family)
    sections.setdefault("log", {}).update(progress=False)
    path = write_config(
        tmp_path / "run.toml",
        model_path,
        raw,
        tmp_path / "run",
        str(tmp_path / "window"),
        **sections,
        window={"size": "keep"},
    )
    config = load_config(path)
    Precompute(config).run()
    trainer = Trainer(config)
    summary = trainer.run()
    return config, trainer, summary


def latent_output(pipeline, spec, config, seed=0):
    from vt.shared.buckets import Bucket

    kwargs = spec.pipeline_inputs("a cartoon rabbit in a green meadow", Bucket(9, 64, 96), 2, seed)
    return pipeline(**kwargs, output_type="latent").frames


def test_trained_ltx_lora_loads_into_the_pipeline_and_changes_its_output(tmp_path, tiny_model_factory, raw_shards):
    model = tiny_model_factory("ltx-video")
    config, trainer, summary = precompute_and_train(tmp_path, model, raw_shards, "ltx-video")
    lora_file = tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors"
    assert summary["export"] == str(lora_file) and lora_file.is_file()

    pipeline_class = trainer.spec.pipeline_class()
    base = pipeline_class.from_pretrained(model)
    before = latent_output(base, trainer.spec, config)
    base.load_lora_weights(lora_file.parent)
    after = latent_output(base, trainer.spec, config)
    assert not torch.allclose(before, after, atol=1e-4), "the trained LoRA did not change the pipeline's output"


def test_trained_wan_full_weights_load_with_from_pretrained(tmp_path, tiny_model_factory, raw_shards):
    from diffusers import WanTransformer3DModel

    model = tiny_model_factory("wan")
    config, trainer, summary = precompute_and_train(
        tmp_path,
        model,
        raw_shards,
        "wan",
        train={"mode": "full"},
        buckets={"sizes": ["5x64x96", "5x64x64", "5x64x128"]},  # 5 frames: stage 1's encodes are most of the cost
    )
    loaded = WanTransformer3DModel.from_pretrained(tmp_path / "run" / "model")
    original = WanTransformer3DModel.from_pretrained(model, subfolder="transformer")
    trained = trainer.transformer.state_dict()
    assert loaded.state_dict().keys() == trained.keys()
    assert all(torch.equal(loaded.state_dict()[k], trained[k].float()) for k in trained)
    assert any(not torch.equal(original.state_dict()[k], trained[k]) for k in trained), "full fine-tune changed nothing"


def test_ltx_image_to_video_trains_and_validates_with_the_i2v_pipeline(
    tmp_path, tiny_model_factory, raw_shards, clips_dir
):
    import av

    from vt.shared.video_io import read_video

    image = tmp_path / "first.png"
    with av.open(str(clips_dir / "bigbuckbunny.mp4")) as container:
        next(container.decode(video=0)).to_image().resize((96, 64)).save(image)
    config, trainer, summary = precompute_and_train(
        tmp_path,
        tiny_model_factory("ltx-video"),
        raw_shards,
        "ltx-video",
        model={"task": "i2v"},
        validation={"prompts": ["a cartoon rabbit"], "images": [str(image)], "steps": 2, "vae_tiling": True},
    )
    assert type(trainer.validator._pipeline).__name__ == "LTXImageToVideoPipeline"
    assert trainer.validator._tiled  # asked for: decoded through diffusers' tiling (tests/shared/test_vae_tiling.py)
    video = read_video(tmp_path / "run" / "validation" / f"step-{summary['steps']:06d}" / "00.mp4")
    assert video.shape[0] == 9 and video.shape[1:3] == (64, 64)  # the smallest bucket
    from vt.shared.shards import decode_shard
    from vt.shared.window import open_reader

    window = open_reader(str(tmp_path / "window"))
    _, record = next(iter(window.order()))
    tensors, _, _ = decode_shard(window.read_shard(record))
    assert "first_frame_latents" in tensors and tensors["first_frame_latents"].shape[2] == 1


def test_both_wan22_experts_train_in_one_run_validate_and_export_full_weights(tmp_path, tiny_model_factory, raw_shards):
    """model.expert = "all": each sample trains the expert of its sigma (sigmas reach both sides of the
    boundary), validation runs the pipeline around both trained experts (the base's videos: its step-0 renders), and
    each expert's full weights land in model/<pipeline component> for from_pretrained."""
    from diffusers import WanTransformer3DModel

    from vt.shared.video_io import read_video

    model = tiny_model_factory("wan2.2")
    config, trainer, summary = precompute_and_train(
        tmp_path,
        model,
        raw_shards,
        "wan2.2",
        model={"expert": "all", "max_text_tokens": 16},
        buckets={"sizes": ["5x64x64"]},
        train={"mode": "full"},
        flow={"sigma_sampling": "uniform", "shift": 5.0},
        validation={"prompts": ["a rabbit"], "steps": 2},
    )
    assert summary["export"] == str(tmp_path / "run" / "model") and summary["videos"] == 1
    # a full fine-tune's base videos (validation.base) are its step-0 renders, kept beside the trained weights' ones
    validation = tmp_path / "run" / "validation"
    assert json.loads((validation / "base" / "base.json").read_text())["step"] == 0
    base, last = (
        read_video(path).astype(int)
        for path in (validation / "base" / "00.mp4", validation / f"step-{summary['steps']:06d}" / "00.mp4")
    )
    assert base.shape == last.shape and np.abs(base - last).mean() > 0.5
    pipeline = trainer.validator._pipeline
    assert pipeline.transformer is trainer.transformer["high_noise"]
    assert pipeline.transformer_2 is trainer.transformer["low_noise"]
    for expert, component in (("high_noise", "transformer"), ("low_noise", "transformer_2")):
        loaded = WanTransformer3DModel.from_pretrained(tmp_path / "run" / "model" / component).state_dict()
        original = WanTransformer3DModel.from_pretrained(model, subfolder=component).state_dict()
        trained = trainer.transformer[expert].state_dict()
        assert loaded.keys() == trained.keys() and all(torch.equal(loaded[k], trained[k]) for k in trained)
        assert any(not torch.equal(original[k], trained[k]) for k in trained), f"{expert} did not train"
