"""Wan 2.2 beyond T2V-A14B: I2V-A14B (two experts, first-frame conditioning without an image encoder),
both experts trained in one spec, and TI2V-5B (48-channel VAE, per-token timesteps, a clean first
frame for i2v), each against what its diffusers pipeline does, on tiny real models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_cases import BUCKET, CAPTIONS, capture_transformer_inputs, make_spec, pipeline_latents, uint8_video
from lora_init import randomise_lora
from vt.shared.config import ModelConfig
from vt.shared.models import build_spec
from vt.shared.models.lora import lora_weight_name

IMAGE = np.random.default_rng(1).integers(0, 256, (BUCKET.height, BUCKET.width, 3), dtype=np.uint8)


def spec_for(folder, family, **kw):
    return build_spec(ModelConfig(family=family, path=str(folder), max_text_tokens=16, **kw), frame_rate=8.0)


def stage1(spec, clip):
    encoders = spec.load_stage1()
    return {**spec.encode_text(encoders, CAPTIONS[:len(clip)]), **spec.encode_video(encoders, clip)}



def test_i2v_a14b_conditions_on_the_frame_and_exports_one_lora_per_expert(tiny_model_factory, tmp_path):
    """I2V-A14B: stage 1 stores what WanImageToVideoPipeline makes of the first frame (no image encoder),
    the experts take [noisy, mask, condition] (36 channels) and no image tokens at any text length; a
    spec over all experts routes sigmas at the pipeline's boundary (0.9), builds the pipeline around
    both trained experts, and each expert's diffusers and ComfyUI files load back into its expert."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    folder = tiny_model_factory("wan2.2", task="i2v")
    spec = spec_for(folder, "wan2.2", task="i2v", expert="all")
    assert spec.stage1_components == ("tokenizer", "text_encoder", "vae")
    assert spec.trained_experts == {"high_noise": "transformer", "low_noise": "transformer_2"}
    assert spec.sigma_range() == (0.0, 1.0) and spec.expert is None
    owners = [spec.expert_of(s) for s in (1.0, 0.9, 0.8999, 0.0)]
    assert owners == ["high_noise", "high_noise", "low_noise", "low_noise"]

    clip, pixels = uint8_video(1)
    batch = stage1(spec, clip)
    assert set(batch) == {"prompt_embeds", "latents", "condition_latents"}
    reference = WanImageToVideoPipeline.from_pretrained(folder)
    frame = reference.video_processor.preprocess(Image.fromarray(pixels[0, 0].numpy()), height=BUCKET.height,
                                                 width=BUCKET.width)
    _, condition = reference.prepare_latents(frame, 1, 16, BUCKET.height, BUCKET.width, BUCKET.frames,
                                             torch.float32, "cpu", torch.Generator().manual_seed(0))
    torch.testing.assert_close(condition[:, 4:], batch["condition_latents"], atol=1e-5, rtol=1e-5)

    experts = torch.nn.ModuleDict({name: spec.load_transformer(name=component)
                                   for name, component in spec.trained_experts.items()})
    for seed, transformer in enumerate(experts.values()):
        spec.add_lora(transformer, rank=4, alpha=8.0, targets=None)
        randomise_lora(transformer, seed)
    assert not any("add_k_proj" in n for n, _ in experts.named_parameters())  # no image branch to adapt
    seen = capture_transformer_inputs(experts["low_noise"])
    spec.forward(experts["low_noise"], batch, torch.tensor([0.5]), torch.randn_like(batch["latents"]))
    assert seen["hidden_states"].shape == (1, 36, 3, 8, 12) and seen.get("encoder_hidden_states_image") is None
    assert torch.equal(seen["hidden_states"][:, 20:], batch["condition_latents"])

    pipeline = spec.build_pipeline(experts)
    assert pipeline.transformer is experts["high_noise"] and pipeline.transformer_2 is experts["low_noise"]
    assert pipeline.config.boundary_ratio == 0.9 and pipeline.image_encoder is None
    calls = {name: 0 for name in experts}
    for name, transformer in experts.items():
        transformer.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    in_memory = pipeline_latents(spec, pipeline, image=IMAGE)
    assert all(calls.values()), f"both experts denoise in 2 steps: {calls}"

    for expert, transformer in experts.items():
        from peft.utils import get_peft_model_state_dict

        path = spec.save_lora(get_peft_model_state_dict(transformer), tmp_path, expert=expert)
        assert path == tmp_path / lora_weight_name(expert) == tmp_path / f"pytorch_lora_weights_{expert}.safetensors"
    for names in ([lora_weight_name(e) for e in experts], [f"lora_comfyui_{e}.safetensors" for e in experts]):
        fresh = WanImageToVideoPipeline.from_pretrained(folder)
        fresh.set_progress_bar_config(disable=True)
        for expert, weight_name in zip(experts, names):
            fresh.load_lora_weights(tmp_path, weight_name=weight_name, adapter_name=expert,
                                    **spec.lora_load_kwargs(expert))
        torch.testing.assert_close(pipeline_latents(spec, fresh, image=IMAGE), in_memory, atol=1e-4, rtol=1e-4)


