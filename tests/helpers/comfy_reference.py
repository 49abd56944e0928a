"""ComfyUI's LoRA loading, re-implemented from its source for the models vt writes ComfyUI files for.

Read at comfyanonymous/ComfyUI commit 3cd7b32f1b7e7e90395cefe7d9f9b1f89276d8ce (master, 2026-01-07;
read from pollockjj/ComfyUI, which merges upstream). ComfyUI applies a LoRA file in
comfy/sd.py `load_lora_for_models` (line 72): the key map of comfy/lora.py `model_lora_keys_unet`
(lines 175-333: "LoRA name" -> model weight key), comfy/lora_convert.py `convert_lora` (no rule
matches vt's keys), then comfy/lora.py `load_lora` (lines 37-95): for each name x of the map, `x.alpha`
and the LoRA forms of comfy/weight_adapter/lora.py `LoRAAdapter.load` (lines 81-147; vt writes
`x.lora_B.weight` / `x.lora_A.weight`); every key of the file no name consumed is logged
"lora key not loaded" and dropped. `LoRAAdapter.calculate_weight` (lines 150-215) then adds
strength * (alpha / rank, or 1 without alpha) * (lora_B @ lora_A).reshape(weight.shape), rank =
lora_A.shape[0]; a size mismatch is logged and the weight left unchanged.

The map needs the names of the ComfyUI model's weights. ComfyUI has no diffusers -> original
conversion for these video models (comfy/utils.py has `*_to_diffusers` for UNet, SD3, PixArt,
AuraFlow, Flux and Z-Image only), so the functions below list each model's per-block Linear weights
with their (out, in) shapes as ComfyUI's model classes build them (the files and lines are named at
each). Only transformer blocks are listed: vt's key tables name nothing outside them.

LoHa and LoKr files (`load_lycoris`, `lycoris_delta`, at the end) were read at the commits named there.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

COMFYUI = "comfyanonymous/ComfyUI@3cd7b32f1b7e7e90395cefe7d9f9b1f89276d8ce"
Shape = tuple[int, int]

# comfy/model_base.py: the classes each model class is an instance of (`isinstance` in model_lora_keys_unet).
MODEL_BASES = {
    "LTXV": ("LTXV",),  # line 948, unet_model comfy.ldm.lightricks.model.LTXVModel
    "LTXAV": ("LTXAV",),  # line 981, comfy.ldm.lightricks.av_model.LTXAVModel (BaseModel, not LTXV)
    "WAN21": ("WAN21",),  # line 1174, comfy.ldm.wan.model.WanModel
    "WAN22": ("WAN22", "WAN21"),  # line 1386: class WAN22(WAN21), WanModel (Wan 2.2 TI2V-5B)
    "HunyuanVideo": ("HunyuanVideo",),  # line 1035, comfy.ldm.hunyuan_video.model.HunyuanVideo
    "HunyuanVideo15": ("HunyuanVideo15", "HunyuanVideo"),  # line 1603: class HunyuanVideo15(HunyuanVideo)
    "GenmoMochi": ("GenmoMochi",),  # line 933, comfy.ldm.genmo.joint_model.asymm_models_joint.AsymmDiTJoint
    "Kandinsky5": ("Kandinsky5",),  # line 1694, comfy.ldm.kandinsky5.model.Kandinsky5
    # Comfy-Org/ComfyUI@0b61ce5b comfy/ldm/kandinsky6/model.py Kandinsky6 (the original checkpoint's names); its
    # LoRA keys are the generic `diffusion_model.<module>` ones every model has, which vt writes.
    "Kandinsky6": ("Kandinsky6",),
    # class WAN21_Vace(WAN21), unet_model comfy.ldm.wan.model.VaceWanModel (read at ComfyUI@01c4fa4c; also
    # comfy/supported_models.py WAN21_Vace: unet_config model_type "vace", image_model "wan2.1")
    "WAN21_Vace": ("WAN21_Vace", "WAN21"),
    # comfy/model_base.py class MiniMaxH3(BaseModel), unet_model comfy.ldm.minimax.model.MiniMaxH3Model (MINIMAX_H3).
    "MiniMaxH3": ("MiniMaxH3",),
}

# MiniMax H3 was read from Comfy-Org/ComfyUI (the stored versions of each file, 2026): comfy/ldm/minimax/model.py
# @2c64d4aa3cc63920c1a2875d6fe6ab2d24ff074f, comfy/lora.py @17358c8f73b581a0d22facc3c385822f09b8bfb1,
# comfy/lora_convert.py @2bffe2f4ce5763dcb83df6a670657b6d5c8f85a5, comfy/model_base.py
# @094c74c1b7f9cd5cdd9015741e8eb26acff1142a, comfy/ops.py @0271a469fe29524fafe5872b737123d65a63e5fc. There
# `model_lora_keys_unet` keeps the generic `diffusion_model.<module>` name for every weight and adds the bare module
# name for MiniMaxH3; `convert_lora`'s rules (BFL control, Wan Fun, USO, and Krea2's fused `attn.to_qkv`, split per
# projection) match none of H3's names (`attn.qkv_proj`); `load_lora` reads `.alpha` and the adapters' keys as above
# (weight_adapter/lora.py not re-read).
MINIMAX_H3 = "Comfy-Org/ComfyUI@2c64d4aa (comfy/ldm/minimax/model.py), @17358c8f (comfy/lora.py)"


def _attention(out: dict[str, Shape], name: str, query_dim: int, context_dim: int, inner: int) -> None:
    """comfy/ldm/lightricks/model.py CrossAttention (lines 334-364): to_q, to_k, to_v, to_out.0."""
    out[f"{name}.to_q"] = (inner, query_dim)
    out[f"{name}.to_k"] = (inner, context_dim)
    out[f"{name}.to_v"] = (inner, context_dim)
    out[f"{name}.to_out.0"] = (query_dim, inner)


def _ltx_feed_forward(out: dict[str, Shape], name: str, dim: int) -> None:
    """comfy/ldm/lightricks/model.py FeedForward (lines 284-292, mult=4): net.0.proj (GELU_approx), net.2."""
    out[f"{name}.net.0.proj"] = (4 * dim, dim)
    out[f"{name}.net.2"] = (dim, 4 * dim)


def ltxv_weights(num_layers: int, dim: int, cross_attention_dim: int) -> dict[str, Shape]:
    """LTXVModel (comfy/ldm/lightricks/model.py 801-871): `transformer_blocks.N` BasicTransformerBlock
    (lines 386-416): attn1 (self), ff, attn2 (context cross_attention_dim)."""
    out: dict[str, Shape] = {}
    for n in range(num_layers):
        block = f"transformer_blocks.{n}"
        _attention(out, f"{block}.attn1", dim, dim, dim)
        _ltx_feed_forward(out, f"{block}.ff", dim)
        _attention(out, f"{block}.attn2", dim, cross_attention_dim, dim)
    return out


def ltxav_weights(num_layers: int, v_dim: int, a_dim: int, v_context: int, a_context: int) -> dict[str, Shape]:
    """LTXAVModel (comfy/ldm/lightricks/av_model.py 322-464): `transformer_blocks.N`
    BasicAVTransformerBlock (lines 14-117); the audio-video cross-attention runs at the audio width
    (heads a_heads x ad_head: inner a_dim). Re-read for the audio modules at
    comfyanonymous/ComfyUI@2fb2e7567fc2a6a2752c7055e47f8f9f24976134: the same names and sizes."""
    out: dict[str, Shape] = {}
    for n in range(num_layers):
        block = f"transformer_blocks.{n}"
        _attention(out, f"{block}.attn1", v_dim, v_dim, v_dim)
        _attention(out, f"{block}.audio_attn1", a_dim, a_dim, a_dim)
        _attention(out, f"{block}.attn2", v_dim, v_context, v_dim)
        _attention(out, f"{block}.audio_attn2", a_dim, a_context, a_dim)
        _attention(out, f"{block}.audio_to_video_attn", v_dim, a_dim, a_dim)  # Q video, K/V audio
        _attention(out, f"{block}.video_to_audio_attn", a_dim, v_dim, a_dim)  # Q audio, K/V video
        _ltx_feed_forward(out, f"{block}.ff", v_dim)
        _ltx_feed_forward(out, f"{block}.audio_ff", a_dim)
    return out


def wan_weights(num_layers: int, dim: int, ffn_dim: int, i2v: bool) -> dict[str, Shape]:
    """WanModel (comfy/ldm/wan/model.py 388-508): `blocks.N` WanAttentionBlock (lines 171-209):
    self_attn and cross_attn WanSelfAttention q/k/v/o (lines 52-55, kv_dim = dim), cross_attn's
    k_img/v_img for model_type "i2v" (WanI2VCrossAttention, lines 113-124; comfy/model_detection.py
    sets "i2v" when the checkpoint has img_emb: Wan 2.1 I2V), ffn.0 / ffn.2 (lines 204-206).
    Wan 2.1 FLF2V is the same WanModel(model_type "i2v"): model_detection.py also reads
    `flf_pos_embed_token_number` off the checkpoint's `img_emb.emb_pos` (1 x 514 x 1280), the parameter
    of MLPProj (`img_emb`) that it adds to both images' CLIP tokens before `img_emb.proj` (read at
    comfyanonymous/ComfyUI@075e1704); the blocks, and so every LoRA key, are I2V's."""
    out: dict[str, Shape] = {}
    for n in range(num_layers):
        for attn in ("self_attn", "cross_attn"):
            for proj in ("q", "k", "v", "o"):
                out[f"blocks.{n}.{attn}.{proj}"] = (dim, dim)
        if i2v:
            out[f"blocks.{n}.cross_attn.k_img"] = (dim, dim)
            out[f"blocks.{n}.cross_attn.v_img"] = (dim, dim)
        out[f"blocks.{n}.ffn.0"] = (ffn_dim, dim)
        out[f"blocks.{n}.ffn.2"] = (dim, ffn_dim)
    return out


