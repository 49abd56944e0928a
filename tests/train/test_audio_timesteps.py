"""Noise per modality (`model.audio_timesteps`, `model.audio_shift`): the audio stream's sigma shared with the
video's (each family's default, as its pipeline pairs them) or drawn on its own key per sample, and what each
family's transformer is then fed."""

from __future__ import annotations

import pytest
import torch

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig
from vt.shared.models import build_spec
from vt.train.parallel.batching import Slice, draw_audio_sigmas, draw_inputs


def part(rows: int, first: int) -> Slice:
    return Slice("b", 0, [f"k{i}" for i in range(rows)], {"latents": torch.zeros(rows, 2, 1, 2, 2)}, first, rows)


def test_independent_audio_sigmas_are_keyed_per_sample_and_leave_the_video_draws_alone():
    whole = draw_audio_sigmas(part(4, 0), 7, 3, "logit_normal", 1.0)
    halves = torch.cat(
        [
            draw_audio_sigmas(part(2, 0), 7, 3, "logit_normal", 1.0),
            draw_audio_sigmas(part(2, 2), 7, 3, "logit_normal", 1.0),
        ]
    )
    assert torch.equal(whole, halves) and whole.shape == (4,)  # any data-parallel slicing draws the same
    video, _ = draw_inputs(part(4, 0), 7, 3, "logit_normal", 1.0)
    assert not torch.allclose(video, whole)  # a key of their own, not the video's sigmas
    shifted = draw_audio_sigmas(part(4, 0), 7, 3, "logit_normal", 3.0)
    torch.testing.assert_close(shifted, 3 * whole / (1 + 2 * whole))  # model.audio_shift: the usual resolution shift


def test_families_say_which_audio_timesteps_they_take(tiny_model_factory):
    for family, modes in (
        ("ltx-2", ("shared", "independent")),
        ("minimax-h3", ("shared", "independent")),
        ("kandinsky6", ("shared",)),
    ):
        spec = build_spec(ModelConfig(family=family, path=str(tiny_model_factory(family)), audio=True), 24.0)
        assert spec.sound.timestep_modes == modes and spec.audio_timesteps == "shared"  # the default: shared
    with pytest.raises(
        ValueError,
        match=r"audio_timesteps = 'independent': the 'kandinsky6' transformer takes "
        r"'shared' audio timesteps",
    ):
        build_spec(
            ModelConfig(
                family="kandinsky6",
                path=str(tiny_model_factory("kandinsky6")),
                audio=True,
                audio_timesteps="independent",
            ),
            24.0,
        )
    h3 = build_spec(
        ModelConfig(
            family="minimax-h3", path=str(tiny_model_factory("minimax-h3")), audio=True, audio_timesteps="independent"
        ),
        24.0,
    )
    assert h3.audio_timesteps == "independent" and h3.sound.default_shift == 3.0  # its audio scheduler's


def seen_by(transformer) -> dict:
    seen: dict = {}
    transformer.register_forward_pre_hook(lambda module, args, kwargs: seen.update(kwargs), with_kwargs=True)
    return seen


def test_ltx2_feeds_the_audio_stream_its_own_timestep(tiny_model_factory):
    spec = build_spec(
        ModelConfig(
            family="ltx-2",
            path=str(tiny_model_factory("ltx-2")),
            audio=True,
            max_text_tokens=16,
            audio_timesteps="independent",
        ),
        12.0,
    )
    encoders = spec.load_stage1()
    generator = torch.Generator().manual_seed(0)
    video = torch.rand(2, 3, 9, 64, 96, generator=generator) * 2 - 1
    batch = {**spec.encode_text(encoders, ["a cat", "a dog"]), **spec.encode_video(encoders, video)}
    batch["audio_latents"] = torch.randn(2, 2, 19, 2, generator=generator)
    batch["audio_noise"] = torch.randn(2, 2, 19, 2, generator=generator)
    transformer = spec.load_transformer()
    seen = seen_by(transformer)
    sigmas = torch.tensor([0.3, 0.8])
    noise = torch.randn(batch["latents"].shape, generator=generator)
    shared = spec.forward(transformer, dict(batch), sigmas, noise)
    assert torch.equal(seen["audio_timestep"], seen["timestep"])
    apart = spec.forward(transformer, {**batch, "audio_sigmas": torch.tensor([0.9, 0.1])}, sigmas, noise)
    torch.testing.assert_close(seen["audio_timestep"], torch.tensor([900.0, 100.0]))
    torch.testing.assert_close(seen["audio_sigma"], torch.tensor([900.0, 100.0]))
    torch.testing.assert_close(seen["timestep"], sigmas * 1000)  # the video's unchanged
    torch.testing.assert_close(apart.audio.target, shared.audio.target)  # noise - x0 at any sigma
    assert not torch.allclose(apart.audio.prediction, shared.audio.prediction)


