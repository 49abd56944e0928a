"""SkyReels V2: image-to-video as SkyReelsV2ImageToVideoPipeline conditions, and diffusion forcing (a noise
level per latent frame) against what the diffusion-forcing pipelines feed the transformer, on tiny real
models; context parallel over the per-frame modulations in real processes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_reference_numbers import BATCH, check_pinned, pinned, run  # noqa: F401

from vt.shared.buckets import Bucket
from vt.shared.config import ConfigError, ModelConfig, load_config
from vt.shared.models import build_spec

from helpers.family_cases import BUCKET
from helpers.lora_init import randomise_lora
from helpers.spec_inputs import CAPTIONS, capture_transformer_inputs, make_spec, pipeline_latents, uint8_video

IMAGE = np.random.default_rng(2).integers(0, 256, (BUCKET.height, BUCKET.width, 3), dtype=np.uint8)


def df_spec(folder, task="t2v", frame_rate=8.0, **kw):
    """Diffusion forcing on the t2v preset (the DF checkpoints' transformer layout), text of 16 tokens."""
    config = ModelConfig(
        family="skyreels-v2", path=str(folder), task=task, max_text_tokens=16, diffusion_forcing=True, **kw
    )
    return build_spec(config, frame_rate=frame_rate)


def stage1(spec, clip):
    encoders = spec.load_stage1()
    return {**spec.encode_text(encoders, CAPTIONS[: len(clip)]), **spec.encode_video(encoders, clip)}


@pytest.fixture(scope="module")
def df13b(tiny_model_factory, tmp_path_factory):
    """A DF-1.3B-like transformer (the t2v preset's sizes with `inject_sample_info`: the fps embedding),
    saved as a component folder for model.components.transformer."""
    from vt.shared.models.presets.skyreels_v2 import tiny_skyreels_transformer
    from vt.shared.models.tiny import seeded

    with seeded(1):
        transformer = tiny_skyreels_transformer(in_channels=16, out_channels=16, inject_sample_info=True)
    out = tmp_path_factory.mktemp("skyreels-df13b")
    transformer.save_pretrained(out, safe_serialization=True)
    return out


# ----------------------------------------------------------------------------- image-to-video
def test_i2v_conditions_as_the_i2v_pipeline_and_its_lora_loads_back(tiny_model_factory, tmp_path):
    """I2V: stage 1 stores the pipeline's encode_image tokens and [mask, condition] latents; the transformer
    takes 36 channels and the image tokens; the ComfyUI file loads into a fresh SkyReelsV2ImageToVideoPipeline."""
    from diffusers import SkyReelsV2ImageToVideoPipeline
    from peft.utils import get_peft_model_state_dict
    from PIL import Image
    from safetensors.torch import load_file

    folder = tiny_model_factory("skyreels-v2", task="i2v")
    spec = build_spec(ModelConfig(family="skyreels-v2", task="i2v", path=str(folder)), 8.0)
    assert spec.pipeline_class() is SkyReelsV2ImageToVideoPipeline and spec.max_text_tokens == 512
    assert spec.stage1_components == ("tokenizer", "text_encoder", "vae", "image_encoder", "image_processor")
    clip, pixels = uint8_video(1)
    batch = stage1(spec, clip)
    reference = SkyReelsV2ImageToVideoPipeline.from_pretrained(folder)
    image = Image.fromarray(pixels[0, 0].numpy())
    torch.testing.assert_close(batch["image_embeds"], reference.encode_image(image, "cpu"))
    frame = reference.video_processor.preprocess(image, height=BUCKET.height, width=BUCKET.width)
    _, condition = reference.prepare_latents(
        frame, 1, 16, BUCKET.height, BUCKET.width, BUCKET.frames, torch.float32, "cpu", torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(condition[:, 4:], batch["condition_latents"], atol=1e-5, rtol=1e-5)

    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=4, alpha=8.0, targets=None)
    randomise_lora(transformer, seed=3)
    seen = capture_transformer_inputs(transformer)
    sigmas = torch.tensor([0.4])
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(1))
    out = spec.forward(transformer, batch, sigmas, noise)
    assert seen["hidden_states"].shape == (1, 36, 3, 8, 12) and "enable_diffusion_forcing" not in seen
    hidden = seen["hidden_states"]
    torch.testing.assert_close(hidden[:, :16], 0.6 * batch["latents"] + 0.4 * noise)
    assert torch.equal(hidden[:, 16:20], condition[:, :4]) and torch.equal(hidden[:, 20:], batch["condition_latents"])
    assert torch.equal(seen["encoder_hidden_states_image"], batch["image_embeds"])
    torch.testing.assert_close(seen["timestep"], sigmas * 1000)
    assert out.weight is None and torch.equal(out.target, noise - batch["latents"])

    # The ComfyUI file (image keys/values as cross_attn.k_img / v_img) through diffusers' Wan conversion; the
    # diffusers file reads back through the same loader as t2v's (tests/shared/test_models.py).
    spec.save_lora(get_peft_model_state_dict(transformer), tmp_path)
    assert "diffusion_model.blocks.1.cross_attn.v_img.lora_B.weight" in load_file(tmp_path / "lora_comfyui.safetensors")
    in_memory = pipeline_latents(spec, spec.build_pipeline(transformer), image=IMAGE)
    fresh = SkyReelsV2ImageToVideoPipeline.from_pretrained(folder)
    fresh.set_progress_bar_config(disable=True)
    spec.load_lora(fresh, tmp_path, weight_name="lora_comfyui.safetensors")
    torch.testing.assert_close(pipeline_latents(spec, fresh, image=IMAGE), in_memory, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- diffusion forcing
def test_diffusion_forcing_draws_a_sigma_per_latent_frame_keyed_per_sample(tiny_model_factory):
    """The trainer draws (B, latent frames) sigmas, each sample's from its own keyed generator (the same
    whatever the data-parallel slicing); the transformer gets 1000 x each frame's sigma as its (B, F)
    timestep, with every frame noised at its own sigma, and the loss is flow matching on every frame."""
    from vt.train.data import Batch
    from vt.train.parallel.batching import draw_inputs, take_slice

    spec = df_spec(tiny_model_factory("skyreels-v2"))
    batch = stage1(spec, uint8_video(2)[0])
    latents = batch["latents"]
    assert set(batch) == {"prompt_embeds", "latents"} and spec.noise_levels(latents.shape[1:]) == 3
    whole = Batch("9x64x96", 0, ["a", "b", "c"], {"latents": torch.cat([latents, latents[:1]])})
    sigmas, noise = draw_inputs(take_slice(whole, 0, 1), seed=5, step=7, scheme="logit_normal", shift=3.0, levels=3)
    assert sigmas.shape == (3, 3) and len({round(float(s), 6) for s in sigmas.flatten()}) == 9
    for rank in range(2):  # two data-parallel ranks draw their rows' sigmas and noise exactly
        part = take_slice(whole, rank, 2)
        got = draw_inputs(part, seed=5, step=7, scheme="logit_normal", shift=3.0, levels=3)
        rows = slice(part.first_index, part.first_index + part.count)
        assert torch.equal(got[0], sigmas[rows]) and torch.equal(got[1], noise[rows])
    assert draw_inputs(take_slice(whole, 0, 1), 5, 7, "logit_normal", 3.0)[0].shape == (3,)  # one per sample

    transformer = spec.load_transformer()
    seen = capture_transformer_inputs(transformer)
    sigmas, noise = sigmas[:2], noise[:2]
    out = spec.forward(transformer, batch, sigmas, noise)
    assert seen["enable_diffusion_forcing"] is True and "fps" not in seen  # the tiny preset: DF-14B's layout
    torch.testing.assert_close(seen["timestep"], sigmas * 1000)
    per_frame = sigmas.view(2, 1, 3, 1, 1)
    torch.testing.assert_close(seen["hidden_states"], (1 - per_frame) * latents + per_frame * noise)
    assert out.weight is None and torch.equal(out.target, noise - latents)
    spec.forward(transformer, batch, torch.tensor([0.3, 0.6]), noise)  # (B,): the synchronous schedule
    torch.testing.assert_close(seen["timestep"], torch.tensor([[300.0] * 3, [600.0] * 3]))
    with pytest.raises(ValueError, match=r"got 2 noise levels per sample for 3 latent frames"):
        spec.forward(transformer, batch, sigmas[:, :2], noise)


def test_diffusion_forcing_trains_what_the_df_pipeline_feeds(tiny_model_factory, df13b):
    """At the noise levels a diffusion-forcing pipeline call reaches, per frame (asynchronous schedule:
    ar_step 1), `forward` feeds the transformer the same arguments (timestep per frame, the DF flag, the
    fps index of DF-1.3B's sample embedding at the bucket frame rate) and so gets the same prediction."""
    folder = tiny_model_factory("skyreels-v2")
    for frame_rate, index in ((16.0, 0), (24.0, 1)):
        spec = df_spec(folder, frame_rate=frame_rate, components={"transformer": str(df13b)})
        assert spec.sample_info and spec.inference_settings()["fps"] == int(frame_rate)
        transformer = spec.load_transformer()
        pipeline = spec.build_pipeline(transformer)
        assert type(pipeline).__name__ == "SkyReelsV2DiffusionForcingPipeline"
        calls = []

        def record(module, args, kwargs, calls=calls):
            calls.append({k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()})

        handle = transformer.register_forward_pre_hook(record, with_kwargs=True)
        with torch.no_grad():
            pipeline(
                **spec.pipeline_inputs("a rabbit in a meadow", BUCKET, steps=3, seed=0),
                ar_step=1,
                guidance_scale=1.0,
                output_type="latent",
            )
        handle.remove()
        call = next(c for c in calls if len(set(c["timestep"].flatten().tolist())) == 3)  # three levels at once
        assert call["fps"] == [index] and call["enable_diffusion_forcing"] is True

        latents = call["hidden_states"].float()
        with torch.no_grad():
            expected = transformer(**{**call, "return_dict": False})[0]
            seen = capture_transformer_inputs(transformer)
            out = spec.forward(
                transformer,
                {"latents": latents, "prompt_embeds": call["encoder_hidden_states"]},
                call["timestep"].float() / 1000,
                latents,
            )  # x0 = noise: the noisy input is exact
        assert seen["fps"] == call["fps"] and seen["enable_diffusion_forcing"] is True
        torch.testing.assert_close(seen["timestep"], call["timestep"].float(), atol=1e-3, rtol=0)
        torch.testing.assert_close(seen["hidden_states"], latents)
        torch.testing.assert_close(out.prediction, expected.float(), atol=1e-4, rtol=1e-4)


def test_diffusion_forcing_i2v_keeps_the_image_frame_clean(tiny_model_factory):
    """DF image-to-video (the DF I2V pipeline on the same weights): the first latent frame is the clean
    image latent the pipeline encodes, at timestep 0 and loss weight 0; the pipeline keeps it at 0 too."""
    from diffusers import SkyReelsV2DiffusionForcingImageToVideoPipeline
    from PIL import Image

    folder = tiny_model_factory("skyreels-v2")
    spec = df_spec(folder, task="i2v")
    assert spec.pipeline_class() is SkyReelsV2DiffusionForcingImageToVideoPipeline
    assert spec.stage1_components == ("tokenizer", "text_encoder", "vae")
    assert "image_encoder" not in spec.component_names()
    clip, pixels = uint8_video(2)
    batch = stage1(spec, clip)
    assert set(batch) == {"prompt_embeds", "latents"}
    transformer = spec.load_transformer()
    pipeline = spec.build_pipeline(transformer)
    frame = pipeline.video_processor.preprocess(
        Image.fromarray(pixels[1, 0].numpy()), height=BUCKET.height, width=BUCKET.width
    )
    _, _, condition, prefix = pipeline.prepare_latents(
        frame, 1, 16, BUCKET.height, BUCKET.width, BUCKET.frames, torch.float32, "cpu", torch.Generator().manual_seed(0)
    )
    assert prefix == 1
    torch.testing.assert_close(condition, batch["latents"][1:, :, :1], atol=1e-4, rtol=1e-4)

    seen = capture_transformer_inputs(transformer)
    sigmas = torch.tensor([[0.2, 0.5, 0.9], [0.7, 0.3, 0.6]])
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(1))
    out = spec.forward(transformer, batch, sigmas, noise)
    assert (seen["timestep"][:, 0] == 0).all()
    torch.testing.assert_close(seen["timestep"][:, 1:], sigmas[:, 1:] * 1000)
    assert torch.equal(seen["hidden_states"][:, :, 0], batch["latents"][:, :, 0])
    assert out.weight.flatten().tolist() == [0.0, 1.0, 1.0]

    calls = []
    transformer.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["timestep"].clone()), with_kwargs=True)
    frames = spec.generate(pipeline, "a rabbit", BUCKET, steps=2, seed=0, image=IMAGE, guidance_scale=1.0)
    assert frames.shape == (9, 64, 96, 3) and frames.std() > 0
    assert calls and all((t[:, 0] == 0).all() and (t[:, 1:] > 0).all() for t in calls)


