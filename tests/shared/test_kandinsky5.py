"""Kandinsky 5 specifics the family-wide tests in test_models.py do not reach: the local Qwen tokenizer's
128-token template crop, each caption encoded alone as the pipeline encodes one prompt, the transformer's
inputs against the pipeline's own (t2v and i2v: channel-last latents, zero condition and first-frame mask,
RoPE positions and scale, text rows and their RoPE), one prediction per sample whatever its batch, the
NABLA sparse-attention rules, and ComfyUI files of other writers (with `.alpha`) read back."""

from __future__ import annotations

import pytest
import torch

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig
from vt.shared.models import build_spec

from helpers.lora_init import randomise_lora
from helpers.spec_inputs import first_call, uint8_video

FAMILY = "kandinsky5"
BUCKET = Bucket(9, 64, 96)
CAPTIONS = ["a big rabbit walks in the meadow", "a cat"]


def make_spec(folder, task="t2v", **model):
    model = {"max_text_tokens": 32, **model}
    return build_spec(ModelConfig(family=FAMILY, path=str(folder), task=task, **model), 8.0)


def test_each_caption_is_stored_as_the_pipeline_encodes_it_alone(tiny_model_factory):
    from vt.shared.models.kandinsky5 import PROMPT_TEMPLATE_TOKENS

    spec = make_spec(tiny_model_factory(FAMILY))
    encoders = spec.load_stage1()
    pipeline = spec.build_pipeline(spec.load_transformer(), **encoders)
    # The pipeline crops its first 128 template tokens: the local tokenizer puts the caption right there.
    ids = pipeline.tokenizer(pipeline.prompt_template.format(CAPTIONS[0]))["input_ids"]
    tokens = pipeline.tokenizer.convert_ids_to_tokens(ids[PROMPT_TEMPLATE_TOKENS:])
    assert tokens[:3] == ["a", "\u0120big", "\u0120rabbit"] and tokens[-1] == "<|im_end|>"

    batch = spec.encode_text(encoders, CAPTIONS)
    assert batch["prompt_embeds"].shape == (2, 32, 16) and batch["pooled_prompt_embeds"].shape == (2, 8)
    rows = []
    for index, caption in enumerate(CAPTIONS):
        qwen, clip, cu_seqlens = pipeline.encode_prompt([caption], max_sequence_length=32, device="cpu")
        n = qwen.shape[1]
        rows.append(n)
        torch.testing.assert_close(batch["prompt_embeds"][index, :n], qwen[0])
        assert (batch["prompt_embeds"][index, n:] == 0).all() and batch["prompt_attention_mask"][index].sum() == n
        torch.testing.assert_close(batch["pooled_prompt_embeds"][index], clip[0])
        assert cu_seqlens.tolist() == [0, n]
    assert rows[0] > rows[1] > 0  # lengths differ: padding would change what the transformer attends to

    stored = spec.encode_validation_text(encoders, CAPTIONS[0])  # the pipeline call's names, unpadded
    assert stored["prompt_embeds_qwen"].shape == (1, rows[0], 16) and stored["prompt_embeds_clip"].shape == (1, 8)
    assert stored["prompt_cu_seqlens"].tolist() == [0, rows[0]] and stored["prompt_cu_seqlens"].dtype == torch.int32


