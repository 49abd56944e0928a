"""The one tester table (EXPECTED): what each registered family's tiny preset must show, which every cross-family
test reads (seeded inputs and helpers around a spec: tests/helpers/spec_inputs.py)."""

from __future__ import annotations

import torch

from vt.shared.buckets import Bucket

from helpers import comfy_reference as ref

BUCKET = Bucket(9, 64, 96)


def _ltx_denormalize(latents, vae):  # LTXPipeline's own inverse, as used before vae.decode
    from diffusers import LTXPipeline

    return LTXPipeline._denormalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)


def _wan_denormalize(latents, vae):  # WanPipeline: latents / (1 / std) + mean
    shape = (1, -1, 1, 1, 1)
    return latents / (1.0 / torch.tensor(vae.config.latents_std).view(shape)) + torch.tensor(
        vae.config.latents_mean
    ).view(shape)


def _has_padding_mask(batch):  # padded captions are masked
    mask = batch["prompt_attention_mask"]
    return mask.shape == batch["prompt_embeds"].shape[:2] and 0 < mask.sum() < mask.numel()


def _zero_past_caption(batch):  # no mask: embeddings are zero past the caption's tokens
    return batch["prompt_embeds"][:, -1].abs().sum() == 0 and batch["prompt_embeds"][:, 0].abs().sum() > 0


def _cogvideox_denormalize(latents, vae):  # CogVideoXPipeline.decode_latents: 1 / scaling_factor * latents
    return 1 / vae.config.scaling_factor * latents


def _hunyuan_denormalize(latents, vae):  # HunyuanVideoPipeline: latents / scaling_factor
    return latents / vae.config.scaling_factor


def _mochi_denormalize(latents, vae):  # MochiPipeline: latents * std / scaling_factor + mean
    return _wan_denormalize(latents / vae.config.scaling_factor, vae)


def _inverted_flow_target(spec, x0, noise, sigmas):  # Mochi: the pipeline's inverted flow time
    return x0 - noise


def _ltx2_denormalize(latents, vae):  # LTX2Pipeline's own inverse, as used before vae.decode
    from diffusers import LTX2Pipeline

    return LTX2Pipeline._denormalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)


def _ltx2_connector_text(batch):  # LTX2Pipeline's connectors: every row is valid and carries their output
    return bool((batch["prompt_attention_mask"] == 1).all() and (batch["prompt_embeds"].abs().sum(-1) > 0).all())


def _h3_denormalize(latents, vae):  # MiniMaxH3VideoDecodeStep: latents * std + mean
    shape = (1, -1, 1, 1, 1)
    return latents * torch.tensor(vae.config.latents_std).view(shape) + torch.tensor(vae.config.latents_mean).view(
        shape
    )


def _h3_pixels(clip):  # the H3 video VAE's input: [0, 1] pixels, ImageNet-normalised
    from vt.shared.models.minimax_h3_layout import normalise_pixels

    return normalise_pixels(clip)


def _t5_unmasked(batch):  # no mask, no zeroing: padded positions carry T5's outputs (CogVideoXPipeline)
    return "prompt_attention_mask" not in batch and (batch["prompt_embeds"][:, -1].abs().sum(-1) > 0).all()


def _flow_target(spec, x0, noise, sigmas):  # rectified flow
    return noise - x0


def _v_target(spec, x0, noise, sigmas):  # DDPM v-prediction at t = floor(1000 sigma) on the scheduler's schedule
    return spec.load_scheduler().get_velocity(x0, noise, (sigmas * 1000).floor().long().clamp(max=999))


ATTN_MODULES = r"(to_q|to_k|to_v|to_out\.0)"
_LTX = rf"transformer_blocks\.\d+\.((attn1|attn2)\.{ATTN_MODULES}|ff\.net\.(0\.proj|2))"  # LTX-2: the video stream only
_WAN = rf"blocks\.\d+\.((attn1|attn2)\.{ATTN_MODULES}|attn2\.(add_k_proj|add_v_proj)|ffn\.net\.(0\.proj|2))"


def _double(attn: str) -> str:
    """A double-stream block's attention (both streams) and FFNs."""
    return (
        rf"transformer_blocks\.\d+\.({attn}\.({ATTN_MODULES}|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
        r"|ff(_context)?\.net\.(0\.proj|2))"
    )