def wan_vace_weights(num_layers: int, vace_layers: int, dim: int, ffn_dim: int) -> dict[str, Shape]:
    """VaceWanModel (comfy/ldm/wan/model.py, read at comfyanonymous/ComfyUI@01c4fa4c746a16712ccabac3ce7ff71c48340214):
    WanModel's t2v `blocks.N` plus `vace_blocks.N` for N < vace_layers (comfy/model_detection.py counts the
    checkpoint's `vace_blocks.` and reads `vace_in_dim` off `vace_patch_embedding`), each a
    VaceWanAttentionBlock: a WanAttentionBlock ('t2v_cross_attn': self_attn and cross_attn q/k/v/o, ffn.0 /
    ffn.2) with `before_proj` (block 0 only) and `after_proj`, both dim x dim. Block N's hint is added after
    main block N x (num_layers // vace_layers) (`vace_layers_mapping`)."""
    out = wan_weights(num_layers, dim, ffn_dim, i2v=False)
    out.update({f"vace_{module}": shape for module, shape in wan_weights(vace_layers, dim, ffn_dim, i2v=False).items()})
    out["vace_blocks.0.before_proj"] = (dim, dim)
    out.update({f"vace_blocks.{n}.after_proj": (dim, dim) for n in range(vace_layers)})
    return out


