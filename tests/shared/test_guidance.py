"""Guidance-augmented targets (`guidance.scale`, train/parts/guidance.py): the base's prediction is the transformer
without its adapters on the empty caption, the adapters are back on afterwards, each target (video and audio) becomes
u + w (target - u), w = 1 leaves it exactly as it was, and the config refuses what has no frozen base."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vt.shared.buckets import Bucket
from vt.shared.config import Config, ModelConfig, build
from vt.shared.errors import UserError
from vt.shared.models import build_spec
from vt.shared.models.flow import Prediction
from vt.train.parts.guidance import Guidance, GuidancePart, adapters_off

BUCKET = Bucket(5, 64, 96)  # H3's shortest latent clip: 17k+5 frames


@pytest.fixture(scope="module")
def h3(tiny_model_factory):
    """MiniMax H3 with sound (video and audio targets from one transformer call), a LoRA'd transformer whose adapters
    change its output (lora_B drawn, not zero), and the same weights without adapters."""
    spec = build_spec(
        ModelConfig(family="minimax-h3", path=str(tiny_model_factory("minimax-h3")), audio=True, max_text_tokens=8),
        24.0,
    )
    torch.manual_seed(0)
    adapted = spec.load_transformer()
    spec.add_lora(adapted, rank=2, alpha=2.0, targets=None)
    for name, param in adapted.named_parameters():
        if "lora_B" in name:
            param.data.normal_(std=0.5)
    return spec, adapted, spec.load_transformer()


def inputs(spec) -> tuple[dict, dict, torch.Tensor, torch.Tensor]:
    """(batch of two captioned samples with sound, the empty caption as H3 stores it: no text rows, sigmas, noise)."""
    generator = torch.Generator().manual_seed(3)
    shapes = spec.condition_shapes(BUCKET)
    batch = {name: torch.randn(2, *shape, generator=generator) for name, shape in shapes.items()}
    batch["prompt_attention_mask"] = torch.tensor([[1.0] * 5 + [0.0] * 3, [1.0] * 3 + [0.0] * 5])
    batch["audio_noise"] = torch.randn(batch["audio_latents"].shape, generator=generator)
    empty = {
        "prompt_embeds": torch.zeros(shapes["prompt_embeds"]),
        "prompt_attention_mask": torch.zeros(shapes["prompt_attention_mask"]),
    }
    return batch, empty, torch.tensor([0.3, 0.8]), torch.randn(batch["latents"].shape, generator=generator)


def test_the_base_is_the_transformer_without_adapters_on_the_empty_caption(h3):
    spec, adapted, fresh = h3
    batch, empty, sigmas, noise = inputs(spec)
    before = spec.forward(adapted, dict(batch), sigmas, noise)
    base = Guidance(spec, 3.0, lambda: empty).base(adapted, dict(batch), sigmas, noise)
    with torch.no_grad():
        expected = spec.forward(fresh, {**batch, **{k: v.expand(2, *v.shape) for k, v in empty.items()}}, sigmas, noise)
        unadapted = spec.forward(fresh, dict(batch), sigmas, noise)
    assert not base.prediction.requires_grad and not base.audio.prediction.requires_grad
    torch.testing.assert_close(base.prediction, expected.prediction, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(base.audio.prediction, expected.audio.prediction, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(before.prediction, unadapted.prediction, atol=1e-3)  # the adapters matter here
    after = spec.forward(adapted, dict(batch), sigmas, noise)  # the adapters are back on
    assert torch.equal(after.prediction, before.prediction) and torch.equal(
        after.audio.prediction, before.audio.prediction
    )
    assert all(p.requires_grad == ("lora_" in n) for n, p in adapted.named_parameters())  # no flag touched


def test_each_target_becomes_the_guided_one_and_scale_one_leaves_it_alone(h3):
    spec, adapted, _ = h3
    batch, empty, sigmas, noise = inputs(spec)
    plain = spec.forward(adapted, dict(batch), sigmas, noise)
    base = Guidance(spec, 3.0, lambda: empty).base(adapted, dict(batch), sigmas, noise)
    out = Guidance(spec, 3.0, lambda: empty).forward(adapted, dict(batch), sigmas, noise)
    u, audio_u = base.prediction, base.audio.prediction
    torch.testing.assert_close(out.target, u + 3.0 * (plain.target - u), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.audio.target, audio_u + 3.0 * (plain.audio.target - audio_u), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out.target, plain.target) and not torch.allclose(out.audio.target, plain.audio.target)
    assert torch.equal(out.prediction, plain.prediction) and out.prediction.requires_grad  # only the target moves
    same = Guidance(spec, 1.0, lambda: empty).forward(adapted, dict(batch), sigmas, noise)
    assert torch.equal(same.target, plain.target) and torch.equal(same.audio.target, plain.audio.target)


class Drawing:
    """A spec whose forward draws from each row's generator and from the global generator, as a family's own draws
    (LTX-Video's first-frame noise) and dropout would: the prediction is the layer's output plus what it drew."""

    family, text_with_image = "toy", None

    def forward(self, model, batch, sigmas, noise, generators=None):
        drawn = torch.stack([torch.rand((), generator=g) for g in generators]) + torch.rand(())
        prediction = model["layer"](batch["prompt_embeds"]).sum(1) + drawn
        return Prediction(prediction=prediction, target=batch["latents"], weight=None)


def test_the_base_draws_what_the_trained_pass_draws_and_leaves_the_random_state_alone():
    from peft import LoraConfig, inject_adapter_in_model

    model = inject_adapter_in_model(
        LoraConfig(r=1, target_modules=["layer"], init_lora_weights=False), nn.ModuleDict({"layer": nn.Linear(2, 2)})
    )
    batch = {"prompt_embeds": torch.randn(2, 3, 2), "latents": torch.randn(2, 2)}
    spec = Drawing()

    def run(guidance):
        torch.manual_seed(5)
        generators = [torch.Generator().manual_seed(row) for row in range(2)]
        forward = spec.forward if guidance is None else guidance.forward
        out = forward(model, batch, torch.rand(2), torch.rand(2), generators)
        return out, [g.get_state() for g in generators], torch.rand(())

    plain, plain_states, plain_next = run(None)
    guided, states, following = run(Guidance(spec, 1.0, lambda: {"prompt_embeds": torch.zeros(3, 2)}))
    assert torch.equal(guided.prediction, plain.prediction) and torch.equal(guided.target, plain.target)
    assert all(torch.equal(a, b) for a, b in zip(states, plain_states)) and torch.equal(following, plain_next)


def test_adapters_off_needs_adapters():
    with pytest.raises(ValueError, match="no adapters to switch off"), adapters_off(nn.Linear(2, 2)):
        pass


def config(**sections) -> Config:
    base = {"model": {"family": "wan", "path": "unused"}, "data": {"raw": "unused"}, "window": {"uri": "unused"}}
    return build(Config, {**base, **sections})


def test_the_config_keeps_it_off_and_refuses_what_has_no_frozen_base():
    assert config().guidance.scale is None
    assert config(guidance={"scale": 4}).guidance.scale == 4.0
    with pytest.raises(UserError, match=r"guidance.scale = 0: must be > 0"):
        config(guidance={"scale": 0})
    with pytest.raises(UserError, match=r"guidance.scale moved to guidance.scale|train.guidance_scale moved to "):
        config(train={"guidance_scale": 3.0})
    plain = SimpleNamespace(family="toy", text_with_image=None)
    with pytest.raises(UserError, match=r"a full fine-tune has no frozen base: set train.mode = \"lora\""):
        GuidancePart(config(guidance={"scale": 3.0}, train={"mode": "full"})).check(plain, 1)
    with pytest.raises(UserError, match=r"parallel.pp = 2: the base's extra forward is not carried"):
        GuidancePart(config(guidance={"scale": 3.0}, parallel={"pp": 2})).check(plain, 1)
    with pytest.raises(UserError, match="reads each caption together with its clip's first frame"):
        GuidancePart(config(guidance={"scale": 3.0})).check(SimpleNamespace(family="toy", text_with_image=object()), 1)