def test_minimax_h3_rows_take_the_audio_sigma_given(tiny_model_factory):
    spec = build_spec(
        ModelConfig(
            family="minimax-h3",
            path=str(tiny_model_factory("minimax-h3")),
            audio=True,
            max_text_tokens=16,
            audio_timesteps="independent",
        ),
        24.0,
    )
    encoders = spec.load_stage1()
    generator = torch.Generator().manual_seed(1)
    bucket = Bucket(5, 64, 96)
    shape = spec.latent_shape(bucket)
    batch = {**spec.encode_text(encoders, ["a cat"]), "latents": torch.randn(1, *shape, generator=generator)}
    audio_shape = spec.sound.latent_shape(bucket)
    batch["audio_latents"] = torch.randn(1, *audio_shape, generator=generator)
    batch["audio_noise"] = torch.randn(1, *audio_shape, generator=generator)
    transformer = spec.load_transformer()
    seen = seen_by(transformer)
    sigmas, noise = torch.tensor([0.5]), torch.randn(1, *shape, generator=generator)
    spec.forward(transformer, dict(batch), sigmas, noise)
    paired = float(spec.audio_sigmas(sigmas)[0])  # shared: the audio schedule's sigma at the video's point
    assert {round(t, 5) for t in seen["timestep"].flatten().tolist()} == {0.5, round(1 - paired, 5)} and paired < 0.5
    spec.forward(transformer, {**batch, "audio_sigmas": torch.tensor([0.2])}, sigmas, noise)
    assert {round(t, 5) for t in seen["timestep"].flatten().tolist()} == {0.5, 0.8}  # t = 1 - sigma per stream


def test_the_trainer_draws_the_audio_sigmas_it_is_asked_for(tmp_path, tiny_model_factory, sound_shards, monkeypatch):
    """A run with independent audio timesteps hands `forward` each sample's own audio sigma (at model.audio_shift),
    a shared run none; the video's sigmas are the same in both."""
    from vt.precompute.service import Precompute
    from vt.shared.config import load_config
    from vt.train.trainer import Trainer

    from helpers.cli_runs import write_config

    model = {"family": "ltx-2", "max_text_tokens": 16, "audio": True}
    common = dict(
        buckets={"sizes": ["9x64x64"], "fps": 12.0},
        window={"size": "keep"},
        train={"batch_size": 2, "max_steps": 1, "checkpoint_every": 0},
        log={"progress": False},
    )
    folder = tiny_model_factory("ltx-2")
    config = write_config(
        tmp_path / "pre.toml",
        folder,
        sound_shards,
        tmp_path / "pre",
        str(tmp_path / "window"),
        model=model,
        precompute={"workers": 0},
        **common,
    )
    Precompute(load_config(config)).run()
    seen = {}
    for mode in ("shared", "independent"):
        run = write_config(
            tmp_path / f"{mode}.toml",
            folder,
            sound_shards,
            tmp_path / mode,
            str(tmp_path / "window"),
            model={**model, "audio_timesteps": mode, "audio_shift": 2.0},
            **common,
        )
        trainer = Trainer(load_config(run))
        forward = trainer.spec.forward

        def record(transformer, batch, sigmas, noise, generators=None, _mode=mode, _forward=forward):
            seen[_mode] = (sigmas.clone(), batch.get("audio_sigmas"))
            return _forward(transformer, batch, sigmas, noise, generators)

        monkeypatch.setattr(trainer.spec, "forward", record)
        trainer.run()
    (video, none), (same_video, audio) = seen["shared"], seen["independent"]
    assert none is None and torch.equal(video, same_video)
    first = Slice("b", 0, ["a", "b"], {"latents": torch.zeros(2, 1, 1, 1, 1)}, 0, 2)
    expected = draw_audio_sigmas(first, 0, 0, trainer.loss_path.flow.sigma_sampling, 2.0)  # LTX-2's default scheme
    assert trainer.loss_path.flow.sigma_sampling == "stretched_logit_normal"
    torch.testing.assert_close(audio.cpu(), expected)
