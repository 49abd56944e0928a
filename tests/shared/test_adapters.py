"""DoRA, LoHa and LoKr (adapter.kind) exported where each consumer loads them, on Wan's and LTX-Video's tiny presets
with random (non-zero) adapters at alpha / rank = 2:

- the diffusers file loads into a fresh model as each kind's loader reads it (DoRA: the pipeline's own
  `load_lora_weights`; LoKr: diffusers' `transformer.load_lora_adapter`, its LoKrConfig from the file's metadata;
  LoHa: peft's `set_peft_model_state_dict` after `add_adapter(LoHaConfig(**metadata))`, diffusers having no LoHa
  loader), and every adapted weight, merged, equals the trained model's within 1e-4;
- the ComfyUI LoHa / LoKr file, through ComfyUI's key map and adapter arithmetic
  (tests/helpers/comfy_reference.py), changes each weight by the trained delta within 1e-4, every key loaded; DoRA
  writes no ComfyUI file.
Plus the kinds' names and starts (shared/adapters.py)."""

from __future__ import annotations

import json

import pytest
import torch

from vt.shared import adapters
from vt.shared.config import ModelConfig
from vt.shared.models import build_spec

from helpers import comfy_reference as ref

RANK, ALPHA = 4, 8.0  # scale alpha / rank = 2: a file that dropped it would be off by 2x
# peft's LoKr keeps w2 whole where the rank is at least half its larger side (8 x 8 on these 64-wide presets) and
# splits it into lokr_w2_a @ lokr_w2_b below: LTX-Video's LoKr at rank 2 has the split form, which ComfyUI scales
# otherwise (alpha / rank with an `.alpha`, 1 without), Wan's at rank 4 two whole factors.
RANKS = {("ltx-video", "lokr"): 2}
LOKR_W2 = {"wan": "lokr_w2", "ltx-video": "lokr_w2_a"}
FAMILIES = {"wan": "WAN21", "ltx-video": "LTXV"}
KINDS = ("dora", "loha", "lokr")


@pytest.fixture(scope="module")
def spec_of(tiny_model_factory):
    specs = {}

    def get(family: str):
        if family not in specs:
            specs[family] = build_spec(ModelConfig(family=family, path=str(tiny_model_factory(family))), frame_rate=8.0)
        return specs[family]

    return get


def randomise(transformer, seed: int = 7) -> None:
    """Every adapter weight seeded-random: factors of std 0.3, DoRA's magnitudes positive around 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if adapters.is_adapter(name):
                values = torch.randn(param.shape, generator=gen)
                param.copy_(values.abs() + 0.5 if adapters.part_of(name) == adapters.MAGNITUDE else 0.3 * values)


def merged(transformer) -> dict[str, torch.Tensor]:
    """module -> its weight with the adapter merged (peft's own merge: DoRA's normalised form, LoHa's and LoKr's
    products); merges in place."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    out = {}
    for name, module in transformer.named_modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
            out[name] = module.get_base_layer().weight.detach().float().clone()
    return out


def load_diffusers_file(spec, folder, kind: str):
    """A fresh transformer with the diffusers file of `kind` loaded as its consumer loads it."""
    from peft import LoHaConfig
    from peft.utils import set_peft_model_state_dict
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = folder / "pytorch_lora_weights.safetensors"
    if kind == "dora":
        pipeline = spec.pipeline_class().from_pretrained(spec.config.path)
        pipeline.load_lora_weights(folder)
        return pipeline.transformer
    transformer = spec.load_transformer()
    if kind == "lokr":
        transformer.load_lora_adapter(str(folder), weight_name=path.name, prefix="transformer")
        return transformer
    with safe_open(str(path), "pt") as handle:
        metadata = json.loads(handle.metadata()["lora_adapter_metadata"])
    transformer.add_adapter(LoHaConfig(**{k.removeprefix("transformer."): v for k, v in metadata.items()}))
    state = {k.removeprefix("transformer."): v for k, v in load_file(path).items()}
    result = set_peft_model_state_dict(transformer, state)
    assert not result.unexpected_keys
    return transformer


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_adapter_files_load_in_diffusers_and_comfyui_with_the_trained_weights(spec_of, tmp_path, family, kind):
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from vt.shared.weights.comfy import original_module

    spec = spec_of(family)
    trained = spec.load_transformer()
    spec.add_lora(trained, rank=RANKS.get((family, kind), RANK), alpha=ALPHA, targets=None, kind=kind)
    randomise(trained)
    state = get_peft_model_state_dict(trained)
    assert adapters.kind_of(state) == kind and all(adapters.is_adapter(k) for k in state)
    spec.save_lora(state, tmp_path)

    # ComfyUI (before merging: peft's delta of each trained module)
    comfy_file = tmp_path / "lora_comfyui.safetensors"
    assert comfy_file.exists() == (kind != "dora"), "a ComfyUI file for LoHa and LoKr only"
    if kind != "dora":
        config = trained.config
        inner = config.num_attention_heads * config.attention_head_dim
        weights = (
            ref.wan_weights(config.num_layers, inner, config.ffn_dim, i2v=False)
            if family == "wan"
            else ref.ltxv_weights(config.num_layers, inner, config.cross_attention_dim)
        )
        lora = load_file(comfy_file)
        assert not any(key.endswith(".alpha") for key in lora)
        assert kind == "loha" or any(key.endswith(f".{LOKR_W2[family]}") for key in lora)
        patches, not_loaded = ref.load_lycoris(lora, ref.model_lora_keys_unet(weights, FAMILIES[family]))
        assert not not_loaded, f"ComfyUI logs 'lora key not loaded' for {not_loaded[:6]}"
        comfy = {}
        for key, patch in patches.items():
            module = key[len("diffusion_model.") : -len(".weight")]
            comfy[module] = ref.lycoris_delta(patch, weights[module])
        ours = {
            name: module.get_delta_weight(module.active_adapters[0]).float()
            for name, module in trained.named_modules()
            if isinstance(module, BaseTunerLayer)
        }
        assert len(ours) > 4 and len(comfy) == len(ours) and all(patch[0] == kind for patch in patches.values())
        for name, delta in ours.items():
            assert delta.abs().max() > 1e-2, f"{name}: the adapter changes nothing"
            original = original_module(name, spec.original_names)
            torch.testing.assert_close(
                comfy[original], delta, atol=1e-4, rtol=1e-4, msg=f"{name} ({original}): ComfyUI's {kind} delta"
            )

    # diffusers / peft
    expected = merged(trained)
    loaded = merged(load_diffusers_file(spec, tmp_path, kind))
    assert loaded.keys() == expected.keys() and len(expected) > 4
    for name, weight in expected.items():
        torch.testing.assert_close(loaded[name], weight, atol=1e-4, rtol=1e-4, msg=f"{name} merged")