def hunyuan_video_weights(depth: int, depth_single: int, hidden: int, mlp_hidden: int) -> dict[str, Shape]:
    """HunyuanVideo (comfy/ldm/hunyuan_video/model.py 196-256; HunyuanVideo 1.5 is the same class with
    no single blocks): `double_blocks.N` DoubleStreamBlock and `single_blocks.N` SingleStreamBlock of
    comfy/ldm/flux/layers.py. Double (lines 171-198): img_mod.lin / txt_mod.lin (Modulation, 6 x hidden,
    line 134), img_attn / txt_attn SelfAttention (lines 111-119: `qkv` fused, 3 x hidden, and `proj`),
    img_mlp / txt_mlp build_mlp (lines 74-88: `0`, `2`; mlp_hidden = int(hidden * mlp_ratio)). Single
    (lines 270-321): linear1 = [q, k, v, MLP in] (3 x hidden + mlp_hidden), linear2 = [attention, MLP] ->
    hidden, modulation.lin (3 x hidden)."""
    out: dict[str, Shape] = {}
    for n in range(depth):
        for stream in ("img", "txt"):
            out[f"double_blocks.{n}.{stream}_mod.lin"] = (6 * hidden, hidden)
            out[f"double_blocks.{n}.{stream}_attn.qkv"] = (3 * hidden, hidden)
            out[f"double_blocks.{n}.{stream}_attn.proj"] = (hidden, hidden)
            out[f"double_blocks.{n}.{stream}_mlp.0"] = (mlp_hidden, hidden)
            out[f"double_blocks.{n}.{stream}_mlp.2"] = (hidden, mlp_hidden)
    for n in range(depth_single):
        out[f"single_blocks.{n}.linear1"] = (3 * hidden + mlp_hidden, hidden)
        out[f"single_blocks.{n}.linear2"] = (hidden, hidden + mlp_hidden)
        out[f"single_blocks.{n}.modulation.lin"] = (3 * hidden, hidden)
    return out


