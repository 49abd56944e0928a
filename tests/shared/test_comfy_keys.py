"""vt's ComfyUI LoRA file against ComfyUI's own loading (tests/helpers/comfy_reference.py, re-implemented from
comfyanonymous/ComfyUI@3cd7b32f; MiniMax H3 from Comfy-Org/ComfyUI, ref.MINIMAX_H3): on each family's tiny preset,
every key of lora_comfyui.safetensors is one ComfyUI's key map takes (none "lora key not loaded"), each LoRA makes a
weight of the size of the ComfyUI model's module, a fused module's LoRA stacks the parts in the order ComfyUI's
forward splits its output (H3's SwiGLU halves in ComfyUI's order), and the whole LoRA reaches the model (the same
total change as vt's in-memory adapters, with ComfyUI's alpha / rank scale). Default targets and attention + FFN of
every block; plus vt's own HunyuanVideo 1.5 loader reading back both the fused file and the separate q/k/v one vt
wrote before."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from vt.shared.config import ModelConfig
from vt.shared.models import build_spec

from helpers import comfy_reference as ref
from helpers.family_cases import ATTN_MODULES, EXPECTED
from helpers.lora_init import randomise_lora

# (family, task) -> the ComfyUI model class (comfy/model_base.py) its checkpoints load as:
# comfy/supported_models.py WAN21_T2V / WAN21_I2V (Wan 2.1, Wan 2.2 A14B) build model_base.WAN21,
# WAN22_T2V (48 latent channels: TI2V-5B) model_base.WAN22, HunyuanVideo15 model_base.HunyuanVideo15 (t2v and
# i2v: one class, `vision_in_dim` 1152). HunyuanVideo I2V: the tiny preset is the 16-channel token_replace model,
# which ComfyUI detects as HunyuanVideo (supported_models.py HunyuanVideoI2V takes in_channels 33 only); the
# 33-channel latent_concat model loads as model_base.HunyuanVideoI2V, a HunyuanVideo subclass (line 1068)
# whose LoRA keys come from the same `isinstance(model, HunyuanVideo)` branch.
CASES = {
    (family, task): cls for family, case in EXPECTED.items() for task, cls in case.get("comfy_classes", {}).items()
}
# Attention and FFN of every block (regular expressions, matched whole): more of each key table.
WIDE = {family: case["wide_lora"] for family, case in EXPECTED.items() if "wide_lora" in case}
_ATTN = ATTN_MODULES


def lora_deltas(transformer) -> dict[str, torch.Tensor]:
    """module -> the weight change of its active LoRA (peft's own get_delta_weight)."""
    from peft.tuners.lora import LoraLayer

    return {
        name: module.get_delta_weight(module.active_adapters[0]).float()
        for name, module in transformer.named_modules()
        if isinstance(module, LoraLayer)
    }


@pytest.fixture(scope="module")
def spec_of(tiny_model_factory):
    specs = {}

    def get(family: str, task: str):
        if (family, task) not in specs:
            folder = tiny_model_factory(family, task=task)
            specs[family, task] = build_spec(ModelConfig(family=family, path=str(folder), task=task), frame_rate=8.0)
        return specs[family, task]

    return get


@pytest.mark.parametrize("targets", ["default", "wide"])
@pytest.mark.parametrize("case", list(CASES), ids=lambda case: "-".join(case))
def test_comfyui_loads_every_key_at_its_size(spec_of, tmp_path, case, targets):
    family, task = case
    check_comfy_file(spec_of(family, task), CASES[case], None if targets == "default" else WIDE[family], tmp_path)


# LTX-2 with model.audio: the audio stream's attention and FFN and both audio-video cross-attention directions
# (LTXAVModel's BasicAVTransformerBlock: audio_attn1/2, audio_to_video_attn, video_to_audio_attn, audio_ff).
_LTX_AV = (
    rf"transformer_blocks\.\d+\.((attn1|attn2|audio_attn1|audio_attn2|audio_to_video_attn|video_to_audio_attn)"
    rf"\.{_ATTN}|(ff|audio_ff)\.net\.(0\.proj|2))"
)


@pytest.mark.parametrize("targets", ["default", "wide"])
def test_comfyui_loads_ltx2_audio_modules(tiny_model_factory, tmp_path, targets):
    """model.audio: LoRAs on LTX-2's audio stream and audio-video cross-attention load into LTXAV at their sizes."""
    spec = build_spec(ModelConfig(family="ltx-2", path=str(tiny_model_factory("ltx-2")), audio=True), frame_rate=8.0)
    modules = check_comfy_file(spec, "LTXAV", None if targets == "default" else _LTX_AV, tmp_path)
    assert {
        "transformer_blocks.0.audio_to_video_attn.to_q",
        "transformer_blocks.1.video_to_audio_attn.to_out.0",
        "transformer_blocks.0.audio_attn2.to_k",
    } <= modules
    assert targets == "default" or "transformer_blocks.1.audio_ff.net.0.proj" in modules


# Kandinsky 6 with model.audio: both streams' text and fused blocks, the cross-stream attentions and the modulations.
_K6_AV = (
    r"(video|audio)_text_transformer_blocks\.\d+\.(attn\.(to_query|to_key|to_value|out_layer)|feed_forward\."
    r"net\.(0\.proj|2)|text_modulation\.out_layer)|visual_transformer_blocks\.\d+\.((video|audio)_dec_block\."
    r"((self|cross)_attention\.(to_query|to_key|to_value|out_layer)|feed_forward\.net\.(0\.proj|2)"
    r"|visual_modulation\.out_layer)|(va|av)_cross_attention\.(to_query|to_key|to_value|out_layer)"
    r"|(va|av)_modulation\.out_layer)"
)


@pytest.mark.parametrize("targets", ["default", "every"])
def test_comfyui_loads_kandinsky6_audio_modules(tiny_model_factory, tmp_path, targets):
    """model.audio: LoRAs on both of Kandinsky 6's streams and the cross-stream attentions (every: also FFNs and
    modulations) load into ComfyUI's Kandinsky6 model at their sizes, under its `videoT` / `audioT` names."""
    spec = build_spec(
        ModelConfig(family="kandinsky6", path=str(tiny_model_factory("kandinsky6")), audio=True), frame_rate=8.0
    )
    modules = check_comfy_file(spec, "Kandinsky6", None if targets == "default" else _K6_AV, tmp_path)
    assert {
        "visual_blocks.0.audioT.self_attention.to_query",
        "visual_blocks.1.va_cross_attention.to_key",
        "visual_blocks.0.av_cross_attention.out_layer",
        "audio_text_transformer_blocks.0.self_attention.to_value",
        "video_text_transformer_blocks.0.self_attention.out_layer",
    } <= modules
    if targets == "every":
        assert {
            "visual_blocks.1.va_modulation.out_layer",
            "visual_blocks.0.audioT.feed_forward.in_layer",
            "audio_text_transformer_blocks.0.text_modulation.out_layer",
        } <= modules


# MiniMax H3 with model.audio: every module vt's key table names, the audio stream's own heads included (they train
# only with model.audio): attention, FFN and AdaLN of the blocks and the refiner, the patch, text, time and output
# projections.
_H3_EVERY = (
    r"(transformer_blocks|token_refiner\.refiner_blocks)\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0)"
    r"|ff\.net\.(0\.proj|2)|adaln_proj\.linear)|proj_in|audio_proj_in|context_embedder|proj_out"
    r"|audio_proj_out|norm_out\.linear|time_embedder\.linear_(1|2)"
)


@pytest.mark.parametrize("targets", ["default", "wide", "every"])
def test_comfyui_loads_minimax_h3_audio_modules(tiny_model_factory, tmp_path, targets):
    """model.audio: H3's file, with LoRAs on attention, FFN and (every) the audio heads, loads into ComfyUI's
    MiniMaxH3Model at its sizes: q/k/v fused into qkv_proj, fc1's SwiGLU halves in ComfyUI's order."""
    spec = build_spec(
        ModelConfig(family="minimax-h3", path=str(tiny_model_factory("minimax-h3")), audio=True), frame_rate=24.0
    )
    pattern = {"default": None, "wide": WIDE["minimax-h3"], "every": _H3_EVERY}[targets]
    modules = check_comfy_file(spec, "MiniMaxH3", pattern, tmp_path)
    assert {"blocks.0.attn.qkv_proj", "token_refiner.blocks.0.attn.qkv_proj", "blocks.1.attn.out_proj"} <= modules
    if targets != "default":
        assert {"blocks.1.mlp.fc1", "token_refiner.blocks.0.mlp.fc2"} <= modules
    if targets == "every":
        assert {
            "final_layer.audio_out",
            "audio_patch_proj",
            "time_embedder.proj_in",
            "blocks.0.adaln_proj.linear",
            "final_layer.adaln_proj.linear",
            "condition_proj",
        } <= modules


def check_comfy_file(spec, model_class: str, targets, tmp_path) -> set[str]:
    """Every key of the ComfyUI file vt writes for a random LoRA on `targets` is loaded by ComfyUI's key map for
    `model_class` at its module's size, fused modules stack their parts, and the total change is vt's; returns
    the ComfyUI modules the file patches."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    family = spec.family
    transformer = spec.load_transformer()
    sizes = {n: tuple(m.weight.shape) for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    spec.add_lora(transformer, rank=2, alpha=3.0, targets=targets)
    randomise_lora(transformer, seed=5)
    spec.save_lora(get_peft_model_state_dict(transformer), tmp_path)
    files = sorted(tmp_path.glob("lora_comfyui*.safetensors"))
    assert len(files) == 1, f"{family}: no ComfyUI file written"
    lora = load_file(files[0])

    weights = EXPECTED[family]["comfy_weights"](transformer)
    patches, not_loaded = ref.load_lora(lora, ref.model_lora_keys_unet(weights, model_class))
    assert not not_loaded, f"ComfyUI ({model_class}) logs 'lora key not loaded' for {not_loaded[:6]}"
    comfy = {key[len("diffusion_model.") : -len(".weight")]: patch for key, patch in patches.items()}
    deltas = {module: ref.weight_delta(patch, weights[module]) for module, patch in comfy.items()}

    ours = lora_deltas(transformer)
    assert len(ours) > (4 if targets is not None else 1)
    for pattern, parts in EXPECTED[family].get("comfy_stacked", {}).items():
        for module, delta in deltas.items():
            if hit := re.fullmatch(pattern, module):
                names = [part.format(hit[1]) for part in parts]
                expected = torch.cat([ours.get(n, torch.zeros(sizes[n])) for n in names])
                torch.testing.assert_close(delta, expected, msg=f"{module} = {names} stacked")
    for pattern, part in EXPECTED[family].get("comfy_swapped", {}).items():
        for module, delta in deltas.items():
            if hit := re.fullmatch(pattern, module):
                first, second = ours[part.format(hit[1])].chunk(2)
                torch.testing.assert_close(delta, torch.cat([second, first]), msg=f"{module} = {part}, halves swapped")
    # Nothing lost or doubled, at ComfyUI's scale (alpha / rank, or 1 without .alpha): fused parts stack
    # and SwiGLU halves swap, neither of which changes the total.
    total = sum(d.square().sum() for d in deltas.values())
    torch.testing.assert_close(total, sum(d.square().sum() for d in ours.values()), rtol=1e-5, atol=0)
    return set(comfy)


@pytest.mark.parametrize("family", [family for family, case in EXPECTED.items() if case["comfy_key"] is None])
def test_a_family_without_a_comfy_model_writes_no_comfy_file(spec_of, tmp_path, family):
    """A family ComfyUI has no model for (its tester entry's comfy_key is None: CogVideoX, whose
    ComfyUI-CogVideoXWrapper reads the diffusers file) gets no ComfyUI file."""
    from peft.utils import get_peft_model_state_dict

    spec = spec_of(family, "t2v")
    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=2, alpha=3.0, targets=None)
    spec.save_lora(get_peft_model_state_dict(transformer), tmp_path)
    assert not list(tmp_path.glob("lora_comfyui*"))


def test_hunyuan_video15_loader_reads_fused_and_separate_qkv(spec_of, tmp_path):
    """vt's HunyuanVideo 1.5 loader reads the file vt writes (q/k/v fused as ComfyUI loads them; here v,
    add_k and add_v untrained: zero rows) and the one it wrote before (Tencent's separate q/k/v names):
    both give the in-memory adapters, each part at its own rank."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file, save_file

    from vt.shared.models.hunyuan_video15_lora import NAMES, SEPARATE_QKV, load_lora
    from vt.shared.weights import comfy

    spec = spec_of("hunyuan-video-1.5", "t2v")
    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=2, alpha=3.0, targets=["to_q", "to_k", "to_out.0", "add_q_proj", "ff.net.2"])
    randomise_lora(transformer, seed=7)
    expected = lora_deltas(transformer)
    tensors = get_peft_model_state_dict(transformer)
    spec.save_lora(tensors, tmp_path)
    fused = load_file(tmp_path / "lora_comfyui.safetensors")
    assert fused["diffusion_model.double_blocks.0.img_attn_qkv.lora_B.weight"].shape == (48, 4)  # q, k of rank 2
    assert fused["diffusion_model.double_blocks.0.txt_attn_qkv.lora_A.weight"].shape == (2, 16)  # add_q only
    separate = tmp_path / "separate.safetensors"
    save_file(
        comfy.comfy_state_dict(tensors, comfy.templated(NAMES + SEPARATE_QKV), 2, 3.0, write_alpha=False), str(separate)
    )
    assert "diffusion_model.double_blocks.0.img_attn_q.lora_A.weight" in load_file(separate)

    for path in (tmp_path / "lora_comfyui.safetensors", separate):
        fresh = spec.load_transformer()
        load_lora(SimpleNamespace(transformer=fresh), path)
        got = lora_deltas(fresh)
        assert set(got) == set(expected), path.name
        for name, delta in expected.items():
            torch.testing.assert_close(got[name], delta, msg=f"{path.name}: {name}")
        ranks = {p.shape[0] for n, p in fresh.named_parameters() if "lora_A" in n}
        assert ranks == {2}, path.name