def test_ti2v_trains_as_the_expand_timesteps_pipelines_sample(tiny_model_factory):
    """TI2V-5B: per-token timesteps (B, tokens), frame-major; for i2v the first latent frame is the
    clean encoded image (what the pipeline's prepare_latents encodes from it) at timestep 0 with no
    loss, and validation samples with WanImageToVideoPipeline(expand_timesteps=True)."""
    from diffusers import WanImageToVideoPipeline, WanPipeline
    from PIL import Image

    folder = tiny_model_factory("wan2.2-ti2v")
    t2v, i2v = spec_for(folder, "wan2.2-ti2v"), spec_for(folder, "wan2.2-ti2v", task="i2v")
    clip, pixels = uint8_video(2)
    batch = stage1(i2v, clip)
    assert set(batch) == {"prompt_embeds", "latents"} and batch["latents"].shape == (2, 48, 3, 4, 6)
    reference = WanImageToVideoPipeline.from_pretrained(folder)
    assert reference.config.expand_timesteps
    frame = reference.video_processor.preprocess(Image.fromarray(pixels[1, 0].numpy()), height=BUCKET.height,
                                                 width=BUCKET.width)
    _, condition, mask = reference.prepare_latents(frame, 1, 48, BUCKET.height, BUCKET.width, BUCKET.frames,
                                                   torch.float32, "cpu", torch.Generator().manual_seed(0))
    assert condition.shape == (1, 48, 1, 4, 6) and (mask[:, :, 0] == 0).all() and (mask[:, :, 1:] == 1).all()
    torch.testing.assert_close(condition, batch["latents"][1:, :, :1], atol=1e-4, rtol=1e-4)

    transformer = i2v.load_transformer()
    seen = capture_transformer_inputs(transformer)
    sigmas = torch.tensor([0.3, 0.8])
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(1))
    x0 = batch["latents"]
    out = i2v.forward(transformer, batch, sigmas, noise)
    timestep = seen["timestep"].view(2, 3, 6)  # (batch, latent frame, tokens of a frame)
    assert (timestep[:, 0] == 0).all()
    torch.testing.assert_close(timestep[:, 1:], (sigmas * 1000).view(2, 1, 1).expand(2, 2, 6))
    assert torch.equal(seen["hidden_states"][:, :, 0], x0[:, :, 0])
    torch.testing.assert_close(seen["hidden_states"][:, :, 1:], (1 - sigmas.view(2, 1, 1, 1, 1)) * x0[:, :, 1:]
                               + sigmas.view(2, 1, 1, 1, 1) * noise[:, :, 1:])
    assert out.weight.flatten().tolist() == [0.0, 1.0, 1.0] and torch.equal(out.target, noise - x0)

    out = t2v.forward(transformer, batch, sigmas, noise)
    torch.testing.assert_close(seen["timestep"], (sigmas * 1000).view(2, 1).expand(2, 18))
    assert out.weight is None and torch.isfinite(out.prediction).all()

    assert t2v.pipeline_class() is WanPipeline and i2v.pipeline_class() is WanImageToVideoPipeline
    pipeline = i2v.build_pipeline(transformer)
    assert pipeline.config.expand_timesteps and pipeline.config.boundary_ratio is None
    frames = i2v.generate(pipeline, "a rabbit", BUCKET, steps=2, seed=0, image=IMAGE)
    assert frames.shape == (9, 64, 96, 3) and frames.dtype == np.uint8 and frames.std() > 0
    with pytest.raises(ValueError, match="use family \"wan2.2-ti2v\""):
        _ = spec_for(folder, "wan2.2").boundary


@pytest.mark.parametrize("expert", ["high_noise", "low_noise"])
def test_an_expert_trains_its_own_transformer_and_noise_range(tiny_model_factory, tmp_path, expert):
    """Wan 2.2 A14B: each expert is its own transformer, trained on its side of the boundary, and its
    LoRA loads into that expert of the pipeline, from the diffusers and the ComfyUI file alike."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    folder = tiny_model_factory("wan2.2")
    spec = make_spec(folder, "wan2.2", expert=expert)
    component = {"high_noise": "transformer", "low_noise": "transformer_2"}[expert]
    assert spec.trained_component == component
    assert spec.sigma_range() == ((0.875, 1.0) if expert == "high_noise" else (0.0, 0.875))
    transformer = spec.load_transformer()
    stored = load_file(next((folder / component).glob("*.safetensors")))
    name = next(iter(stored))
    torch.testing.assert_close(transformer.state_dict()[name], stored[name].float())
    spec.add_lora(transformer, rank=4, alpha=8.0, targets=None)
    with torch.no_grad():
        for param_name, param in transformer.named_parameters():
            if "lora_B" in param_name:
                param.normal_(std=0.3, generator=torch.Generator().manual_seed(1))
    pipeline = spec.build_pipeline(transformer)
    assert getattr(pipeline, component) is transformer and pipeline.config.boundary_ratio == 0.875
    in_memory = pipeline_latents(spec, pipeline)
    spec.save_lora(get_peft_model_state_dict(transformer), tmp_path)
    for weight_name in ("pytorch_lora_weights.safetensors", f"lora_comfyui_{expert}.safetensors"):
        fresh = spec.pipeline_class().from_pretrained(folder)
        fresh.set_progress_bar_config(disable=True)
        fresh.load_lora_weights(tmp_path, weight_name=weight_name, **spec.lora_load_kwargs())
        torch.testing.assert_close(pipeline_latents(spec, fresh), in_memory, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"model.expert = 'middle'.*\['high_noise', 'low_noise', 'all'\]"):
        make_spec(folder, "wan2.2", expert="middle")
    with pytest.raises(ValueError, match=r"one transformer: leave it unset"):
        make_spec(tiny_model_factory("wan"), "wan", expert="low_noise")