def mochi_weights(depth: int, dim_x: int, dim_y: int, mlp_x: int, mlp_y: int) -> dict[str, Shape]:
    """AsymmDiTJoint (comfy/ldm/genmo/joint_model/asymm_models_joint.py 321-437): `blocks.N`
    AsymmetricJointBlock (lines 160-222), the last with update_y=False (line 421): no proj_y, no mlp_y,
    mod_y to dim_y only. AsymmetricAttention (lines 53-103): qkv_x (3 x dim_x), qkv_y (dim_y -> 3 x dim_x),
    proj_x, proj_y (dim_x -> dim_y). FeedForward (joint_model/layers.py 71-92): w1 = [SiLU half, gate]
    (2 x hidden), w2; hidden is int(2/3 x ratio x width) rounded up to 256 there, passed in here
    (`mlp_x`, `mlp_y`) as the checkpoint's width."""
    out: dict[str, Shape] = {}
    for n in range(depth):
        update_y = n < depth - 1
        block = f"blocks.{n}"
        out[f"{block}.mod_x"] = (4 * dim_x, dim_x)
        out[f"{block}.mod_y"] = (4 * dim_y if update_y else dim_y, dim_x)
        out[f"{block}.attn.qkv_x"] = (3 * dim_x, dim_x)
        out[f"{block}.attn.qkv_y"] = (3 * dim_x, dim_y)
        out[f"{block}.attn.proj_x"] = (dim_x, dim_x)
        out[f"{block}.mlp_x.w1"] = (2 * mlp_x, dim_x)
        out[f"{block}.mlp_x.w2"] = (dim_x, mlp_x)
        if update_y:
            out[f"{block}.attn.proj_y"] = (dim_y, dim_x)
            out[f"{block}.mlp_y.w1"] = (2 * mlp_y, dim_y)
            out[f"{block}.mlp_y.w2"] = (dim_y, mlp_y)
    return out


def kandinsky5_weights(
    num_text_blocks: int, num_visual_blocks: int, model_dim: int, time_dim: int, ff_dim: int
) -> dict[str, Shape]:
    """Kandinsky5 (comfy/ldm/kandinsky5/model.py 274-...; comfy/model_detection.py 629-641 reads its sizes off
    the checkpoint): `text_transformer_blocks.N` TransformerEncoderBlock (lines 213-236): text_modulation
    (Modulation, line 92: time_dim -> 6 x model_dim), self_attention SelfAttention (lines 106-112: to_query,
    to_key, to_value, out_layer), feed_forward FeedForward (lines 165-167: in_layer, out_layer, no bias);
    `visual_transformer_blocks.N` TransformerDecoderBlock (lines 239-271): visual_modulation (9 x model_dim),
    self_attention, cross_attention (CrossAttention(SelfAttention), line 148: keys/values from the text,
    already at model_dim), feed_forward."""
    out: dict[str, Shape] = {}
    for kind, count, params, attentions in (
        ("text", num_text_blocks, 6, ("self_attention",)),
        ("visual", num_visual_blocks, 9, ("self_attention", "cross_attention")),
    ):
        for n in range(count):
            block = f"{kind}_transformer_blocks.{n}"
            out[f"{block}.{kind}_modulation.out_layer"] = (params * model_dim, time_dim)
            for attention in attentions:
                for proj in ("to_query", "to_key", "to_value", "out_layer"):
                    out[f"{block}.{attention}.{proj}"] = (model_dim, model_dim)
            out[f"{block}.feed_forward.in_layer"] = (ff_dim, model_dim)
            out[f"{block}.feed_forward.out_layer"] = (model_dim, ff_dim)
    return out