@pytest.mark.parametrize("task", ["t2v", "i2v"])
def test_training_feeds_the_transformer_what_the_pipeline_feeds(tiny_model_factory, task):
    from PIL import Image

    spec = make_spec(tiny_model_factory(FAMILY, task=task), task=task)
    encoders = spec.load_stage1()
    transformer = spec.load_transformer()
    video, pixels = uint8_video(batch=2)
    batch = {**spec.encode_text(encoders, CAPTIONS), **spec.encode_video(encoders, video)}
    image = pixels[0, 0].numpy()

    pipeline = spec.build_pipeline(transformer, **encoders)
    theirs = first_call(transformer)
    pipeline(
        **spec.pipeline_inputs(CAPTIONS[0], BUCKET, steps=1, seed=0, image=image if task == "i2v" else None),
        output_type="latent",
    )
    trained = spec.load_transformer()
    ours = first_call(trained)
    out = spec.forward(trained, batch, torch.tensor([0.5, 0.25]), torch.randn_like(batch["latents"]))

    assert theirs["hidden_states"].shape == ours["hidden_states"][:1].shape == (1, 3, 8, 12, 9)  # [x, 0, mask]
    torch.testing.assert_close(ours["hidden_states"][:1, ..., 4:], theirs["hidden_states"][..., 4:], rtol=0, atol=0)
    torch.testing.assert_close(ours["encoder_hidden_states"][:1], theirs["encoder_hidden_states"])
    torch.testing.assert_close(ours["pooled_projections"][:1], theirs["pooled_projections"])
    assert torch.equal(ours["text_rope_pos"], theirs["text_rope_pos"])
    assert all(torch.equal(a, b) for a, b in zip(ours["visual_rope_pos"], theirs["visual_rope_pos"], strict=True))
    assert ours["scale_factor"] == theirs["scale_factor"] == (1, 3.16, 3.16)  # 64 x 96 pixels: not "480p"
    assert ours["sparse_params"] is theirs["sparse_params"] is None
    assert ours["timestep"].dtype == theirs["timestep"].dtype and ours["timestep"][0] == 500.0
    mask = ours["hidden_states"][..., 8]
    if task == "t2v":
        assert (mask == 0).all() and out.weight is None
        return
    # i2v: the first latent frame is the image's clean latent, marked 1, and out of the loss.
    assert (mask[:, 0] == 1).all() and (mask[:, 1:] == 0).all()
    first = batch["image_latents"][:1, :, 0].permute(0, 2, 3, 1)  # sample 0's, channel-last
    torch.testing.assert_close(ours["hidden_states"][:, 0, :, :, :4], first, rtol=0, atol=0)
    assert out.weight[:, :, 0].eq(0).all() and out.weight[:, :, 1:].eq(1).all()
    # Stage 1's image latents are what the pipeline encodes of the image (its posterior's mode; it samples).
    vae = pipeline.vae
    frame = pipeline.video_processor.preprocess(Image.fromarray(image), height=64, width=96).unsqueeze(2)
    expected = vae.encode(frame).latent_dist.mode() * vae.config.scaling_factor
    torch.testing.assert_close(batch["image_latents"][:1], expected, atol=1e-5, rtol=1e-5)


def test_each_sample_is_predicted_from_its_own_text_rows(tiny_model_factory):
    """No text mask in the transformer: it is called once per sample with that sample's rows, so each
    prediction is the one it gets alone (what the pipeline computes for one prompt), bit for bit."""
    spec = make_spec(tiny_model_factory(FAMILY))
    encoders = spec.load_stage1()
    transformer = spec.load_transformer()
    captions = [CAPTIONS[1], CAPTIONS[0], CAPTIONS[1]]  # lengths short, long, short
    text = spec.encode_text(encoders, captions)
    latents = torch.randn(3, *spec.latent_shape(BUCKET), generator=torch.Generator().manual_seed(0))
    noise, sigmas = torch.randn_like(latents), torch.tensor([0.2, 0.5, 0.8])
    calls = []
    transformer.register_forward_pre_hook(
        lambda m, args, kwargs: calls.append(kwargs["encoder_hidden_states"].shape), with_kwargs=True
    )
    with torch.no_grad():
        together = spec.forward(transformer, {**text, "latents": latents}, sigmas, noise).prediction
        rows = [int(n) for n in text["prompt_attention_mask"].sum(1)]
        assert calls == [(1, n, 16) for n in rows] and rows[0] < rows[1]
        for index in range(3):
            alone = spec.forward(
                transformer,
                {k: v[index : index + 1] for k, v in {**text, "latents": latents}.items()},
                sigmas[index : index + 1],
                noise[index : index + 1],
            ).prediction
            torch.testing.assert_close(together[index : index + 1], alone, atol=0, rtol=0)
    assert not torch.allclose(together[0], together[2])  # other latents and sigma: a real per-sample check


