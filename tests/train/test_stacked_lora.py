"""[validation_stack] (train/parts/validation_stack.py, train/stacked_lora.py): a LoRA, LoHa or LoKr file vt exported,
stacked on a transformer by forward hooks, computes what the model with that adapter loaded by peft computes, on a
plain transformer and on one that trains adapters of its own; the hooks go after the render; what cannot be stacked is
refused with the fix."""

from __future__ import annotations

import pytest
import torch

from vt.shared import adapters
from vt.shared.config import Config, ModelConfig
from vt.shared.errors import UserError
from vt.shared.models import build_spec
from vt.train.stacked_lora import check_targets, read_file, stacked


@pytest.fixture(scope="module")
def spec(tiny_model_factory):
    return build_spec(ModelConfig(family="ltx-video", path=str(tiny_model_factory("ltx-video"))), frame_rate=8.0)


def inputs() -> dict:
    generator = torch.Generator().manual_seed(0)
    return dict(
        hidden_states=torch.randn(1, 8, 16, generator=generator),
        encoder_hidden_states=torch.randn(1, 4, 64, generator=generator),
        timestep=torch.tensor([500.0]),
        encoder_attention_mask=torch.ones(1, 4),
        num_frames=2,
        height=2,
        width=2,
        return_dict=False,
    )


def adapted(spec, kind: str, seed: int):
    """A transformer with random (non-zero) adapters of `kind` at alpha / rank = 2."""
    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=2, alpha=4.0, targets=None, kind=kind)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if adapters.is_adapter(name):
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return transformer


@pytest.mark.parametrize("kind", ["lora", "loha", "lokr"])
def test_a_stacked_file_computes_what_peft_computes_with_it_loaded(spec, tmp_path, kind):
    from peft.utils import get_peft_model_state_dict

    loaded = adapted(spec, kind, seed=1).eval()
    path = spec.save_lora(get_peft_model_state_dict(loaded), tmp_path)
    deltas = read_file(path, spec, strength=1.0)
    assert {d.kind for d in deltas.values()} == {kind} and {d.scale for d in deltas.values()} == {2.0}
    with torch.no_grad():
        expected = loaded(**inputs())[0]
        plain = spec.load_transformer().eval()
        before = plain(**inputs())[0]
        with stacked(plain, [deltas], torch.device("cpu")):
            got = plain(**inputs())[0]
        assert (expected - before).abs().max() > 1e-2  # the file changes the output
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(plain(**inputs())[0], before)  # the hooks are gone after it
        # on a transformer whose own (trained) adapters start at zero: the same, its adapters' modules hooked
        trained = spec.load_transformer().eval()
        spec.add_lora(trained, rank=2, alpha=2.0, targets=None)
        assert check_targets(trained, deltas, str(path)) == len(deltas)
        with stacked(trained, [deltas], torch.device("cpu")):
            torch.testing.assert_close(trained(**inputs())[0], expected, atol=1e-4, rtol=1e-4)


def test_what_cannot_be_stacked_is_refused_with_the_fix(spec, tmp_path):
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    from vt.train.parts import Parts

    dora = adapted(spec, "dora", seed=2)
    path = spec.save_lora(get_peft_model_state_dict(dora), tmp_path / "dora")
    with pytest.raises(UserError, match="is a DoRA"):
        read_file(path, spec, 1.0)
    other = tmp_path / "other.safetensors"
    save_file({"transformer.blocks.9.attn.q.lora_A.weight": torch.zeros(2, 8)}, str(other))
    with pytest.raises(UserError, match="holds no lora_B of 'blocks.9.attn.q'"):
        read_file(other, spec, 1.0)
    save_file({f"transformer.blocks.9.attn.q.lora_{x}.weight": torch.zeros(2, 2) for x in "AB"}, str(other))
    with pytest.raises(UserError, match="no module of"):
        check_targets(spec.load_transformer(), read_file(other, spec, 1.0), str(other))
    wide = {f"transformer.transformer_blocks.0.attn1.to_q.lora_{x}.weight": torch.zeros(2, 2) for x in "AB"}
    save_file(wide, str(other))
    with pytest.raises(UserError, match="2 x 2 linear layer; the transformer's is 64 x 64"):
        check_targets(spec.load_transformer(), read_file(other, spec, 1.0), str(other))
    foreign = tmp_path / "foreign.safetensors"
    save_file({"unet.down.0.weight": torch.zeros(2, 2)}, str(foreign))
    with pytest.raises(UserError, match="holds no LoRA of the transformer"):
        read_file(foreign, spec, 1.0)

    def check(**settings):
        config = Config.model_validate(
            {
                "validation": {"prompts": ["a fox"]},
                "validation_stack": {"loras": [str(path)], **settings.pop("stack", {})},
                **settings,
            }
        )
        Parts(config)["validation_stack"].check(spec, 2)

    check()
    with pytest.raises(UserError, match="parallel.tp = 2"):
        check(parallel={"tp": 2})
    with pytest.raises(UserError, match="one per file"):
        check(stack={"strengths": [1.0, 0.5]})
    with pytest.raises(UserError, match="set validation.prompts"):
        check(validation={"prompts": []})