def kandinsky6_weights(
    num_text_blocks: int, num_visual_blocks: int, dims: dict[str, int], cross_gates: bool
) -> dict[str, Shape]:
    """Kandinsky6 (Comfy-Org/ComfyUI@0b61ce5b comfy/ldm/kandinsky6/model.py): `video_text_transformer_blocks.N` and
    `audio_text_transformer_blocks.N` are Kandinsky 5's TransformerEncoderBlock at each stream's widths (above);
    `visual_blocks.N` FusedTransformerDecoderBlock: `videoT` / `audioT` Kandinsky 5's TransformerDecoderBlock per
    stream, `va_cross_attention` (video queries over audio keys/values) and `av_cross_attention` AsymCrossAttention
    (to_query q -> q, to_key / to_value kv -> q, out_layer q -> q), `va_modulation` / `av_modulation` (with
    cross_gates: 2 x own + other widths, one parameter set). `dims`: model_dim, time_dim, ff_dim and their `_a`."""
    out: dict[str, Shape] = {}
    streams = {
        "video": (dims["model_dim"], dims["time_dim"], dims["ff_dim"]),
        "audio": (dims["model_dim_a"], dims["time_dim_a"], dims["ff_dim_a"]),
    }
    for stream, (model, time, ff) in streams.items():
        text = kandinsky5_weights(num_text_blocks, 0, model, time, ff)
        out.update({f"{stream}_{name}": shape for name, shape in text.items()})
        fused = kandinsky5_weights(0, num_visual_blocks, model, time, ff)
        half = "videoT" if stream == "video" else "audioT"  # visual_blocks.N.<half>.<Kandinsky 5's name>
        out.update(
            {
                re.sub(r"^visual_transformer_blocks\.(\d+)\.", rf"visual_blocks.\1.{half}.", name): shape
                for name, shape in fused.items()
            }
        )
    (model, time, _), (model_a, time_a, _) = streams["video"], streams["audio"]
    for n in range(num_visual_blocks):
        for name, (q, kv) in (("va_cross_attention", (model, model_a)), ("av_cross_attention", (model_a, model))):
            out.update(
                {
                    f"visual_blocks.{n}.{name}.to_query": (q, q),
                    f"visual_blocks.{n}.{name}.to_key": (q, kv),
                    f"visual_blocks.{n}.{name}.to_value": (q, kv),
                    f"visual_blocks.{n}.{name}.out_layer": (q, q),
                }
            )
        out[f"visual_blocks.{n}.va_modulation.out_layer"] = (2 * model + model_a if cross_gates else 3 * model, time)
        out[f"visual_blocks.{n}.av_modulation.out_layer"] = (
            2 * model_a + model if cross_gates else 3 * model_a,
            time_a,
        )
    return out


