"""What the trainer's tests share: a precomputed 'keep' window of the tiny LTX-Video preset."""

from __future__ import annotations

import pytest

from vt.shared.config import load_config

from helpers.cli_runs import write_config


@pytest.fixture(scope="module")
def kept_window(tmp_path_factory, tiny_model_factory, raw_shards):
    """A precomputed 'keep' window the module's runs re-read (precompute once, train many times); one per module, so
    no two modules' trainers write one window's consumer state."""
    from vt.precompute.service import Precompute

    root = tmp_path_factory.mktemp("kept")
    config = write_config(
        root / "pre.toml",
        tiny_model_factory("ltx-video"),
        raw_shards,
        root / "pre",
        str(root / "window"),
        window={"size": "keep"},
        precompute={"workers": 0},
    )
    Precompute(load_config(config)).run()
    return root / "window"