def test_diffusion_forcing_lora_loads_into_the_df_pipeline(tiny_model_factory, tmp_path):
    from diffusers import SkyReelsV2DiffusionForcingPipeline
    from peft.utils import get_peft_model_state_dict

    folder = tiny_model_factory("skyreels-v2")
    spec = df_spec(folder)
    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=4, alpha=8.0, targets=None)
    randomise_lora(transformer, seed=4)
    spec.save_lora(get_peft_model_state_dict(transformer), tmp_path)
    in_memory = pipeline_latents(spec, spec.build_pipeline(transformer))
    fresh = SkyReelsV2DiffusionForcingPipeline.from_pretrained(folder)
    fresh.set_progress_bar_config(disable=True)
    assert (pipeline_latents(spec, fresh) - in_memory).abs().max() > 1e-2
    spec.load_lora(fresh, tmp_path, weight_name="lora_comfyui.safetensors")
    torch.testing.assert_close(pipeline_latents(spec, fresh), in_memory, atol=1e-4, rtol=1e-4)
    long_bucket = Bucket(21, 64, 96)  # past the pipeline's base_num_frames only if it were not set
    assert spec.pipeline_inputs("a cat", long_bucket, 2, 0)["base_num_frames"] == 21


def test_what_diffusion_forcing_refuses(tiny_model_factory, df13b, tmp_path):
    from vt.shared.models.presets.skyreels_v2 import tiny_skyreels_transformer

    with pytest.raises(
        ValueError,
        match=r"diffusion_forcing = true needs a transformer that takes a noise level per "
        r"latent frame; the 'wan' transformer takes one timestep per sample",
    ):
        make_spec(tiny_model_factory("wan"), "wan", diffusion_forcing=True)
    with pytest.raises(ConfigError, match=r"model.diffusion_forcing = 1: must be true or false"):
        load_config(None, ["model.diffusion_forcing=1"])
    folder = tiny_model_factory("skyreels-v2")
    with pytest.raises(ValueError, match=r"embeds the frame rate .* set model.diffusion_forcing = true"):
        make_spec(folder, "skyreels-v2", components={"transformer": str(df13b)}).check_bucket(BUCKET)
    with pytest.raises(ValueError, match=r"diffusion_forcing = true needs a text-to-video SkyReels V2 transformer"):
        df_spec(tiny_model_factory("skyreels-v2", task="i2v"), task="i2v").check_bucket(BUCKET)

    blocks = tiny_skyreels_transformer(in_channels=16, out_channels=16, num_frame_per_block=2)
    blocks.save_pretrained(tmp_path / "blocks")
    spec = df_spec(folder, components={"transformer": str(tmp_path / "blocks")})
    spec.check_bucket(Bucket(5, 64, 96))  # 2 latent frames: one causal block
    with pytest.raises(ValueError, match=r"3 latent frames do not make whole causal blocks of 2"):
        spec.check_bucket(BUCKET)
    assert spec.noise_levels((16, 4, 8, 12)) == 2
    assert torch.equal(spec.frame_sigmas(torch.tensor([[0.1, 0.7]]), 4), torch.tensor([[0.1, 0.1, 0.7, 0.7]]))