def minimax_h3_weights(
    num_layers: int,
    refiner_layers: int,
    hidden: int,
    inner: int,
    ffn: int,
    t_dim: int,
    t_hidden: int,
    freq_dim: int,
    video_patch_dim: int,
    audio_dim: int,
    text_dim: int,
) -> dict[str, Shape]:
    """MiniMaxH3Model (comfy/ldm/minimax/model.py, `MiniMaxH3Model.__init__`; MINIMAX_H3 above), the dense form (no
    `adaln_curve_grid`: `time_embedder` present) with one output head each (no PDD head bank).
    `blocks.N` DiTBlock and `token_refiner.blocks.N` RefinerBlock share `Attention` (`qkv_proj`: hidden -> 3 x inner,
    its output split q, k, v in that order in `Attention.forward`; `out_proj`: inner -> hidden) and `MLP` (`fc1`:
    hidden -> 2 x ffn, `fc2`: ffn -> hidden; `MLP.forward` is comfy.ops.linear_input_act(fc2, fc1(x), "swiglu"),
    whose `_swiglu_eager` (comfy/ops.py) takes silu of fc1's FIRST half times its second: fc1 = [gate; value]).
    DiTBlock's `adaln_proj.linear` (AdalnProj(t_dim, hidden, 6, 3): 6 x hidden x 3 modalities); FinalLayer's
    `adaln_proj.linear` (2 x hidden), `video_out`, `audio_out`; `video_patch_proj`, `audio_patch_proj`,
    `condition_proj`; TimeEmbedder `proj_in` (freq_dim -> t_hidden), `proj_out` (t_hidden -> t_dim)."""
    out: dict[str, Shape] = {
        "video_patch_proj": (hidden, video_patch_dim),
        "audio_patch_proj": (hidden, audio_dim),
        "condition_proj": (hidden, text_dim),
        "time_embedder.proj_in": (t_hidden, freq_dim),
        "time_embedder.proj_out": (t_dim, t_hidden),
        "final_layer.adaln_proj.linear": (2 * hidden, t_dim),
        "final_layer.video_out": (video_patch_dim, hidden),
        "final_layer.audio_out": (audio_dim, hidden),
    }
    for prefix, count in (("blocks", num_layers), ("token_refiner.blocks", refiner_layers)):
        for n in range(count):
            block = f"{prefix}.{n}"
            out[f"{block}.attn.qkv_proj"] = (3 * inner, hidden)
            out[f"{block}.attn.out_proj"] = (hidden, inner)
            out[f"{block}.mlp.fc1"] = (2 * ffn, hidden)
            out[f"{block}.mlp.fc2"] = (hidden, ffn)
            if prefix == "blocks":
                out[f"{block}.adaln_proj.linear"] = (6 * hidden * 3, t_dim)
    return out


def model_lora_keys_unet(weights: dict[str, Shape], model_class: str) -> dict[str, str]:
    """comfy/lora.py `model_lora_keys_unet` (lines 175-333) for `model_class` (a key of MODEL_BASES)
    whose diffusion model has `weights` (module names): LoRA name -> `diffusion_model.<module>.weight`.
    Only the branches that apply to these classes: unet_to_diffusers is empty for them (comfy/utils.py
    line 271: no "num_res_blocks" in a DiT config) and no other isinstance branch matches."""
    bases = MODEL_BASES[model_class]
    keys = [f"diffusion_model.{module}.weight" for module in weights]
    key_map: dict[str, str] = {}
    for k in keys:  # lines 179-186: every model
        key_lora = k[len("diffusion_model.") : -len(".weight")].replace(".", "_")
        key_map[f"lora_unet_{key_lora}"] = k
        key_map[k[: -len(".weight")]] = k  # "generic lora format without any weird key names"
    if "GenmoMochi" in bases:  # lines 268-272: "Official Mochi lora format"
        for k in keys:
            key_map[k[len("diffusion_model.") : -len(".weight")]] = k
    if "HunyuanVideo" in bases:  # lines 274-284: diffusion-pipe lora format (HunyuanVideo 1.5 too)
        for k in keys:
            key_lora = k.replace("_mod.lin.", "_mod.linear.").replace("_attn.qkv.", "_attn_qkv.")
            key_lora = key_lora.replace("_attn.proj.", "_attn_proj.")
            key_lora = key_lora.replace("mlp.0.", "mlp.fc1.").replace("mlp.2.", "mlp.fc2.")
            key_lora = key_lora.replace(".modulation.lin.", ".modulation.linear.")
            key_lora = key_lora[len("diffusion_model.") : -len(".weight")]
            key_map[f"transformer.{key_lora}"] = k
            key_map[f"diffusion_model.{key_lora}"] = k  # "Old loras"
    if "MiniMaxH3" in bases:  # MINIMAX_H3's comfy/lora.py: the bare module name (vt writes the generic form)
        for k in keys:
            key_map[k[len("diffusion_model.") : -len(".weight")]] = k
    if "Kandinsky5" in bases:  # lines 326-331: bare and `transformer.` (diffusers) module names
        for k in keys:
            key_lora = k[len("diffusion_model.") : -len(".weight")]
            key_map[key_lora] = k
            key_map[f"transformer.{key_lora}"] = k
    return key_map


