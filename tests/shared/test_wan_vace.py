"""Wan 2.1 VACE on its tiny preset: the control video's conditions against WanVACEPipeline's own functions,
what `forward` feeds the transformer against what the pipeline feeds it, the control LoRA and its export,
validation under a control video, and the config keys for control videos."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vt.shared.buckets import Bucket
from vt.shared.config import ConfigError, load_config
from vt.shared.models.wan_vace import VACE_LORA_MODULES

from helpers.family_cases import BUCKET
from helpers.lora_init import randomise_lora
from helpers.spec_inputs import CAPTIONS, capture_transformer_inputs, make_spec, pipeline_latents, uint8_video


@pytest.fixture(scope="module")
def vace(tiny_model_factory):
    """(spec, its stage-1 encoders, preset folder): the text length 16, as the cross-family tests use."""
    folder = tiny_model_factory("wan-vace")
    spec = make_spec(folder, "wan-vace")
    return spec, spec.load_stage1(), folder


def pil_frames(pixels: torch.Tensor) -> list:
    """(F, H, W, 3) uint8 -> the PIL frames WanVACEPipeline takes as `video=`."""
    from PIL import Image

    return [Image.fromarray(frame) for frame in pixels.numpy()]


def test_control_latents_are_what_the_pipelines_own_functions_make(vace):
    """[inactive, reactive] latents equal prepare_video_latents of the pipeline's own preprocessing of the
    control frames without a mask (so the full mask) or reference images, and the mask forward rebuilds
    equals prepare_masks of it."""
    from diffusers import WanVACEPipeline

    spec, encoders, folder = vace
    clip, _ = uint8_video(2, seed=0)
    control, control_pixels = uint8_video(2, seed=1)
    out = spec.encode_video(encoders, clip, control=control)
    assert set(out) == {"latents", "control_latents"}
    assert out["control_latents"].shape == (2, 32, 3, 8, 12) and out["control_latents"].dtype == torch.float32
    pipeline = WanVACEPipeline.from_pretrained(folder)
    for i in range(2):
        video, mask, references = pipeline.preprocess_conditions(
            pil_frames(control_pixels[i]),
            None,
            None,
            1,
            BUCKET.height,
            BUCKET.width,
            BUCKET.frames,
            torch.float32,
            torch.device("cpu"),
        )
        assert references == [[]] and bool((mask == 1).all())
        expected = pipeline.prepare_video_latents(video, mask, references, None, torch.device("cpu"))
        torch.testing.assert_close(out["control_latents"][i : i + 1], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            spec.control_mask(out["latents"][i : i + 1]), pipeline.prepare_masks(mask, references)
        )
    # The inactive half is the zero video's, the same for both; the reactive half is each sample's control.
    assert torch.equal(out["control_latents"][0, :16], out["control_latents"][1, :16])
    assert not torch.allclose(out["control_latents"][0, 16:], out["control_latents"][1, 16:], atol=1e-2)
    with pytest.raises(ValueError, match=r"control video: call encode_video\(encoders, video, control=\.\.\.\)"):
        spec.encode_video(encoders, clip)


def test_forward_feeds_the_transformer_what_the_pipeline_feeds_it(vace):
    """The pipeline's first denoising call under a control video and the trainer's forward on stage 1's
    tensors of the same frames give the transformer the same control tokens and scale, and Wan's text."""
    spec, encoders, _ = vace
    transformer = spec.load_transformer()
    pipeline = spec.build_pipeline(transformer)
    seen = capture_transformer_inputs(transformer)
    clip, _ = uint8_video(1, seed=0)
    control, control_pixels = uint8_video(1, seed=1)
    spec.generate(
        pipeline,
        CAPTIONS[0],
        BUCKET,
        steps=1,
        seed=0,
        control=control_pixels[0].numpy(),
        decode=False,
        guidance_scale=1.0,
    )
    piped = dict(seen)
    seen.clear()
    batch = {**spec.encode_text(encoders, CAPTIONS[:1]), **spec.encode_video(encoders, clip, control=control)}
    spec.forward(transformer, batch, torch.tensor([0.7]), torch.randn_like(batch["latents"]))
    assert seen["control_hidden_states"].shape == (1, 96, 3, 8, 12)
    torch.testing.assert_close(seen["control_hidden_states"], piped["control_hidden_states"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(seen["control_hidden_states_scale"], piped["control_hidden_states_scale"])
    assert seen["control_hidden_states_scale"].tolist() == [1.0, 1.0]  # conditioning_scale per VACE layer
    torch.testing.assert_close(seen["encoder_hidden_states"], piped["encoder_hidden_states"])
    assert seen["hidden_states"].shape == piped["hidden_states"].shape == (1, 16, 3, 8, 12)
    with pytest.raises(KeyError, match="control_latents"):
        spec.forward(
            transformer,
            {k: v for k, v in batch.items() if k != "control_latents"},
            torch.tensor([0.7]),
            torch.randn_like(batch["latents"]),
        )


def test_default_lora_is_a_control_lora_and_both_kinds_export_to_the_pipeline(vace, tmp_path):
    """Default targets: the VACE blocks' attention and FFN only (the main blocks stay as they are, and get
    no gradient); with the main blocks added, the exported file loads into a fresh WanVACEPipeline that
    renders what the in-memory model renders under the same control video."""
    from diffusers import WanVACEPipeline
    from peft.utils import get_peft_model_state_dict

    spec, encoders, folder = vace
    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=4, alpha=4.0, targets=None)
    adapted = {n.split(".lora_")[0] for n, _ in transformer.named_parameters() if ".lora_" in n}
    assert adapted == {f"vace_blocks.{b}.{m}" for b in (0, 1) for m in VACE_LORA_MODULES}

    both = spec.load_transformer()
    spec.add_lora(
        both,
        rank=4,
        alpha=8.0,
        targets=r"(vace_blocks|blocks)\.\d+\.(attn1|attn2)\.(to_q|to_v)|"
        r"vace_blocks\.0\.proj_in",
    )
    randomise_lora(both, seed=3)
    names = {n.split(".lora_")[0] for n, _ in both.named_parameters() if ".lora_" in n}
    assert {"blocks.0.attn1.to_q", "vace_blocks.1.attn2.to_v", "vace_blocks.0.proj_in"} <= names
    spec.save_lora(get_peft_model_state_dict(both), tmp_path / "lora")
    in_memory = pipeline_latents(spec, spec.build_pipeline(both))
    fresh = WanVACEPipeline.from_pretrained(folder)
    fresh.set_progress_bar_config(disable=True)
    base = pipeline_latents(spec, fresh)
    spec.load_lora(fresh, tmp_path / "lora")
    assert (base - in_memory).abs().max() > 1e-2
    torch.testing.assert_close(pipeline_latents(spec, fresh), in_memory, atol=1e-4, rtol=1e-4)


def test_validation_renders_under_the_prompts_control_video(vace, tmp_path):
    """The control video changes what the pipeline renders; a video file is fitted to the bucket as stage 1
    fits a clip (frames from the start at buckets.fps, covered and center-cropped), and generation without
    one says which key to set."""
    from vt.shared.video_io import read_fitted, write_video

    spec, _, _ = vace
    pipeline = spec.build_pipeline(spec.load_transformer())
    small = Bucket(5, 32, 48)
    pixels = torch.randint(0, 256, (2, 5, 32, 48, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    renders = [
        spec.generate(pipeline, CAPTIONS[0], small, steps=2, seed=0, control=pixels[i].numpy(), guidance_scale=1.0)
        for i in range(2)
    ]
    assert renders[0].shape == (5, 32, 48, 3)
    assert np.abs(renders[0].astype(int) - renders[1].astype(int)).max() > 0
    with pytest.raises(ValueError, match="needs a control video.*validation.videos"):
        spec.generate(pipeline, CAPTIONS[0], small, steps=2, seed=0)
    with pytest.raises(ValueError, match=r"must be \(5, 32, 48, 3\) uint8"):
        spec.generate(pipeline, CAPTIONS[0], small, steps=2, seed=0, control=pixels[0, :4].numpy())

    # 17 frames at 16 fps, 128 x 128, frame i a solid level 8 i with a white bar at columns 60..67: at 8 fps
    # the frames shown are 0, 2, ..., 16 (the last from its start to the clip's end), scaled to cover 96
    # wide (96 x 96) and cropped to the middle 64 rows.
    frames = np.zeros((17, 128, 128, 3), dtype=np.uint8)
    for index, frame in enumerate(frames):
        frame[:] = 8 * index
        frame[:, 60:68] = 255
    path = write_video(frames, tmp_path / "control.mp4", fps=16.0)
    fitted = read_fitted(path, BUCKET, 8.0)
    assert fitted.shape == (9, 64, 96, 3) and fitted.dtype == np.uint8
    levels = fitted[:, :, :30].reshape(9, -1).mean(axis=1)
    np.testing.assert_allclose(levels, 16 * np.arange(9), atol=3)  # frame 2k at time k / 8
    assert fitted[:, :, 46:50].mean() > 200 and fitted[:, :, 40].mean() < 150  # the bar, at 60..67 x 0.75
    with pytest.raises(ValueError, match="holds 5 frames at 4 fps; bucket 9x64x96 needs 9"):
        read_fitted(path, BUCKET, 4.0)


def test_control_video_config_keys_are_checked_at_load(tmp_path):
    """validation.videos: one per prompt for a family that trains on a control video, refused for one
    that does not; data.control is a member name; the member goes into the shards' provenance."""
    from vt.shared.models import build_spec
    from vt.shared.provenance import fingerprint, provenance

    vace = ['model.family="wan-vace"', 'validation.prompts=["a dancer", "a skater"]']
    with pytest.raises(ConfigError, match="validation.videos has 1 entries for 2 validation.prompts"):
        load_config(None, [*vace, 'validation.videos=["pose.mp4"]'])
    config = load_config(None, [*vace, 'validation.videos=["pose.mp4", "pose.mp4"]'])
    assert config.validation.videos == ["pose.mp4", "pose.mp4"] and config.data.control == "control"
    with pytest.raises(ConfigError, match=r"model.family = 'wan' trains on no control video.*remove it"):
        load_config(None, ['model.family="wan"', 'validation.videos=["pose.mp4"]'])
    with pytest.raises(ConfigError, match=r"data.control = 'pose.mp4': must be a member name"):
        load_config(None, ['data.control="pose.mp4"'])

    def print_of(family: str, member: str) -> str:
        config = load_config(None, [f'model.family="{family}"', f'data.control="{member}"', f'model.path="{tmp_path}"'])
        return fingerprint(provenance(config, weights={}, spec=build_spec(config.model, config.buckets.fps)))

    assert print_of("wan-vace", "control") != print_of("wan-vace", "pose")  # another member: other shards
    assert print_of("wan", "control") == print_of("wan", "pose")  # a family without control videos ignores it
