"""`vt-train env`: the bug-report block names every version and what this machine can run."""

from __future__ import annotations

import importlib.metadata

import torch
from typer.testing import CliRunner

from vt.train.cli import app


def test_env_prints_versions_gpus_backends_and_fp8_recipes():
    result = CliRunner().invoke(app, ["env"])
    assert result.exit_code == 0, result.output
    lines = dict(line.split(":", 1) for line in result.output.splitlines())
    fields = {name.strip(): value.strip() for name, value in lines.items()}
    for package in ("torch", "diffusers", "transformers", "peft", "av"):
        assert fields[package] == importlib.metadata.version(package)
    assert fields["vt"] == importlib.metadata.version("vt")
    import av

    assert fields["ffmpeg (PyAV)"].startswith(f"FFmpeg {av.ffmpeg_version_info} (libavcodec ")
    assert fields["cuda (torch)"] == (torch.version.cuda or "none (CPU build)")
    if torch.cuda.is_available():
        assert fields["gpus"].startswith("cuda:0 ")
    else:  # this suite's machines: CPU only, so the CPU's answers
        assert fields["gpus"] == "none (CPU only)"
        assert fields["attention backends, training (cpu)"] == "native, native_math"
        assert fields["attention backends, inference (cpu)"] == "native, native_math, flex"
        assert fields["fp8 training recipes"].startswith("none: float8 training needs a CUDA GPU of sm89+")