def _alpha(lora: dict, x: str, loaded: set[str]) -> float | None:
    """comfy/lora.py: a module's `.alpha`, read (and counted as loaded) when the file has one."""
    if f"{x}.alpha" not in lora:
        return None
    loaded.add(f"{x}.alpha")
    return lora[f"{x}.alpha"].item()


def load_lora(lora: dict[str, Tensor], key_map: dict[str, str]) -> tuple[dict[str, tuple], list[str]]:
    """comfy/lora.py `load_lora` (lines 37-95) for the forms vt writes (`.alpha`, and LoRAAdapter.load's
    `x.lora_B.weight` with `x.lora_A.weight`, weight_adapter/lora.py lines 95, 110-113): (weight key ->
    (lora_B, lora_A, alpha or None), the file's keys ComfyUI logs as "lora key not loaded")."""
    patches: dict[str, tuple] = {}
    loaded: set[str] = set()
    for x, weight in key_map.items():
        alpha = _alpha(lora, x, loaded)
        up, down = f"{x}.lora_B.weight", f"{x}.lora_A.weight"
        if up in lora:
            patches[weight] = (lora[up], lora[down], alpha)
            loaded.update((up, down))
    return patches, [key for key in lora if key not in loaded]


def weight_delta(patch: tuple, shape: Shape, strength: float = 1.0) -> Tensor:
    """What LoRAAdapter.calculate_weight (weight_adapter/lora.py lines 150-215) adds to a weight of
    `shape`; a size mismatch, which ComfyUI logs and skips, raises here."""
    up, down, alpha = patch
    scale = alpha / down.shape[0] if alpha is not None else 1.0  # line 175: alpha / mat2.shape[0]
    if up.shape[1] != down.shape[0] or (up.shape[0], down.shape[1]) != tuple(shape):
        raise ValueError(f"LoRA up {tuple(up.shape)} x down {tuple(down.shape)} does not make a {tuple(shape)} weight")
    return strength * scale * torch.mm(up.flatten(1).float(), down.flatten(1).float()).reshape(shape)


# LoHa and LoKr (the LyCORIS adapters vt writes ComfyUI files for, shared/weights/comfy_adapters.py). comfy/lora.py
# `load_lora` reads `x.alpha` (None without one), then offers `x` to every class of comfy/weight_adapter/__init__.py
# `adapters` (LoRAAdapter, LoHaAdapter, LoKrAdapter, GLoRAAdapter, OFTAdapter, BOFTAdapter: read at
# comfyanonymous/ComfyUI@0bca89ebbb08bbebdf79247bdb2a0f8d05f0d9ed); each `load` that finds its keys returns an adapter
# and adds the keys it read to `loaded_keys`. Read at comfyanonymous/ComfyUI: comfy/weight_adapter/loha.py
# @17adbb5cacc2d08310dad408e043a5d18e3ec013, comfy/weight_adapter/lokr.py @179c2d35c84beb3d9761fcd146ffcba77273413e
# (`load` and `calculate_weight` the same at @e8f3bc5ab766ba0149ac8ba8f67c328f8bb3da7d).
LYCORIS = "comfyanonymous/ComfyUI@17adbb5c (weight_adapter/loha.py), @179c2d35 and @e8f3bc5a (weight_adapter/lokr.py)"
LOKR_PARTS = ("w1", "w2", "w1_a", "w1_b", "w2_a", "w2_b", "t2")


