"""Mochi's ComfyUI LoRA file, checked against diffusers' own reader of original Mochi checkpoints.

diffusers loads no non-diffusers Mochi LoRA, so the check goes through the weights instead: the
ComfyUI file is applied the way ComfyUI applies a LoRA (W += B A under each `diffusion_model.`
name, scale 1 without `.alpha`) to the transformer's weights under their original (genmo) names,
and diffusers' single-file converter (`convert_mochi_transformer_checkpoint_to_diffusers`, what
`MochiTransformer3DModel.from_single_file` runs) turns the result back into diffusers weights, which
must equal the in-memory LoRA model's with each LoRA merged (W + alpha / r B A): same weights, same
outputs. That converter is written for the real 48
blocks (it fuses q/k/v and swaps the SwiGLU halves on the way), hence a 48-block model of the tiny
preset's widths.
"""

from __future__ import annotations

import re

import pytest
import torch

from vt.shared.buckets import Bucket
from vt.shared.models.mochi import swap_halves

from helpers.lora_init import randomise_lora
from helpers.spec_inputs import make_spec

REAL_LAYERS = 48  # what diffusers' converter iterates over
# Every linear the ComfyUI table names, in the first block and the last (which has no text output
# projection or text MLP); add_v_proj is left out so its fused qkv_y rows must be zero.
LINEARS = [
    "attn1.to_q",
    "attn1.to_k",
    "attn1.to_v",
    "attn1.add_q_proj",
    "attn1.add_k_proj",
    "attn1.to_out.0",
    "attn1.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
]
TARGETS = [f"transformer_blocks.{block}.{linear}" for block in (0, REAL_LAYERS - 1) for linear in LINEARS]
RENAMES = (  # diffusers -> original, one tensor to one tensor
    (r"patch_embed\.proj\.(.*)", r"x_embedder.proj.\1"),
    (r"time_embed\.timestep_embedder\.linear_1\.(.*)", r"t_embedder.mlp.0.\1"),
    (r"time_embed\.timestep_embedder\.linear_2\.(.*)", r"t_embedder.mlp.2.\1"),
    (r"time_embed\.pooler\.(.*)", r"t5_y_embedder.\1"),
    (r"time_embed\.caption_proj\.(.*)", r"t5_yproj.\1"),
    (r"transformer_blocks\.(\d+)\.norm1\.linear\.(.*)", r"blocks.\1.mod_x.\2"),
    (r"transformer_blocks\.(\d+)\.norm1_context\.linear(_1)?\.(.*)", r"blocks.\1.mod_y.\3"),
    (r"transformer_blocks\.(\d+)\.attn1\.norm_(q|k)\.weight", r"blocks.\1.attn.\2_norm_x.weight"),
    (r"transformer_blocks\.(\d+)\.attn1\.norm_added_(q|k)\.weight", r"blocks.\1.attn.\2_norm_y.weight"),
    (r"transformer_blocks\.(\d+)\.attn1\.to_out\.0\.(.*)", r"blocks.\1.attn.proj_x.\2"),
    (r"transformer_blocks\.(\d+)\.attn1\.to_add_out\.(.*)", r"blocks.\1.attn.proj_y.\2"),
    (r"transformer_blocks\.(\d+)\.ff\.net\.2\.weight", r"blocks.\1.mlp_x.w2.weight"),
    (r"transformer_blocks\.(\d+)\.ff_context\.net\.2\.weight", r"blocks.\1.mlp_y.w2.weight"),
    (r"proj_out\.(.*)", r"final_layer.linear.\1"),
    (r"(pos_frequencies)", r"\1"),
)


