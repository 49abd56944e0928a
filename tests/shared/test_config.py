import tomllib
from pathlib import Path

import pytest

from vt.shared.config import Config, ConfigError, TrainConfig, build, load_config, parse_override, to_toml

from helpers.family_cases import EXPECTED


def test_defaults_and_overrides_are_typed():
    config = load_config(
        None,
        [
            'window.size="keep"',
            "train.lr=3e-4",
            "train.batch_size=4",
            'model.components.vae="some/vae"',
            'buckets.sizes=["9x64x64"]',
            "buckets.fps=12",
        ],
    )
    assert config.window.size == "keep"
    assert config.train.lr == 3e-4 and config.train.batch_size == 4
    assert config.model.components == {"vae": "some/vae"}
    assert config.buckets.sizes == ["9x64x64"]
    assert isinstance(config.buckets.fps, float) and config.buckets.fps == 12.0


def test_file_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nlr = 0.5\nepochs = 2\n[window]\nsize = 3\n")
    config = load_config(path, ["train.epochs=5"])
    assert (config.train.lr, config.train.epochs, config.window.size) == (0.5, 5, 3)


def test_unquoted_string_override_is_kept_as_text():
    assert parse_override("model.path=Lightricks/LTX-Video") == (["model", "path"], "Lightricks/LTX-Video")


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lrr=1", "unknown key 'train.lrr'"),
        ("trian.lr=1", "unknown key 'trian'"),
        ('train.mode="qlora"', "choose one of ['lora', 'full']"),
        ("train.batch_size=1.5", "train.batch_size = 1.5: must be an integer"),
        ("train.batch_size=true", "train.batch_size = True: must be an integer"),
        ('train.lr="fast"', "train.lr = 'fast': must be a number"),
        ("train.lr=nan", "train.lr = nan: must be a finite number"),
        ('window.size="forever"', "window.size = 'forever': must be an integer >= 1 or \"keep\""),
        ("log.wandb=1", "log.wandb = 1: must be true or false"),
        ("train=1", "train = 1: must be a section"),
        ("novalue", "--set expects key=value"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(override, message):
    with pytest.raises(ConfigError, match=None) as err:
        load_config(None, [override])
    assert message in str(err.value)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.grad_accum=0", "train.grad_accum = 0: must be >= 1"),
        ("train.batch_size=-1", "train.batch_size = -1: must be >= 1"),
        ("train.lr=0", "train.lr = 0: must be > 0"),
        ("train.max_grad_norm=-1.0", "train.max_grad_norm = -1.0: must be >= 0"),
        ("train.epochs=0", "train.epochs = 0: must be >= 1"),
        ("buckets.fps=0", "buckets.fps = 0: must be > 0"),
        ("buckets.sizes=[]", "buckets.sizes = []: must not be empty"),
        ('buckets.sizes=["9x64x96", "9x64"]', "buckets.sizes[1] = '9x64': must look like FRAMESxHEIGHTxWIDTH"),
        ('buckets.sizes=["0x64x64"]', "buckets.sizes[0] = '0x64x64': must look like FRAMESxHEIGHTxWIDTH"),
        ("window.size=0", 'window.size = 0: must be an integer >= 1 or "keep"'),
        ("window.poll_seconds=0", "window.poll_seconds = 0: must be > 0"),
        ("precompute.workers=-1", "precompute.workers = -1: must be >= 0"),
        ("log.every_steps=0", "log.every_steps = 0: must be >= 1"),
        ("parallel.tp=0", "parallel.tp = 0: must be >= 1"),
        (
            "parallel.dp_shard=0",
            'parallel.dp_shard = 0: must be "auto" (replicate if the model fits each device, '
            "else shard), -1 (the rest of the world size) or >= 1",
        ),
        ('parallel.dp_shard="all"', "parallel.dp_shard = 'all': must be \"auto\""),
        ("model.first_frame_noise=2", "model.first_frame_noise = 2: must be >= 0 and <= 1"),
        ("model.max_text_tokens=0", "model.max_text_tokens = 0: must be >= 1"),
        (
            'run.dir="s3://b/x"',
            "run.dir = 's3://b/x': the run folder (checkpoints, metrics, exports, videos) must be "
            "a local or mounted path; object storage is supported for data.raw and window.uri. "
            'Use e.g. run.dir = "runs/my-run"',
        ),
        ('run.dir="gs://b/x"', "run.dir = 'gs://b/x': the run folder"),
    ],
)
def test_out_of_range_values_name_the_key_and_the_range(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_every_problem_gets_one_line():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.grad_accum=0", "buckets.fps=-1", "train.lrr=1"])
    assert sorted(str(err.value).splitlines()) == [
        "buckets.fps = -1: must be > 0",
        "train.grad_accum = 0: must be >= 1",
        f"unknown key 'train.lrr' in train; allowed: {', '.join(sorted(TrainConfig.model_fields))}",
    ]


def test_edge_values_are_accepted():
    config = load_config(
        None,
        [
            "train.max_steps=0",
            "train.max_grad_norm=0",
            "precompute.workers=0",
            "log.every_seconds=0",
            "model.first_frame_noise=1",
            "window.size=1",
            "parallel.dp_shard=4",
            "adapter.alpha=8",
            'run.dir="file:///tmp/run"',
        ],
    )
    assert config.adapter.alpha == 8.0 and isinstance(config.adapter.alpha, float)
    assert config.model.max_text_tokens is None  # unset: the family's default
    assert config.run_dir == Path("/tmp/run")


def test_missing_file_says_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_resolved_config_round_trips_through_toml():
    config = load_config(None, ['model.components.transformer="x/y"', 'validation.prompts=["a \\"q\\""]'])
    assert build(Config, tomllib.loads(to_toml(config)), "") == config
    config = load_config(None, ["model.max_text_tokens=77", 'window.size="keep"', "train.lr=2.5e-5"])
    assert build(Config, tomllib.loads(to_toml(config)), "") == config
    assert build(Config, tomllib.loads(to_toml(Config())), "") == Config()


CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_are_valid_and_their_buckets_fit_the_family(path):
    from vt.shared.buckets import parse_buckets
    from vt.shared.models import get_spec_class

    config = load_config(path)
    assert build(Config, tomllib.loads(to_toml(config)), "") == config
    assert get_spec_class(config.model.family).family == config.model.family
    # (frames = k * step + first, sides a multiple of): each family's real VAE compression x patch, the tiny
    # preset's (family_cases.EXPECTED; MiniMax H3: 17-frame VAE chunks, 17k+5 frames).
    case = EXPECTED[config.model.family]
    step, side = case["frames_step"], case["side"]
    first = int(case.get("frames_rule", f"{step}k+1").rsplit("+", 1)[1])
    for bucket in parse_buckets(config.buckets.sizes):
        assert bucket.frames % step == first % step and bucket.height % side == 0 and bucket.width % side == 0


def test_demo_config_is_valid():
    config = load_config(CONFIGS[0].with_name("demo.toml"))
    assert config.window.size == 2 and config.model.family == "ltx-video"


@pytest.mark.parametrize("stage", ["vt-precompute", "vt-train"])
def test_cli_stops_on_an_out_of_range_value_before_loading_anything(stage):
    import os
    import subprocess
    import sys

    # Python's import log (PYTHONPROFILEIMPORTTIME) shows what the CLI imported before it stopped: no model code.
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / stage),
            "run",
            str(CONFIGS[0].with_name("demo.toml")),
            "--set",
            "train.grad_accum=0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "train.grad_accum = 0: must be >= 1" in result.stderr and "Traceback" not in result.stderr
    imported = {
        line.rpartition("|")[2].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
    }
    assert "vt.shared.config" in imported  # the log is there
    assert not {"diffusers.models", "transformers.modeling_utils", "vt.shared.models.spec"} & imported