def load_lycoris(lora: dict[str, Tensor], key_map: dict[str, str]) -> tuple[dict[str, tuple], list[str]]:
    """comfy/lora.py `load_lora` for LoHa and LoKr keys: (weight key -> ("loha", (w1_a, w1_b, alpha, w2_a, w2_b)) or
    ("lokr", (w1, w2, alpha, w1_a, w1_b, w2_a, w2_b, t2)), the file's keys ComfyUI logs as "lora key not loaded").
    LoHaAdapter.load (loha.py): present when `x.hada_w1_a` is, reads hada_w1_a/w1_b/w2_a/w2_b (hada_t1/t2, Tucker
    factors of convolutions, none here). LoKrAdapter.load (lokr.py): present when any of `x.lokr_w1`, `x.lokr_w2`,
    `x.lokr_w1_a`, `x.lokr_w2_a` is; every lokr_* key it finds is loaded, a missing one is None."""
    patches: dict[str, tuple] = {}
    loaded: set[str] = set()
    for x, weight in key_map.items():
        alpha = _alpha(lora, x, loaded)
        if f"{x}.hada_w1_a" in lora:
            names = [f"{x}.hada_{part}" for part in ("w1_a", "w1_b", "w2_a", "w2_b")]
            w1_a, w1_b, w2_a, w2_b = (lora[name] for name in names)
            patches[weight] = ("loha", (w1_a, w1_b, alpha, w2_a, w2_b))
            loaded.update(names)
        parts = {part: lora.get(f"{x}.lokr_{part}") for part in LOKR_PARTS}
        loaded.update(f"{x}.lokr_{part}" for part, value in parts.items() if value is not None)
        if any(parts[part] is not None for part in ("w1", "w2", "w1_a", "w2_a")):
            patches[weight] = (
                "lokr",
                (
                    parts["w1"],
                    parts["w2"],
                    alpha,
                    parts["w1_a"],
                    parts["w1_b"],
                    parts["w2_a"],
                    parts["w2_b"],
                    parts["t2"],
                ),
            )
    return patches, [key for key in lora if key not in loaded]


def lycoris_delta(patch: tuple, shape: Shape, strength: float = 1.0) -> Tensor:
    """What LoHaAdapter / LoKrAdapter.calculate_weight add to a weight of `shape` (no dora_scale).

    LoHa: strength x (alpha / w1_b.shape[0], or 1 without alpha) x ((w1_a @ w1_b) * (w2_a @ w2_b)).reshape(shape).
    LoKr: w1 = lokr_w1, or lokr_w1_a @ lokr_w1_b (dim = w1_b.shape[0]); w2 = lokr_w2, or lokr_w2_a @ lokr_w2_b (dim =
    w2_b.shape[0], overriding w1's); scale alpha / dim only when there is an alpha AND a split factor, else 1 (two
    whole factors ignore `.alpha`); strength x scale x kron(w1, w2).reshape(shape). ComfyUI logs an error and leaves
    the weight as it was where the reshape fails; that raises here."""
    kind, values = patch
    if kind == "loha":
        w1_a, w1_b, alpha, w2_a, w2_b = (v.float() if isinstance(v, Tensor) else v for v in values)
        scale = alpha / w1_b.shape[0] if alpha is not None else 1.0
        return strength * scale * ((w1_a @ w1_b) * (w2_a @ w2_b)).reshape(shape)
    w1, w2, alpha, w1_a, w1_b, w2_a, w2_b, t2 = (v.float() if isinstance(v, Tensor) else v for v in values)
    if t2 is not None:
        raise ValueError("lokr_t2 (a convolution's Tucker core): vt writes none")
    dim = None
    if w1 is None:
        dim = w1_b.shape[0]
        w1 = w1_a @ w1_b
    if w2 is None:
        dim = w2_b.shape[0]
        w2 = w2_a @ w2_b
    scale = alpha / dim if alpha is not None and dim is not None else 1.0
    return strength * scale * torch.kron(w1, w2).reshape(shape)
