"""Model Spec API on the tiny presets of both families: real diffusers/transformers classes throughout."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig
from vt.shared.models import FAMILIES, build_spec, get_spec_class
from vt.shared.models.components import ModelLoadError
from vt.shared.weights.comfy import filename as comfy_filename

from helpers.family_cases import EXPECTED, _flow_target, bucket_of
from helpers.lora_init import randomise_lora
from helpers.spec_inputs import (
    CAPTIONS,
    control_frames,
    folder_digest,
    make_spec,
    pipeline_latents,
    stage1,
    video,
    with_control,
)

FAMILY_PARAMS = pytest.mark.parametrize("family", FAMILIES)
# Stage 1 once per distinct stage 1: a family whose entry names another's (`stage1_as`: the same encoder classes,
# preset encoders and stage-1 code, test_a_family_with_anothers_stage1_has_its_classes_parts_and_code) runs none.
STAGE1_PARAMS = pytest.mark.parametrize("family", [f for f in FAMILIES if "stage1_as" not in EXPECTED[f]])


# ----------------------------------------------------------------------------- registry and loading
def test_every_registered_family_has_one_tester_entry():
    """family_cases.EXPECTED is the one per-family table the tests derive theirs from: a new family adds its entry,
    and an entry whose family writes a ComfyUI file names the ComfyUI class it loads as and that model's weights
    (test_comfy_keys.py)."""
    assert set(EXPECTED) - set(FAMILIES) == set(), "entries of no registered family"
    assert set(FAMILIES) - set(EXPECTED) == set(), (
        "registered families without a tester entry in tests/helpers/family_cases.py"
    )
    for family, case in EXPECTED.items():
        assert ("comfy_classes" in case) == ("comfy_weights" in case) == (case["comfy_key"] is not None), family
        assert set(case.get("comfy_classes", {})) <= set(get_spec_class(family).tasks), family


def test_registry_names_families_and_rejects_unknown():
    assert {"ltx-video", "wan"} <= set(FAMILIES) and set(FAMILIES) == set(EXPECTED)
    assert all(get_spec_class(family).family == family for family in FAMILIES)
    with pytest.raises(ValueError, match=r"'no-such-family'.*\['ltx-video', 'wan'"):
        get_spec_class("no-such-family")


@FAMILY_PARAMS
def test_preset_loads_through_spec_and_pipeline(tiny_model_factory, family):
    folder = tiny_model_factory(family)
    spec = make_spec(folder, family)
    pipeline = spec.pipeline_class().from_pretrained(folder)
    transformer = spec.load_transformer()
    assert type(pipeline.transformer) is type(transformer)
    loaded = pipeline.transformer.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in transformer.state_dict().items())
    assert type(pipeline.vae) is type(spec.load_component("vae"))
    assert type(pipeline.scheduler) is type(spec.load_scheduler())
    assert spec.load_component("tokenizer")(CAPTIONS[0]).input_ids == pipeline.tokenizer(CAPTIONS[0]).input_ids
    assert len(spec.blocks(transformer)) == EXPECTED[family].get("blocks", 2)


@FAMILY_PARAMS
def test_frozen_components_honour_dtype(tiny_model_factory, family):
    spec = make_spec(tiny_model_factory(family), family, dtype="bfloat16")
    encoders = {name: spec.load_component(name) for name in spec.stage1_components}  # as stage 1 on a GPU
    text_encoder, vae = encoders["text_encoder"], encoders["vae"]
    assert text_encoder.dtype == torch.bfloat16 and vae.dtype == torch.bfloat16
    # On a CPU stage 1 computes in float32: bf16 convolutions there run tens of times slower.
    assert {spec.load_stage1("cpu")[name].dtype for name in ("text_encoder", "vae")} == {torch.float32}
    assert not any(p.requires_grad for p in vae.parameters())
    assert spec.load_transformer().dtype == torch.float32  # the trained weights stay float32
    clip = video(1, bucket=bucket_of(family))
    encoded = spec.encode_video(encoders, clip, **with_control(spec, clip))
    latents = encoded["latents"]
    assert latents.dtype == torch.float32 and torch.isfinite(latents).all()
    # A bfloat16 transformer (mixed precision) takes the float32 batch and returns a float32 prediction.
    conds = spec.encode_text(encoders, CAPTIONS[:1])
    assert all(v.dtype == torch.float32 for v in conds.values())
    out = spec.forward(
        spec.load_transformer(dtype=torch.bfloat16),
        {**conds, **encoded},
        torch.tensor([0.5]),
        torch.randn_like(latents),
    )
    assert out.prediction.dtype == torch.float32 and torch.isfinite(out.prediction).all()


def test_missing_paths_say_which_key_to_set(tmp_path):
    spec = make_spec(tmp_path / "nowhere", "ltx-video")
    with pytest.raises(FileNotFoundError, match=r"model.path = .*nowhere.* does not exist.*make_tiny_model.py"):
        spec.load_component("vae")
    (tmp_path / "partial").mkdir()
    spec = make_spec(tmp_path / "partial", "wan")
    with pytest.raises(FileNotFoundError, match=r"no 'transformer' folder.*model.components.transformer"):
        spec.load_transformer()
    spec = make_spec(tmp_path, "wan", components={"vae": str(tmp_path / "no_vae_here")})
    with pytest.raises(FileNotFoundError, match="model.components.vae"):
        spec.load_component("vae")
    with pytest.raises(ValueError, match="model.components.unet is not a component"):
        make_spec(tmp_path, "wan", components={"unet": "x"})
    with pytest.raises(
        ModelLoadError,
        match=r"the vae of 'wan' from hub id 'someone/missing-model'.*offline "
        r"\(HF_HUB_OFFLINE=1\).*set model.path",
    ):
        make_spec("someone/missing-model", "wan").load_component("vae")  # HF_HUB_OFFLINE=1: fails at once


@FAMILY_PARAMS
def test_check_bucket_rejects_what_the_vae_cannot_encode(tiny_model_factory, family):
    spec = make_spec(tiny_model_factory(family), family)
    spec.check_bucket(bucket_of(family))
    step = EXPECTED[family]["frames_step"]
    rule = re.escape(EXPECTED[family].get("frames_rule", f"{step}k+1"))
    with pytest.raises(ValueError, match=rf"frames must be {rule}"):
        spec.check_bucket(Bucket(step + 2, 64, 96))
    side = EXPECTED[family]["side"]
    with pytest.raises(ValueError, match=rf"height must be a multiple of {side}"):
        spec.check_bucket(Bucket(bucket_of(family).frames, side + 8, 96))
    with pytest.raises(ValueError, match=r"\(B, 3, F, H, W\)"):
        spec.encode_video(spec.load_stage1(), torch.zeros(1, 9, 64, 96))


# ----------------------------------------------------------------------------- stage 1
@pytest.mark.parametrize("family", [f for f in FAMILIES if "stage1_as" in EXPECTED[f]])
def test_a_family_with_anothers_stage1_has_its_classes_parts_and_code(tiny_model_factory, family):
    """What lets the stage-1 rows below run once for both (`stage1_as`): the tokenizer, text encoder and VAE are the
    same classes, the tiny presets' are the same configs and tokenizer files, the spec's stage-1 functions are the
    same code, and the expected shapes and normalisation are the same entries."""
    other = EXPECTED[family]["stage1_as"]
    spec, twin = make_spec(tiny_model_factory(family), family), make_spec(tiny_model_factory(other), other)
    names = ("text_encoder", "vae")
    assert {n: spec.component_classes()[n] for n in names} == {n: twin.component_classes()[n] for n in names}
    for name in (*names, "tokenizer"):
        files = sorted(p.name for p in (tiny_model_factory(family) / name).iterdir() if p.suffix != ".safetensors")
        assert files and files == sorted(
            p.name for p in (tiny_model_factory(other) / name).iterdir() if p.suffix != ".safetensors"
        )
        for file in files:
            assert (tiny_model_factory(family) / name / file).read_bytes() == (
                tiny_model_factory(other) / name / file
            ).read_bytes(), (family, name, file)
    stage1 = (
        "encode_text",
        "_encode_prompt",
        "encode_video",
        "_check_video",
        "vae_mode",
        "latent_shape",
        "load_stage1",
    )
    for function in (*stage1, "stage1_components"):
        assert getattr(type(spec), function) is getattr(type(twin), function), function
    assert spec.latent_shape(bucket_of(family)) == twin.latent_shape(bucket_of(other))
    for key in ("latent", "text_dim", "text_padding", "denormalize", "frames_step", "side"):
        assert EXPECTED[family][key] == EXPECTED[other][key], key
    assert "stage1_as" not in EXPECTED[other]


@STAGE1_PARAMS
def test_stage1_shapes_match_latent_shape(tiny_model_factory, family):
    spec = make_spec(tiny_model_factory(family), family)
    expected = EXPECTED[family]["latent"]
    assert spec.latent_shape(bucket_of(family)) == expected
    batch = stage1(spec)
    assert batch["latents"].shape == (2, *expected) and batch["latents"].dtype == torch.float32
    assert batch["prompt_embeds"].shape == (2, 16, EXPECTED[family]["text_dim"])
    assert EXPECTED[family]["text_padding"](batch)


@STAGE1_PARAMS
def test_latents_are_normalised_as_the_pipeline_denormalises(tiny_model_factory, family):
    spec = make_spec(tiny_model_factory(family), family)
    vae = spec.load_component("vae")
    clip = video(1, bucket=bucket_of(family))
    latents = spec.encode_video({"vae": vae}, clip, **with_control(spec, clip))["latents"]
    raw = vae.encode(EXPECTED[family].get("pixels", lambda pixels: pixels)(clip)).latent_dist.mode()
    back = EXPECTED[family]["denormalize"](latents, vae)
    assert not torch.allclose(latents, raw, atol=1e-3)  # the tiny presets have non-trivial statistics
    torch.testing.assert_close(back, raw, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- stage 2
@FAMILY_PARAMS
def test_forward_gives_flow_target_and_trains_lora_only(tiny_model_factory, family):
    spec = make_spec(tiny_model_factory(family), family)
    batch = stage1(spec)
    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=4, alpha=4.0, targets=None)
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(1))
    sigmas = torch.tensor([0.2, 0.9])
    out = spec.forward(transformer, batch, sigmas, noise)
    target = EXPECTED[family].get("target", _flow_target)(spec, batch["latents"], noise, sigmas)
    torch.testing.assert_close(out.target, target, atol=1e-6, rtol=1e-6)
    assert out.prediction.shape == out.target.shape and out.weight is None
    ((out.prediction - out.target) ** 2).mean().backward()
    with_grad = {n for n, p in transformer.named_parameters() if p.grad is not None}
    lora = {n for n, p in transformer.named_parameters() if "lora_" in n}
    assert with_grad and with_grad == lora
    assert any(transformer.get_parameter(n).grad.abs().sum() > 0 for n in with_grad)


@FAMILY_PARAMS
def test_checkpointing_recomputes_every_block_of_every_list(tiny_model_factory, family):
    """The spec's block lists are the transformer's block lists (every top-level ModuleList), and under
    activation checkpointing every block of them runs twice per transformer call: forward, then recompute
    (one call per micro-step, or one per sample where the transformer takes no text mask: Kandinsky 5)."""
    from collections import Counter

    from torch.nn.modules.module import register_module_forward_pre_hook

    from vt.train.parallel import apply_ac

    spec = make_spec(tiny_model_factory(family), family)
    batch = stage1(spec)
    transformer = spec.load_transformer()
    lists = {name for name, child in transformer.named_children() if isinstance(child, torch.nn.ModuleList)}
    assert lists == set(spec.block_lists), f"{family}: block lists {spec.block_lists}, transformer has {lists}"
    apply_ac(transformer, spec)
    names = {id(block._checkpoint_wrapped_module): name for name, block in spec.named_blocks(transformer)}
    calls = []
    transformer.register_forward_pre_hook(lambda module, args: calls.append(1))
    starts = Counter()
    handle = register_module_forward_pre_hook(lambda module, args: starts.update([names.get(id(module))]))
    try:
        noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(1))
        out = spec.forward(transformer, batch, torch.tensor([0.2, 0.9]), noise)
        ((out.prediction - out.target) ** 2).mean().backward()
    finally:
        handle.remove()
    starts.pop(None, None)
    unread = EXPECTED[family].get("unread_blocks", ())  # run, but nothing reads their output: no recomputation
    assert calls and starts == {name: (1 if name in unread else 2) * len(calls) for name in names.values()}, (
        f"{family}: block forward starts {dict(starts)} in {len(calls)} transformer calls"
    )


# ----------------------------------------------------------------------------- export and validation
@FAMILY_PARAMS
def test_lora_export_loads_into_a_fresh_pipeline(tiny_model_factory, tmp_path, family):
    from peft.utils import get_peft_model_state_dict

    folder = tiny_model_factory(family)
    spec = make_spec(folder, family)
    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=4, alpha=8.0, targets=EXPECTED[family].get("lora_targets"))  # alpha != rank
    randomise_lora(transformer, seed=3)
    path = spec.save_lora(get_peft_model_state_dict(transformer), tmp_path / "lora")
    assert path == tmp_path / "lora" / "pytorch_lora_weights.safetensors" and path.is_file()

    in_memory = pipeline_latents(spec, spec.build_pipeline(transformer))
    fresh = spec.pipeline_class().from_pretrained(folder)
    fresh.set_progress_bar_config(disable=True)
    base = pipeline_latents(spec, fresh)
    spec.load_lora(fresh, tmp_path / "lora")  # the pipeline's load_lora_weights, or the family's own loader
    loaded = pipeline_latents(spec, fresh)
    assert (base - in_memory).abs().max() > 1e-2
    torch.testing.assert_close(loaded, in_memory, atol=1e-4, rtol=1e-4)

    bucket = bucket_of(family)
    frames = spec.generate(fresh, "a rabbit in a meadow", bucket, steps=2, seed=0, **control_frames(spec, bucket))
    assert (
        frames.shape == (EXPECTED[family].get("generated_frames", bucket.frames), 64, 96, 3)
        and frames.dtype == np.uint8
        and frames.std() > 0
    )

    # The ComfyUI file: original module names under diffusion_model., read back by diffusers' own
    # conversion of non-diffusers LoRA files into the same model (by the family's own loader where
    # diffusers has none for the pipeline: HunyuanVideo 1.5).
    from safetensors.torch import load_file

    comfy_name = comfy_filename(spec.expert)
    if EXPECTED[family]["comfy_key"] is None:  # no original key table: the diffusers file only
        assert not (tmp_path / "lora" / comfy_name).exists()
        return
    comfy = load_file(tmp_path / "lora" / comfy_name)
    assert all(key.startswith("diffusion_model.") for key in comfy)
    assert EXPECTED[family]["comfy_key"] in comfy and any(key.endswith(".alpha") for key in comfy) == spec.comfy_alpha
    if not EXPECTED[family].get("comfy_in_diffusers", True):  # no diffusers reader: the family's own test checks it
        return
    other = spec.pipeline_class().from_pretrained(folder)
    other.set_progress_bar_config(disable=True)
    spec.load_lora(other, tmp_path / "lora", weight_name=comfy_name)
    torch.testing.assert_close(pipeline_latents(spec, other), in_memory, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_lora_export_refuses_nan_or_inf_naming_the_tensor_and_step(tiny_model_factory, tmp_path, bad):
    from peft.utils import get_peft_model_state_dict

    spec = make_spec(tiny_model_factory("wan"), "wan")
    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=4, alpha=4.0, targets=None)
    state = get_peft_model_state_dict(transformer)
    name = sorted(k for k in state if "lora_B" in k)[1]
    state[name] = state[name].clone()
    state[name][0, 0] = bad
    kind = "NaN" if bad != bad else "inf"
    with pytest.raises(ValueError, match=rf"LoRA tensor {name} holds {kind} values at step 40: the run diverged"):
        spec.save_lora(state, tmp_path / "lora", step=40)
    assert not (tmp_path / "lora").exists(), "nothing is written"


@FAMILY_PARAMS
def test_full_export_round_trips_and_overrides_the_transformer(tiny_model_factory, tmp_path, family):
    folder = tiny_model_factory(family)
    spec = make_spec(folder, family)
    transformer = spec.load_transformer()
    head = EXPECTED[family].get("output_layer", "proj_out")  # the transformer's output projection
    with torch.no_grad():
        transformer.get_submodule(head).weight.add_(1.0)  # differs from the preset, so the override is visible
    out = spec.save_full(transformer, tmp_path / "full")
    reloaded = spec.component_classes()["transformer"].from_pretrained(out)
    expected = transformer.state_dict()
    assert reloaded.state_dict().keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) for k, v in reloaded.state_dict().items())

    override = make_spec(folder, family, components={"transformer": str(out)}).load_transformer()
    weight = transformer.get_submodule(head).weight
    assert torch.equal(override.get_submodule(head).weight, weight)
    assert not torch.equal(spec.load_transformer().get_submodule(head).weight, weight)


# ----------------------------------------------------------------------------- tiny presets
@FAMILY_PARAMS
def test_make_tiny_cli_is_deterministic_for_a_seed(tiny_model_factory, tmp_path, family):
    import make_tiny_model

    make_tiny_model.main(["--family", family, str(tmp_path / "again")])
    assert folder_digest(tmp_path / "again") == folder_digest(tiny_model_factory(family))
    other = make_tiny_model.make_tiny_model(family, tmp_path / "seed1", seed=1)
    assert (
        folder_digest(other)["transformer/diffusion_pytorch_model.safetensors"]
        != folder_digest(tmp_path / "again")["transformer/diffusion_pytorch_model.safetensors"]
    )
    with pytest.raises(SystemExit):
        make_tiny_model.main(["--family", "nope", str(tmp_path / "x")])


@FAMILY_PARAMS
def test_text_length_defaults_to_what_the_family_pipeline_encodes(tiny_model_factory, family, caplog):
    """Unset, the text length is the pipeline's own (Wan 512, LTX 128); a different one is warned about."""
    spec = build_spec(ModelConfig(family=family, path=str(tiny_model_factory(family))), frame_rate=8.0)
    expected = EXPECTED[family]["text_tokens"]
    assert spec.max_text_tokens == expected == spec.pipeline_default("max_sequence_length")
    assert not any("max_sequence_length" in line for line in spec.inference_mismatches())
    shorter = make_spec(tiny_model_factory(family), family)  # max_text_tokens=16
    inputs = shorter.pipeline_inputs("a cat", bucket_of(family), 2, 0, **control_frames(shorter, bucket_of(family)))
    if EXPECTED[family].get("text_length_in_call", True):
        assert inputs["max_sequence_length"] == 16
    else:  # no such call argument: validation sets the pipeline's own length attribute (the family's test)
        assert "max_sequence_length" not in inputs
    assert any(
        f"max_sequence_length=16 but {shorter.pipeline_class().__name__} uses {expected}" in line
        for line in shorter.inference_mismatches()
    )
    assert spec.encode_text(spec.load_stage1(), CAPTIONS[:1])["prompt_embeds"].shape[1] == expected