# What ComfyUI's model holds (tests/helpers/comfy_reference.py) at the sizes of a tiny preset's transformer: its
# diffusers config read as comfy/model_detection.py reads a checkpoint (test_comfy_keys.py).
def _inner(c):  # attention width: heads x head width
    return c.num_attention_heads * c.attention_head_dim


def _ltxv_comfy(t):
    return ref.ltxv_weights(t.config.num_layers, _inner(t.config), t.config.cross_attention_dim)


def _ltxav_comfy(t):
    c = t.config
    audio = c.audio_num_attention_heads * c.audio_attention_head_dim
    return ref.ltxav_weights(c.num_layers, _inner(c), audio, c.cross_attention_dim, c.audio_cross_attention_dim)


def _wan_comfy(t):
    c = t.config
    return ref.wan_weights(c.num_layers, _inner(c), c.ffn_dim, i2v=c.image_dim is not None)


def _wan_vace_comfy(t):  # vace_layers: the count ComfyUI reads off the checkpoint
    c = t.config
    return ref.wan_vace_weights(c.num_layers, len(c.vace_layers), _inner(c), c.ffn_dim)


def _hunyuan_comfy(t):
    c, inner = t.config, _inner(t.config)
    return ref.hunyuan_video_weights(c.num_layers, getattr(c, "num_single_layers", 0), inner, int(inner * c.mlp_ratio))


def _mochi_comfy(t):  # the FFN widths as the checkpoint has them (ComfyUI rounds them to 256)
    c, block = t.config, t.transformer_blocks[0]
    return ref.mochi_weights(
        c.num_layers,
        _inner(c),
        c.pooled_projection_dim,
        block.ff.net[2].in_features,
        block.ff_context.net[2].in_features,
    )


def _kandinsky5_comfy(t):  # no head count in its config: widths are model_dim
    c = t.config
    return ref.kandinsky5_weights(c.num_text_blocks, c.num_visual_blocks, c.model_dim, c.time_dim, c.ff_dim)


def _kandinsky6_comfy(t):  # each stream's widths (the audio ones default to the video's, as in both models)
    c = t.config
    dims = {name: getattr(c, name) for name in ("model_dim", "time_dim", "ff_dim")}
    dims.update({f"{name}_a": getattr(c, f"{name}_a") or dims[name] for name in ("model_dim", "time_dim", "ff_dim")})
    return ref.kandinsky6_weights(c.num_text_blocks, c.num_visual_blocks, dims, c.cross_gates)


def _h3_comfy(t):  # MiniMaxH3Model's constructor arguments from diffusers' names
    c = t.config
    video_patch_dim = c.in_channels * c.patch_size[0] * c.patch_size[1] * c.patch_size[2]
    return ref.minimax_h3_weights(
        c.num_layers,
        c.num_refiner_layers,
        c.hidden_size,
        _inner(c),
        c.ffn_dim,
        c.time_embed_dim,
        c.time_embed_hidden_dim,
        c.freq_dim,
        video_patch_dim,
        c.audio_in_channels,
        c.text_dim,
    )


