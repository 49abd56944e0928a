import tomllib
from pathlib import Path

import pytest

from vt.shared.config import Config, ConfigError, build, load_config, parse_override, to_toml


def test_defaults_and_overrides_are_typed():
    config = load_config(None, ["window.size=\"keep\"", "train.lr=3e-4", "train.batch_size=4",
                                "model.components.vae=\"some/vae\"", "buckets.sizes=[\"9x64x64\"]", "buckets.fps=12"])
    assert config.window.size == "keep"
    assert config.train.lr == 3e-4 and config.train.batch_size == 4
    assert config.model.components == {"vae": "some/vae"}
    assert config.buckets.sizes == ["9x64x64"]
    assert isinstance(config.buckets.fps, float) and config.buckets.fps == 12.0


def test_file_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\nlr = 0.5\nepochs = 2\n[window]\nsize = 3\n')
    config = load_config(path, ["train.epochs=5"])
    assert (config.train.lr, config.train.epochs, config.window.size) == (0.5, 5, 3)


def test_unquoted_string_override_is_kept_as_text():
    assert parse_override("model.path=Lightricks/LTX-Video") == (["model", "path"], "Lightricks/LTX-Video")


@pytest.mark.parametrize("override, message", [
    ("train.lrr=1", "unknown key 'train.lrr'"),
    ("trian.lr=1", "unknown key 'trian'"),
    ("train.mode=\"qlora\"", "choose one of ['lora', 'full']"),
    ("train.batch_size=1.5", "train.batch_size must be an integer"),
    ("window.size=\"forever\"", "'keep'"),
    ("log.wandb=1", "log.wandb must be true or false"),
    ("train=1", "train is a section"),
    ("novalue", "--set expects key=value"),
])
def test_bad_values_name_the_key_and_what_is_allowed(override, message):
    with pytest.raises(ConfigError, match=None) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_missing_file_says_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_resolved_config_round_trips_through_toml():
    config = load_config(None, ["model.components.transformer=\"x/y\"", "train.validation_prompts=[\"a \\\"q\\\"\"]"])
    assert build(Config, tomllib.loads(to_toml(config)), "") == config


CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_are_valid_and_their_buckets_fit_the_family(path):
    from vt.shared.buckets import parse_buckets
    from vt.shared.models import get_spec_class

    config = load_config(path)
    assert get_spec_class(config.model.family).family == config.model.family
    rule = {"ltx-video": (8, 32), "wan": (4, 16)}[config.model.family]
    for bucket in parse_buckets(config.buckets.sizes):
        assert (bucket.frames - 1) % rule[0] == 0 and bucket.height % rule[1] == 0 and bucket.width % rule[1] == 0


def test_demo_config_is_valid():
    config = load_config(CONFIGS[0].with_name("demo.toml"))
    assert config.window.size == 2 and config.model.family == "ltx-video"