@FAMILY_PARAMS
def test_tokens_per_sample_counts_transformer_tokens(tiny_model_factory, family):
    """Wan folds 2x2 latent pixels into a token, LTX (patch 1 after its VAE) one pixel per token."""
    spec = make_spec(tiny_model_factory(family), family)
    latent = spec.latent_shape(bucket_of(family))
    transformer = spec.load_transformer()
    seen = {}

    def first_block_input(module, args, kwargs):  # the token sequence the blocks attend over
        seen["tokens"] = (args[0] if args else kwargs["hidden_states"]).shape[1]

    video_block = EXPECTED[family].get("video_block", 0)  # after text-only blocks, where a family has them
    spec.blocks(transformer)[video_block].register_forward_pre_hook(first_block_input, with_kwargs=True)
    batch = stage1(spec, batch=1)
    spec.forward(transformer, batch, torch.tensor([0.5]), torch.randn_like(batch["latents"]))
    # (a family packing text rows into the blocks' sequence: those come on top)
    assert spec.tokens_per_sample(latent) + EXPECTED[family].get("other_rows", lambda batch: 0)(batch) == seen["tokens"]
    patch = EXPECTED[family]["patch"]
    assert spec.tokens_per_sample(latent) == latent[1] * latent[2] * latent[3] // patch**2