# ComfyUI's fused weights and the diffusers modules stacked in their output rows, in the order ComfyUI's forward
# splits them: comfy/ldm/flux/layers.py DoubleStreamBlock (lines 212-223: qkv.view(..., 3, heads, -1), q then k
# then v), SingleStreamBlock (line 331: split [3 x hidden, MLP]); comfy/ldm/genmo/joint_model/asymm_models_joint.py
# AsymmetricAttention (lines 129, 135: view(..., 3, heads, -1)); comfy/ldm/minimax/model.py Attention.forward:
# qkv_proj(x).split(heads * head_dim) -> q, k, v.
_HUNYUAN_DOUBLE = {
    r"double_blocks\.(\d+)\.img_attn\.qkv": tuple(
        f"transformer_blocks.{{}}.attn.{p}" for p in ("to_q", "to_k", "to_v")
    ),
    r"double_blocks\.(\d+)\.txt_attn\.qkv": tuple(
        f"transformer_blocks.{{}}.attn.{p}" for p in ("add_q_proj", "add_k_proj", "add_v_proj")
    ),
}
_HUNYUAN_SINGLE = {
    r"single_blocks\.(\d+)\.linear1": tuple(
        f"single_transformer_blocks.{{}}.{p}" for p in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")
    ),
}
_MOCHI_QKV = {
    r"blocks\.(\d+)\.attn\.qkv_x": tuple(f"transformer_blocks.{{}}.attn1.{p}" for p in ("to_q", "to_k", "to_v")),
    r"blocks\.(\d+)\.attn\.qkv_y": tuple(
        f"transformer_blocks.{{}}.attn1.{p}" for p in ("add_q_proj", "add_k_proj", "add_v_proj")
    ),
}
_H3_QKV = {
    r"blocks\.(\d+)\.attn\.qkv_proj": tuple(f"transformer_blocks.{{}}.attn.{p}" for p in ("to_q", "to_k", "to_v")),
    r"token_refiner\.blocks\.(\d+)\.attn\.qkv_proj": tuple(
        f"token_refiner.refiner_blocks.{{}}.attn.{p}" for p in ("to_q", "to_k", "to_v")
    ),
}
# SwiGLU inputs whose halves ComfyUI holds in the other order: H3's `mlp.fc1` is [gate; value] (comfy/ops.py
# `_swiglu_eager`: silu(first half) x second half), diffusers' `ff.net.0.proj` is [value; gate]
# (diffusers.models.activations.SwiGLU: value, gate = chunk(2); value x silu(gate)).
_H3_SWAPPED = {
    r"blocks\.(\d+)\.mlp\.fc1": "transformer_blocks.{}.ff.net.0.proj",
    r"token_refiner\.blocks\.(\d+)\.mlp\.fc1": "token_refiner.refiner_blocks.{}.ff.net.0.proj",
}


# The one tester table: what each registered family's tiny preset must show, one entry per family, which every
# per-family table of the tests derives from (tests/shared/test_models.py fails on a family without one). Keys:
# comfy_key (None: the family writes no ComfyUI file); target: the training target, rectified flow unless given;
# frames_step / frames_rule ("{step}k+1" unless given) / side: the bucket rule of the tiny preset and of the real
# model alike (tests/shared/test_config.py); comfy_classes: task -> the ComfyUI model class its checkpoints load
# as (tests/shared/test_comfy_keys.py: Wan FLF2V is WAN21's i2v blocks, read off img_emb.emb_pos; LTX-2 i2v the
# same LTXAV transformer; Kandinsky 5 model_base.Kandinsky5, Kandinsky 6 one class for t2v and i2v; SkyReels V2 is
# Wan 2.1's module layout, WAN21; Wan VACE WAN21_Vace; MiniMax H3 tests/comfy_reference.py MINIMAX_H3);
# wide_lora: attention and FFN of every block, a regular expression matched whole; comfy_weights: transformer ->
# the ComfyUI model's block weights (module -> (out, in)) at its sizes; comfy_stacked: ComfyUI's fused module (a
# regular expression, the block number its group) -> the diffusers modules stacked in its rows; comfy_swapped: a
# ComfyUI module -> the diffusers module whose two halves it holds in the other order.
# What the Wan 2.1 layout's families share (Wan's encoders, VAE, patching and ComfyUI names); each entry names its
# differences.
_WAN_CASE = dict(
    frames_step=4,
    side=16,
    latent=(16, 3, 8, 12),
    text_dim=64,
    text_tokens=512,
    patch=2,
    text_padding=_zero_past_caption,
    denormalize=_wan_denormalize,
    comfy_key="diffusion_model.blocks.0.self_attn.q.lora_A.weight",
    comfy_weights=_wan_comfy,
    wide_lora=_WAN,
)

