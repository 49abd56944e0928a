"""Wan 2.2 A14B (family wan2.2): I2V-A14B (two experts, first-frame conditioning without an image encoder),
both experts trained in one spec, each expert on its own noise range, against what its diffusers pipeline
does, on tiny real models. TI2V-5B: test_wan22_ti2v.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vt.shared.models.lora import lora_weight_name

from helpers.family_cases import BUCKET
from helpers.lora_init import randomise_lora
from helpers.spec_inputs import capture_transformer_inputs, encode_clip, make_spec, pipeline_latents, uint8_video

IMAGE = np.random.default_rng(1).integers(0, 256, (BUCKET.height, BUCKET.width, 3), dtype=np.uint8)


def test_i2v_a14b_conditions_on_the_frame_and_exports_one_lora_per_expert(tiny_model_factory, tmp_path):
    """I2V-A14B: stage 1 stores what WanImageToVideoPipeline makes of the first frame (no image encoder),
    the experts take [noisy, mask, condition] (36 channels) and no image tokens at any text length; a
    spec over all experts routes sigmas at the pipeline's boundary (0.9), builds the pipeline around
    both trained experts, and each expert's diffusers and ComfyUI files load back into its expert."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    folder = tiny_model_factory("wan2.2", task="i2v")
    spec = make_spec(folder, "wan2.2", task="i2v", expert="all")
    assert spec.stage1_components == ("tokenizer", "text_encoder", "vae")
    assert spec.trained_experts == {"high_noise": "transformer", "low_noise": "transformer_2"}
    assert spec.sigma_range() == (0.0, 1.0) and spec.expert is None
    owners = [spec.expert_of(s) for s in (1.0, 0.9, 0.8999, 0.0)]
    assert owners == ["high_noise", "high_noise", "low_noise", "low_noise"]

    clip, pixels = uint8_video(1)
    batch = encode_clip(spec, clip)
    assert set(batch) == {"prompt_embeds", "latents", "condition_latents"}
    reference = WanImageToVideoPipeline.from_pretrained(folder)
    frame = reference.video_processor.preprocess(
        Image.fromarray(pixels[0, 0].numpy()), height=BUCKET.height, width=BUCKET.width
    )
    _, condition = reference.prepare_latents(
        frame, 1, 16, BUCKET.height, BUCKET.width, BUCKET.frames, torch.float32, "cpu", torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(condition[:, 4:], batch["condition_latents"], atol=1e-5, rtol=1e-5)

    experts = torch.nn.ModuleDict(
        {name: spec.load_transformer(name=component) for name, component in spec.trained_experts.items()}
    )
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
            fresh.load_lora_weights(
                tmp_path, weight_name=weight_name, adapter_name=expert, **spec.lora_load_kwargs(expert)
            )
        torch.testing.assert_close(pipeline_latents(spec, fresh, image=IMAGE), in_memory, atol=1e-4, rtol=1e-4)


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
