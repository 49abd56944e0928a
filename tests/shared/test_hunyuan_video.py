"""HunyuanVideo: transformer inputs that match HunyuanVideoPipeline's (text, mask, pooled CLIP, guidance,
timestep), LoRA kept out of the text token refiner, and the fused ComfyUI export read back by diffusers'
own conversion at the real model's hidden size (tiny real models; the conversion on bare tensors)."""

from __future__ import annotations

import pytest
import torch

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig
from vt.shared.models import build_spec
from vt.shared.models.comfy import comfy_state_dict

BUCKET = Bucket(5, 32, 48)
PROMPT = "a big rabbit walks in the meadow"


def make_spec(folder, **kw):
    return build_spec(ModelConfig(family="hunyuan-video", path=str(folder), max_text_tokens=16, **kw), frame_rate=8.0)


def capture(transformer):
    seen = []
    transformer.register_forward_pre_hook(lambda module, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    return seen


def test_transformer_inputs_match_the_pipeline(tiny_model_factory):
    spec = make_spec(tiny_model_factory("hunyuan-video"))
    assert spec.prompt_template == {"template": "{}", "crop_start": 0}  # the tiny tokenizer has no chat headers
    assert spec.pipeline_inputs(PROMPT, BUCKET, 1, 0)["prompt_template"] == spec.prompt_template
    assert spec.guidance == 1.0  # trained at guidance 1 (as the peers train it); sampled at any
    assert spec.pipeline_default("guidance_scale") == 6.0
    transformer = spec.load_transformer()
    pipeline = spec.build_pipeline(transformer)
    seen = capture(transformer)
    pipeline(**spec.pipeline_inputs(PROMPT, BUCKET, steps=1, seed=0), guidance_scale=spec.guidance,
             output_type="latent")
    inference = seen.pop()

    encoders = spec.load_stage1()
    batch = {**spec.encode_text(encoders, [PROMPT]), "latents": torch.zeros(1, *spec.latent_shape(BUCKET))}
    sigma = inference["timestep"] / 1000
    spec.forward(transformer, batch, sigma, torch.randn_like(batch["latents"]))
    training = seen.pop()
    for name in ("encoder_hidden_states", "encoder_attention_mask", "pooled_projections", "guidance"):
        torch.testing.assert_close(training[name], inference[name], msg=name)
    torch.testing.assert_close(training["timestep"], inference["timestep"])
    assert training["guidance"].tolist() == [1000.0]
    assert training["encoder_attention_mask"][0, :7].all() and not training["encoder_attention_mask"][0, -1]


@pytest.mark.parametrize("targets", [None, ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj"]])
def test_lora_never_targets_the_token_refiner(tiny_model_factory, targets):
    spec = make_spec(tiny_model_factory("hunyuan-video"))
    transformer = spec.load_transformer()
    assert any("token_refiner" in n and n.endswith("attn.to_q") for n, _ in transformer.named_modules())
    spec.add_lora(transformer, rank=4, alpha=4.0, targets=targets)
    lora = [n for n, _ in transformer.named_parameters() if "lora_A" in n]
    assert lora and not any("token_refiner" in n for n in lora)
    assert {"transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_v"} <= \
        {n.split(".lora_A")[0] for n in lora}
    with pytest.raises(ValueError, match="matched no layer .* outside the text token refiner"):
        spec.add_lora(spec.load_transformer(), rank=4, alpha=4.0, targets=[r"refiner_blocks.0.attn.to_q"])


def test_comfy_file_reads_back_through_diffusers_at_the_real_hidden_size(tiny_model_factory):
    """diffusers splits single_blocks.N.linear1 at hidden size 3072, so the single-block fusion is checked
    at that size on bare tensors: every module's B A (times alpha / r) comes back, proj_mlp's as zero."""
    from diffusers.loaders.lora_conversion_utils import _convert_hunyuan_video_lora_to_diffusers

    spec = make_spec(tiny_model_factory("hunyuan-video"))
    hidden, mlp, rank, alpha = 3072, 4 * 3072, 2, 8.0
    gen = torch.Generator().manual_seed(0)
    modules = {f"transformer_blocks.0.attn.{p}": hidden for p in ("to_q", "to_k", "to_v", "to_out.0", "add_k_proj")}
    modules.update({f"single_transformer_blocks.0.attn.{p}": hidden for p in ("to_q", "to_k", "to_v")})
    modules["single_transformer_blocks.0.proj_out"] = hidden
    lora = {}
    for module, out in modules.items():
        lora[f"{module}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen)
        lora[f"{module}.lora_B.weight"] = torch.randn(out, rank, generator=gen)
    sizes = {"transformer_blocks.0.attn.add_q_proj": hidden, "transformer_blocks.0.attn.add_v_proj": hidden,
             "single_transformer_blocks.0.proj_mlp": mlp}
    state = comfy_state_dict(lora, spec.original_names, rank, alpha, write_alpha=False,
                             fused=spec.comfy_fused, out_features=sizes.__getitem__)
    assert state["diffusion_model.double_blocks.0.img_attn_qkv.lora_A.weight"].shape == (3 * rank, hidden)
    assert state["diffusion_model.double_blocks.0.txt_attn_qkv.lora_B.weight"].shape == (3 * hidden, rank)
    assert state["diffusion_model.single_blocks.0.linear1.lora_B.weight"].shape == (3 * hidden + mlp, 3 * rank)
    assert "diffusion_model.single_blocks.0.linear2.lora_A.weight" in state
    assert not any(key.endswith(".alpha") for key in state)

    back = _convert_hunyuan_video_lora_to_diffusers(dict(state))
    scale = alpha / rank
    for module in modules:
        expected = scale * lora[f"{module}.lora_B.weight"] @ lora[f"{module}.lora_A.weight"]
        got = back[f"transformer.{module}.lora_B.weight"] @ back[f"transformer.{module}.lora_A.weight"]
        torch.testing.assert_close(got, expected, msg=module)
    for module in ("single_transformer_blocks.0.proj_mlp", "transformer_blocks.0.attn.add_q_proj"):
        assert not back[f"transformer.{module}.lora_B.weight"].any()