def test_diffusion_forcing_gives_the_pinned_numbers(tiny_model_factory, pinned, request):  # noqa: F811
    """Three seeded AdamW steps of a DF LoRA with per-frame sigmas from the trainer's own keyed draws,
    pinned beside the families' numbers (tests/shared/test_reference_numbers.py's set-up and flag)."""
    from vt.train.parallel.batching import Slice, draw_inputs

    spec = build_spec(
        ModelConfig(family="skyreels-v2", path=str(tiny_model_factory("skyreels-v2")), diffusion_forcing=True), 16.0
    )

    def keyed_draw(step, batch):
        part = Slice("bucket", 0, [str(i) for i in range(BATCH)], batch, first_index=0, count=BATCH)
        sigmas, noise = draw_inputs(
            part, 0, step, "logit_normal", 1.0, levels=spec.noise_levels(batch["latents"].shape[1:])
        )
        assert sigmas.shape == (BATCH, batch["latents"].shape[2])
        return sigmas, noise

    check_pinned(pinned, request, "skyreels-v2-df-t2v", run(spec, draw=keyed_draw))


def test_the_trainer_draws_the_per_frame_sigmas(tiny_model_factory, raw_shards, tmp_path):
    """A real precompute and training step with model.diffusion_forcing: the trainer hands `forward` one
    sigma per latent frame and sample, the ones the sample's keyed generator draws."""
    from vt.precompute.service import Precompute
    from vt.train.objectives import sample_sigmas
    from vt.train.parallel.batching import sample_generator
    from vt.train.trainer import Trainer

    from helpers.cli_runs import write_config

    one_shard = sorted(raw_shards.glob("*.tar"))[0]  # 4 clips: enough for one step of 2
    config = load_config(
        write_config(
            tmp_path / "df.toml",
            tiny_model_factory("skyreels-v2"),
            one_shard,
            tmp_path / "run",
            str(tmp_path / "window"),
            model={"family": "skyreels-v2", "diffusion_forcing": True, "max_text_tokens": 16},
            buckets={"sizes": ["9x64x64"]},
            window={"size": "keep"},
            precompute={"workers": 0, "samples_per_shard": 4},
            train={"batch_size": 2, "max_steps": 1},
            flow={"shift": 3.0},
        )
    )
    Precompute(config).run()
    trainer = Trainer(config)
    drawn, forward = [], trainer.spec.forward
    trainer.spec.forward = lambda model, batch, sigmas, noise, **kw: (
        drawn.append(sigmas) or forward(model, batch, sigmas, noise, **kw)
    )
    trainer.run()
    expected = [sample_sigmas(3, "logit_normal", 3.0, sample_generator(0, 0, index)) for index in range(2)]
    assert len(drawn) == 1 and torch.equal(drawn[0], torch.stack(expected))