def test_adapter_names_and_starts():
    """Each kind's weights are adapters (base weights are not), carry their module and kind, save under peft's
    names, and start as peft starts them: the delta's zero factor zero, the others Kaiming-uniform, drawn from the
    name's key (the same draw in every layout), DoRA's magnitude the base rows' norms (filled later)."""
    names = {
        "lora": "b.0.to_q.lora_B.default.weight",
        "dora": "b.0.to_q.lora_magnitude_vector.default.weight",
        "loha": "b.0.to_q.hada_w2_b.default",
        "lokr": "b.0.to_q.lokr_w1.default",
    }
    for kind, name in names.items():
        assert adapters.is_adapter(name) and adapters.module_of(name) == "b.0.to_q" and adapters.kind_of([name]) == kind
        assert not adapters.initial(name, (6, 4), seed=1).any()  # the zero factor (and the unfilled magnitude)
    assert not adapters.is_adapter("b.0.to_q.base_layer.weight") and not adapters.is_adapter("b.0.lora_scale.weight")
    assert adapters.saved_name(names["dora"]) == "b.0.to_q.lora_magnitude_vector"
    assert adapters.saved_name(names["loha"]) == "b.0.to_q.hada_w2_b"
    assert adapters.saved_name(names["lora"]) == "b.0.to_q.lora_B.weight"
    for other in ("b.0.to_q.lora_A.default.weight", "b.0.to_q.hada_w1_a.default", "b.0.to_q.lokr_w2.default"):
        first = adapters.initial(other, (6, 4), seed=1)
        assert first.abs().max() > 0 and first.abs().max() <= 1 / 2  # Kaiming-uniform, a = sqrt 5: bound 1/sqrt(4)
        assert torch.equal(first, adapters.initial(other, (6, 4), seed=1))
        assert not torch.equal(first, adapters.initial(other, (6, 4), seed=2))
    weight = torch.randn(5, 3)
    torch.testing.assert_close(adapters.row_norms(weight), weight.norm(dim=1))


def test_dora_is_refused_on_a_float8_or_quantized_base(spec_of):
    """DoRA divides by the base weight's row norms in every forward: a float8 or quantized base is refused, by the
    config (frozen_base.fp8, frozen_base.quantize) and by the build (a float8 storage, a packed file)."""
    from vt.shared.config import Config
    from vt.shared.errors import UserError
    from vt.train.fp8 import FP8_STORAGE
    from vt.train.model_build import prepare_transformer
    from vt.train.parts import Parts

    def check(kind: str, base: dict) -> None:
        Parts(Config.model_validate({"adapter": {"kind": kind}, "frozen_base": base}))["adapter"].check(None, 1)

    for setting in ({"fp8": True}, {"quantize": "int8"}):
        with pytest.raises(UserError, match=r'adapter.kind = "dora" with frozen_base\.(fp8|quantize)'):
            check("dora", setting)
        check("loha", setting)  # the other kinds train on either
    lora = {"rank": 2, "alpha": 2.0, "targets": [], "kind": "dora"}
    with pytest.raises(UserError, match="in float8"):
        prepare_transformer(
            spec_of("wan"),
            "transformer",
            mode="lora",
            lora=lora,
            storage_dtype=FP8_STORAGE,
            sharded=False,
            compute_dtype=torch.float32,
            frozen_dtype=torch.float32,
        )