def to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers Mochi state dict under genmo's names: the inverse of diffusers' converter."""
    out = {}
    for i in range(REAL_LAYERS):
        block = f"transformer_blocks.{i}."
        out[f"blocks.{i}.attn.qkv_x.weight"] = torch.cat([state[block + f"attn1.to_{p}.weight"] for p in "qkv"])
        out[f"blocks.{i}.attn.qkv_y.weight"] = torch.cat([state[block + f"attn1.add_{p}_proj.weight"] for p in "qkv"])
        out[f"blocks.{i}.mlp_x.w1.weight"] = swap_halves(state[block + "ff.net.0.proj.weight"])
        if block + "ff_context.net.0.proj.weight" in state:  # the last block has no text MLP
            out[f"blocks.{i}.mlp_y.w1.weight"] = swap_halves(state[block + "ff_context.net.0.proj.weight"])
    for name in ("weight", "bias"):  # diffusers' AdaLayerNormContinuous is (scale, shift), genmo's (shift, scale)
        out[f"final_layer.mod.{name}"] = swap_halves(state[f"norm_out.linear.{name}"])
    for key, tensor in state.items():
        for pattern, replacement in RENAMES:
            if re.fullmatch(pattern, key):
                out[re.sub(f"^{pattern}$", replacement, key)] = tensor
    return out


def test_comfy_lora_applied_to_original_weights_reproduces_the_lora_model(tiny_model_factory, tmp_path):
    from diffusers import MochiTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_mochi_transformer_checkpoint_to_diffusers
    from peft.tuners.lora import LoraLayer
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    spec = make_spec(tiny_model_factory("mochi"), "mochi")
    config = {**spec.load_config("transformer"), "num_layers": REAL_LAYERS}
    torch.manual_seed(0)
    transformer = MochiTransformer3DModel.from_config(config)
    with torch.no_grad():
        transformer.pos_frequencies.normal_(std=0.5)
    base = {k: v.clone() for k, v in transformer.state_dict().items()}
    original = to_original(base)  # the inverse is checked by diffusers' own converter
    back = convert_mochi_transformer_checkpoint_to_diffusers(dict(original))
    assert back.keys() == base.keys() and all(torch.equal(back[k], v) for k, v in base.items())

    spec.add_lora(transformer, rank=2, alpha=3.0, targets=TARGETS)  # alpha != rank: the scale is baked in
    randomise_lora(transformer, seed=1)
    spec.save_lora(get_peft_model_state_dict(transformer), tmp_path)
    comfy = load_file(tmp_path / "lora_comfyui.safetensors")
    assert not any(key.endswith(".alpha") for key in comfy)
    qkv_y = comfy["diffusion_model.blocks.0.attn.qkv_y.lora_B.weight"]  # q, k trained; v rows zero
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    assert qkv_y.shape == (3 * inner, 4) and qkv_y[2 * inner :].abs().sum() == 0 and qkv_y[:inner].abs().sum() > 0

    merged = dict(original)
    for key in (k for k in comfy if k.endswith(".lora_A.weight")):  # ComfyUI: W += B A (no alpha: scale 1)
        module = key.removeprefix("diffusion_model.").removesuffix(".lora_A.weight")
        assert module + ".weight" in original, f"{module} is not an original Mochi module"
        merged[module + ".weight"] = original[module + ".weight"] + comfy[key.replace("lora_A", "lora_B")] @ comfy[key]
    assert len([k for k in comfy if k.endswith(".lora_A.weight")]) == 8 + 5  # last block: no proj_y, mlp_y
    for module in transformer.modules():  # the in-memory model with each LoRA merged: W + alpha / r B A
        if isinstance(module, LoraLayer):
            module.merge()
    expected = {k.replace(".base_layer", ""): v for k, v in transformer.state_dict().items() if "lora_" not in k}
    got = convert_mochi_transformer_checkpoint_to_diffusers(merged)
    assert got.keys() == expected.keys()
    changed = [k for k in expected if not torch.equal(expected[k], base[k])]
    assert len(changed) == 11 + 8  # every targeted linear of both blocks
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=1e-6, rtol=1e-5, msg=key)


def test_validation_refuses_fewer_steps_than_mochis_schedule_takes(tiny_model_factory):
    """MochiPipeline's linear-quadratic sigma schedule divides by zero at 1 step: refused by name."""
    spec = make_spec(tiny_model_factory("mochi"), "mochi")
    assert spec.pipeline_inputs("a cat", Bucket(7, 64, 96), 2, 0)["num_inference_steps"] == 2
    with pytest.raises(ValueError, match=r"at least 2 steps, got 1; set validation.steps >= 2"):
        spec.pipeline_inputs("a cat", Bucket(7, 64, 96), 1, 0)