def test_the_parallel_plans_name_skyreels_modules(tiny_model_factory):
    """Wan's TP plan (with the image keys/values for i2v) and both CP plans name layers the SkyReels V2
    transformer has: the `wan` parity rows run the same plans on the same module names."""
    for task in ("t2v", "i2v"):
        spec = build_spec(
            ModelConfig(family="skyreels-v2", task=task, path=str(tiny_model_factory("skyreels-v2", task=task))), 8.0
        )
        transformer = spec.load_transformer()
        block = spec.blocks(transformer)[0]
        plan = spec.tp_plan()
        assert ("attn2.add_k_proj" in plan.colwise) == (task == "i2v")
        for name in (*plan.colwise, *plan.rowwise, *plan.attention, *plan.head_norms):
            block.get_submodule(name)
    folder = tiny_model_factory("skyreels-v2")
    for spec in (make_spec(folder, "skyreels-v2"), df_spec(folder)):
        plan = spec.cp_plan()
        for path in (*plan.split_inputs, plan.gather_output):
            transformer.get_submodule(path)
    assert set(plan.split_inputs) == {"blocks.0", "blocks.1"} and plan.gather_output == "blocks.1"


# ----------------------------------------------------------------------------- context parallel
def test_context_parallel_splits_the_per_frame_modulations(tiny_model_factory, tmp_path):
    """CP 2 (Ulysses) on diffusion forcing: each block's per-token modulations are cut with its tokens and
    the sequence is gathered after the last block, so loss and LoRA gradients equal one process's, for a
    frame count the cp degree does not divide."""
    from helpers import HELPERS
    from helpers.dist_runs import finish
    from helpers.forkserver import launch_ranks
    from helpers.skyreels_cp_worker import cp_case, cp_step

    folder = str(tiny_model_factory("skyreels-v2"))
    expected = cp_step(*cp_case(folder))
    log = tmp_path / "ranks.log"
    worker = str(HELPERS / "skyreels_cp_worker.py")
    group = launch_ranks(worker, 2, "2", str(tmp_path / "store"), folder, str(tmp_path), log=log)
    finish(group, log, timeout=240)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
        for name, grad in expected["grads"].items():
            assert grad.abs().max() > 0, name
            error = float((got["grads"][name] - grad).norm() / grad.norm())
            assert error < 1e-4, f"rank {rank}: {name} differs by relative {error:.1e}"