def test_nabla_needs_flex_attention_and_128_pixel_buckets(tiny_model_factory, tmp_path):
    from diffusers import Kandinsky5Transformer3DModel

    folder = tiny_model_factory(FAMILY)
    config = dict(Kandinsky5Transformer3DModel.load_config(folder, subfolder="transformer"))
    nabla = dict(
        attention_type="nabla",
        attention_P=0.8,
        attention_wT=11,
        attention_wH=3,
        attention_wW=3,
        attention_add_sta=True,
        attention_method="topcdf",
    )  # the released 10 s models' settings
    Kandinsky5Transformer3DModel.from_config({**config, **nabla}).save_pretrained(tmp_path / "transformer")
    spec = make_spec(folder, components={"transformer": str(tmp_path / "transformer")})
    with pytest.raises(ValueError, match=r"NABLA.*height must be a multiple of 128"):
        spec.check_bucket(BUCKET)
    bucket = Bucket(5, 128, 128)
    spec.check_bucket(bucket)
    transformer = spec.load_transformer()
    batch = {
        **spec.encode_text(spec.load_stage1(), CAPTIONS[:1]),
        "latents": torch.randn(1, *spec.latent_shape(bucket), generator=torch.Generator().manual_seed(0)),
    }
    with pytest.raises(ValueError, match=r'train.attention_backend = "flex"'):
        spec.forward(transformer, batch, torch.tensor([0.5]), torch.randn_like(batch["latents"]))

    seen = first_call(transformer)
    transformer.set_attention_backend("flex")  # diffusers also makes it the process-wide default: undone below
    try:
        with torch.no_grad():  # FlexAttention has no CPU backward
            spec.forward(transformer, batch, torch.tensor([0.5]), torch.randn_like(batch["latents"]))
    finally:
        transformer.set_attention_backend("native")
    pipeline = spec.pipeline_class()(
        transformer=transformer,
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        scheduler=None,
    )
    expected = pipeline.get_sparse_params(torch.zeros(1, 2, 16, 16, 9), "cpu")  # prepare_latents' layout
    assert seen["sparse_params"].keys() == expected.keys() and expected["to_fractal"]
    assert torch.equal(seen["sparse_params"].pop("sta_mask"), expected.pop("sta_mask"))
    assert seen["sparse_params"] == expected  # P, windows, add_sta, method, visual_shape (2, 8, 8)


def test_lora_files_of_other_writers_load_and_limits_are_refused(tiny_model_factory, tmp_path):
    """A ComfyUI file with `.alpha` (as most trainers write it) loads at its own scale; vt's own writes the
    scale into lora_B. A text length past the pipeline's limit, or a sample without text rows, is refused."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    from vt.shared.models.kandinsky5_conditions import caption_lengths
    from vt.shared.weights import comfy

    folder = tiny_model_factory(FAMILY)
    spec = make_spec(folder)
    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=2, alpha=6.0, targets=None)
    randomise_lora(transformer, seed=5)
    state = {k: v.detach() for k, v in get_peft_model_state_dict(transformer).items()}
    save_file(
        comfy.comfy_state_dict(state, spec.original_names, 2, 6.0, write_alpha=True),
        str(tmp_path / "with_alpha.safetensors"),
    )
    pipeline = spec.pipeline_class().from_pretrained(folder)
    spec.load_lora(pipeline, tmp_path, weight_name="with_alpha.safetensors")

    def deltas(model):
        return {
            name: module.get_delta_weight(module.active_adapters[0])
            for name, module in model.named_modules()
            if isinstance(module, LoraLayer)
        }

    expected, got = deltas(transformer), deltas(pipeline.transformer)
    assert set(got) == set(expected) and len(expected) == 3 * 4  # q/k/v/out: text self, visual self + cross
    for name, delta in expected.items():
        torch.testing.assert_close(got[name], delta, msg=name)

    with pytest.raises(ValueError, match=r"max_text_tokens = 2048.*at most 1024"):
        make_spec(folder, max_text_tokens=2048)
    with pytest.raises(ValueError, match=r"samples \[1\] have no text rows"):
        caption_lengths(torch.tensor([[1, 1, 0], [0, 0, 0]]))
    assert caption_lengths(torch.tensor([[1, 1, 0], [1, 1, 1], [1.0, 0, 0]])) == [2, 3, 1]