EXPECTED = {
    "ltx-video": dict(
        frames_step=8,
        side=32,
        latent=(16, 2, 2, 3),
        text_dim=64,
        text_tokens=128,
        patch=1,
        text_padding=_has_padding_mask,
        denormalize=_ltx_denormalize,
        comfy_key="diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight",
        comfy_classes={"t2v": "LTXV"},
        comfy_weights=_ltxv_comfy,
        wide_lora=_LTX,
    ),
    "wan": dict(_WAN_CASE, comfy_classes={"t2v": "WAN21", "i2v": "WAN21", "flf2v": "WAN21"}),
    "wan2.2": dict(
        _WAN_CASE,
        comfy_classes={"t2v": "WAN21", "i2v": "WAN21"},
        stage1_as="wan",  # Wan 2.1's encoders, preset parts and stage-1 code: its stage-1 rows are wan's
    ),
    # Wan 2.2 TI2V-5B: the 48-channel VAE folds 2 x 2 pixels first (x16 space), so sides are multiples of 32.
    "wan2.2-ti2v": dict(_WAN_CASE, side=32, latent=(48, 3, 4, 6), comfy_classes={"t2v": "WAN22"}),
    "cogvideox": dict(
        frames_step=4,
        side=16,
        latent=(16, 3, 8, 12),
        text_dim=64,
        text_tokens=226,
        patch=2,
        text_padding=_t5_unmasked,
        denormalize=_cogvideox_denormalize,
        comfy_key=None,
        target=_v_target,
    ),
    # LoRA targets of the export test: double blocks only; diffusers splits the single blocks' fused
    # linear1 at the real hidden size (3072), so they read back through it only at the real size.
    "hunyuan-video": dict(
        frames_step=4,
        side=16,
        latent=(4, 3, 8, 12),
        text_dim=16,
        text_tokens=256,
        patch=2,
        text_padding=_has_padding_mask,
        denormalize=_hunyuan_denormalize,
        comfy_key="diffusion_model.double_blocks.0.img_attn_qkv.lora_A.weight",
        lora_targets=r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0)",
        comfy_classes={"t2v": "HunyuanVideo", "i2v": "HunyuanVideo"},
        comfy_weights=_hunyuan_comfy,
        comfy_stacked={**_HUNYUAN_DOUBLE, **_HUNYUAN_SINGLE},
        wide_lora=_double("attn") + r"|single_transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v)|proj_mlp|proj_out)",
    ),
    # x16 VAE, patch 1; the pipeline encodes 1000 text tokens and takes no length argument (it is an attribute).
    "hunyuan-video-1.5": dict(
        frames_step=4,
        side=16,
        latent=(4, 3, 4, 6),
        text_dim=16,
        text_tokens=1000,
        patch=1,
        text_padding=_has_padding_mask,
        denormalize=_hunyuan_denormalize,
        comfy_key="diffusion_model.double_blocks.0.img_attn_qkv.lora_A.weight",
        text_length_in_call=False,
        comfy_classes={"t2v": "HunyuanVideo15", "i2v": "HunyuanVideo15"},
        comfy_weights=_hunyuan_comfy,
        comfy_stacked=_HUNYUAN_DOUBLE,
        wide_lora=_double("attn"),
    ),
    # Video stream only (the audio branch is not trained); the connectors' mask marks every row.
    "ltx-2": dict(
        frames_step=8,
        side=32,
        latent=(8, 2, 2, 3),
        text_dim=16,
        text_tokens=1024,
        patch=1,
        text_padding=_ltx2_connector_text,
        denormalize=_ltx2_denormalize,
        comfy_key="diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight",
        comfy_classes={"t2v": "LTXAV", "i2v": "LTXAV"},
        comfy_weights=_ltxav_comfy,
        wide_lora=_LTX,
    ),
    # Frames 6k+1 (bucket); nothing in diffusers reads a non-diffusers Mochi LoRA (comfy_in_diffusers):
    # tests/shared/test_mochi.py checks its ComfyUI file through diffusers' single-file converter.
    "mochi": dict(
        frames_step=6,
        side=16,
        latent=(12, 2, 8, 12),
        text_dim=64,
        text_tokens=256,
        patch=2,
        text_padding=_has_padding_mask,
        denormalize=_mochi_denormalize,
        target=_inverted_flow_target,
        comfy_key="diffusion_model.blocks.0.attn.qkv_x.lora_A.weight",
        comfy_in_diffusers=False,
        bucket=Bucket(7, 64, 96),
        comfy_classes={"t2v": "GenmoMochi"},
        comfy_weights=_mochi_comfy,
        comfy_stacked=_MOCHI_QKV,
        wide_lora=_double("attn1"),
    ),
    # Text blocks run before the visual ones (video_block: the first block fed the video tokens); the
    # output projection is `out_layer.out_layer`; each caption's rows are masked, zeros after them.
    "kandinsky5": dict(
        frames_step=4,
        side=16,
        latent=(4, 3, 8, 12),
        text_dim=16,
        text_tokens=512,
        patch=2,
        text_padding=_has_padding_mask,
        denormalize=_hunyuan_denormalize,
        comfy_key="diffusion_model.visual_transformer_blocks.0.self_attention.to_query.lora_A.weight",
        video_block=1,
        output_layer="out_layer.out_layer",
        comfy_classes={"t2v": "Kandinsky5"},
        comfy_weights=_kandinsky5_comfy,
        wide_lora=r"(text|visual)_transformer_blocks\.\d+\.((self|cross)_attention\."
        r"(to_query|to_key|to_value|out_layer)|feed_forward\.(in_layer|out_layer))",
    ),
    # Kandinsky 5's encoders and VAE with MMAudio's sound stream: a text block per stream, then the fused blocks
    # (the video tokens first reach blocks()[2]); the padded text and its mask, 1024 rows by default. Without
    # model.audio the transformer still runs the audio text block, whose output the fused blocks then never read.
    "kandinsky6": dict(
        frames_step=4,
        side=16,
        latent=(4, 3, 8, 12),
        text_dim=16,
        text_tokens=1024,
        patch=2,
        text_padding=_has_padding_mask,
        denormalize=_hunyuan_denormalize,
        comfy_key="diffusion_model.visual_blocks.0.videoT.self_attention.to_query.lora_A.weight",
        comfy_in_diffusers=False,
        blocks=4,
        video_block=2,
        output_layer="out_layer.out_layer",
        unread_blocks=("audio_text_transformer_blocks.0",),
        comfy_classes={"t2v": "Kandinsky6"},
        comfy_weights=_kandinsky6_comfy,
        wide_lora=r"(video_text_transformer_blocks\.\d+\.attn|visual_transformer_blocks\.\d+\.video_dec_block\."
        r"(self|cross)_attention)\.(to_query|to_key|to_value|out_layer)|(video_text_transformer_blocks\.\d+"
        r"|visual_transformer_blocks\.\d+\.video_dec_block)\.feed_forward\.net\.(0\.proj|2)",
    ),
    # Wan 2.1's encoders and layout on SkyReelsV2Transformer3DModel (t2v; diffusion forcing: test_skyreels_v2.py).
    "skyreels-v2": dict(_WAN_CASE, comfy_classes={"t2v": "WAN21", "i2v": "WAN21"}, stage1_as="wan"),
    # Wan 2.1 t2v plus two VACE blocks (blocks: 2 VACE + 2 main) fed each sample's control video (test
    # inputs pass one: `with_control`, `control_frames`); the LoRA sits on the VACE blocks, and diffusers'
    # Wan LoRA converter reads no `vace_blocks` (its ComfyUI file: tests/shared/test_comfy_keys.py).
    "wan-vace": dict(
        _WAN_CASE,
        blocks=4,
        comfy_key="diffusion_model.vace_blocks.0.self_attn.q.lora_A.weight",
        comfy_in_diffusers=False,
        comfy_classes={"t2v": "WAN21_Vace"},
        comfy_weights=_wan_vace_comfy,
        wide_lora=rf"(vace_)?{_WAN}|vace_blocks\.\d+\.(proj_in|proj_out)",
    ),
    # One packed sequence [text | audio | video] per sample (text rows reach the blocks: `other_rows`); frames 17k+5,
    # pixels ImageNet-normalised over [0, 1] (`pixels`); the pipeline predicts x0 - noise (t = 1 - sigma) and
    # generates at least 5 s at 24 fps (`generated_frames`); the ComfyUI file has the original names (q/k/v fused).
    "minimax-h3": dict(
        frames_step=17,
        frames_rule="17k+5",
        side=32,
        latent=(4, 2, 4, 6),
        text_dim=16,
        text_tokens=512,
        patch=2,
        text_padding=_has_padding_mask,
        denormalize=_h3_denormalize,
        pixels=_h3_pixels,
        target=_inverted_flow_target,
        comfy_key="diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight",
        bucket=Bucket(5, 64, 96),
        generated_frames=124,
        other_rows=lambda batch: int(batch["prompt_attention_mask"][0].sum()),
        comfy_classes={"t2v": "MiniMaxH3"},
        comfy_weights=_h3_comfy,
        comfy_stacked=_H3_QKV,
        comfy_swapped=_H3_SWAPPED,
        wide_lora=r"(transformer_blocks|token_refiner\.refiner_blocks)\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0)"
        r"|ff\.net\.(0\.proj|2))",
    ),
}


def bucket_of(family):
    """The test bucket of a family: BUCKET, unless its VAE needs other frame counts (EXPECTED "bucket")."""
    return EXPECTED.get(family, {}).get("bucket", BUCKET)
