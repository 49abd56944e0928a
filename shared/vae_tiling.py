"""VAE tiling: diffusers' own tiled encode and decode, and when a pass needs it.

A video VAE's untiled pass holds every frame's activations at full resolution at once (HunyuanVideo 1.5
decoding one 121x480x848 clip: about 40 GiB), so both stages tile where the untiled pass would not fit:
- spatially, always through the VAE's `enable_tiling()`;
- temporally where diffusers switches it on with a plain attribute (`use_framewise_encoding` /
  `use_framewise_decoding`: LTX-Video, LTX-2, HunyuanVideo, which defaults to it). A VAE whose framewise
  path is entered through a private method that also changes its padding (Mochi's, CogVideoX's) keeps
  its own chunking: diffusers warns that path changes what the VAE computes. Wan's VAE already runs
  frame chunk by frame chunk with a causal cache.

`decide` applies `precompute.vae_tiling` and `validation.vae_tiling`: true or false as given;
"auto" tiles when the untiled pass's working memory, traced on fake tensors from the VAE's config
(`untiled_peak`, what `vt-train plan` counts), exceeds the memory free for it.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch
from torch import nn

from vt.shared.errors import UserError

Setting = Literal["auto"] | bool
TEMPORAL_FLAGS = ("use_framewise_encoding", "use_framewise_decoding")


def can_tile(vae: nn.Module) -> bool:
    return hasattr(vae, "enable_tiling")


def enable_tiling(vae: nn.Module) -> None:
    """Tile `vae`'s encode and decode, spatially and (where diffusers offers a plain switch) temporally."""
    if not can_tile(vae):
        raise UserError(
            f"the VAE ({type(vae).__name__}) has no tiled encode or decode in diffusers; set the "
            "tiling setting to false and use smaller buckets.sizes"
        )
    vae.enable_tiling()
    if not hasattr(vae, "_enable_framewise_decoding"):  # a private switch: framewise changes the padding there
        for flag in TEMPORAL_FLAGS:
            if hasattr(vae, flag):
                setattr(vae, flag, True)


@contextlib.contextmanager
def tiling(vae: nn.Module, on: bool):
    """`vae` tiled inside the block when `on` (and as it was after it)."""
    before = {name: getattr(vae, name) for name in ("use_tiling", *TEMPORAL_FLAGS) if hasattr(vae, name)}
    if on:
        enable_tiling(vae)
    try:
        yield vae
    finally:
        for name, value in before.items():
            setattr(vae, name, value)


def pass_peak(
    vae: nn.Module, what: Literal["encode", "decode"], shape: tuple[int, ...], tiled: bool = False, run=None
) -> int:
    """The most bytes `vae` (built on the meta device, e.g. `spec.empty_component("vae")`) holds while it
    encodes a video of `shape` (batch, channels, frames, height, width) or decodes latents of `shape`, beyond
    its weights: traced on fake tensors, nothing computed. `run(vae, x)` replaces the plain encode or decode
    (a family's own encoding). A decode that needs more than the latents counts 0."""
    from vt.shared.memory_trace import fake_mode, fake_parameters, peak_bytes

    with fake_mode(), tiling(vae, tiled):
        fake_parameters(vae).eval().requires_grad_(False)
        x = torch.zeros(*shape, dtype=vae.dtype)
        with peak_bytes() as traced, torch.no_grad():
            try:
                if run is not None:
                    run(vae, x)
                elif what == "encode":
                    vae.encode(x)
                else:
                    vae.decode(x)
            except (TypeError, RuntimeError, ValueError, NotImplementedError):
                if what == "encode" or run is not None:
                    raise
        return traced.peak


def decide(setting: Setting, untiled: int, free: int | None, tileable: bool) -> tuple[bool, str]:
    """Whether to tile, and why: `setting` as given, or for "auto" whether `untiled` bytes of working memory
    exceed `free` (None: no limit known, the untiled pass runs)."""
    if setting is True:
        return True, "asked for"
    if setting is False or not tileable:
        return False, "asked not to" if setting is False else "the VAE cannot tile"
    if free is None or untiled <= free:
        return False, f"the untiled pass ({_gib(untiled)}) fits" + (f" in {_gib(free)}" if free is not None else "")
    return True, f"the untiled pass ({_gib(untiled)}) does not fit in the {_gib(free)} free"


def free_device_memory(device: torch.device) -> int | None:
    """Bytes a new pass can take on `device` now: a GPU's free memory plus what its caching allocator holds
    unused; None on a CPU (host memory: "auto" does not tile there)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _gib(value: int) -> str:
    return f"{value / 2**30:.1f} GiB"


__all__ = ["can_tile", "enable_tiling", "tiling", "pass_peak", "decide", "free_device_memory"]