def test_a_key_that_moved_to_a_part_section_is_refused_with_its_new_place(tmp_path):
    """Options moved from [train] and [parallel] to their parts' sections (shared/config.py MOVED): an old key stops
    the load with one line per key naming where it went and the value to set there, from a file or --set."""
    from vt.shared.config import MOVED

    path = tmp_path / "old.toml"
    path.write_text("[train]\nlora_rank = 8\nema_decay = 0.99\n[parallel]\nblocks_on_gpu = 4\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value).splitlines() == [
        "train.lora_rank moved to adapter.rank: set adapter.rank = 8 instead (docs/stage2.md)",
        "train.ema_decay moved to ema.decay: set ema.decay = 0.99 instead (docs/stage2.md)",
        "parallel.blocks_on_gpu moved to block_swap.blocks_on_gpu: set block_swap.blocks_on_gpu = 4 instead "
        "(docs/stage2.md)",
    ]
    with pytest.raises(ConfigError, match=r"^train.guidance_scale moved to guidance.scale"):
        load_config(None, ["train.guidance_scale=3.0"])
    config = load_config(None, ["adapter.rank=8", "ema.decay=0.99", "block_swap.blocks_on_gpu=4"])
    assert (config.adapter.rank, config.ema.decay, config.block_swap.blocks_on_gpu) == (8, 0.99, 4)
    for old, new in MOVED.items():  # every new place is a key of its section, and no old key is one any more
        (old_section, old_key), (section, key) = old.split("."), new.split(".")
        assert key in type(getattr(config, section)).model_fields, new
        assert old_key not in type(getattr(config, old_section)).model_fields, old
    assert len(TrainConfig.model_fields) <= 20  # the run's own section: each option has a part's
