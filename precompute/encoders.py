"""Stage 1's encoders at real size: each loaded once, in model.dtype (float32 on a CPU), straight where it runs.

`precompute.text_encoder_offload` decides where the text (and image) encoders live, for encoders that do
not fit on the device beside the VAE's work:
- "none": on the device, with the VAE (small models, or a GPU with room for both);
- "model": in host memory (one arena per encoder, exactly its bytes, page-locked on a GPU: HostCopy); a text phase
  copies them onto the device, encodes the new captions of the next `precompute.text_phase_shards` full shards (a
  shard's worth of captions per batch, so the encoder works in what one shard's phase took) and drops the device
  copies (nothing is copied back: the weights are frozen) before the VAE runs. For an encoder that fits on the GPU
  alone but not beside a VAE encoding long, high-resolution clips;
- "blocks": in CPU memory, streamed onto the device block by block as they run (diffusers' group
  offloading, with a CUDA stream prefetching the next block): an encoder larger than the GPU
  (MiniMax H3's 32B Qwen3-VL, 64 GB in bf16) runs on any GPU, at the cost of moving its weights
  once per call of the family's text encoding (the new captions of `precompute.text_phase_shards` shards are one
  call; MiniMax H3's encodes caption by caption). Captions are encoded once each (text cache), so this is
  rarely the bottleneck.
Why not shard the encoder over the producers (FSDP2 in lockstep): producers are independent processes
that start, stop and restart on their own; a collective text encoder would tie every producer to the
slowest and stop all of them when one dies. The choice keeps each producer self-contained.

`precompute.vae_tiling` encodes clips in overlapping tiles (diffusers' own tiling, spatial and where the VAE
offers it temporal: vt.shared.vae_tiling), so long or high-resolution clips fit: `true` tiles every bucket,
`false` none, and the default "auto" tiles the buckets whose untiled encode, traced on fake tensors as
`vt-train plan` traces it, would not fit in the GPU memory free once the encoders are loaded (on a CPU
"auto" does not tile). Tiling changes the latents slightly: `true` is part of the shards' provenance, and
each producer logs which buckets "auto" tiles. A clip that still cannot be encoded stops the run with what
to change (`VaeOutOfMemory`).

A family that trains audio (model.audio) also loads its audio encoder (`spec.sound.components`) beside the
VAE, on the device and in float32 whatever model.dtype says (as reference trainers encode audio: a mel
spectrogram's log range suffers in bf16, and audio encoders are small), and `encode_sounds` encodes each
shard's sounds, cut or padded to the bucket's length (`spec.sound.samples`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from vt.shared.errors import UserError
from vt.shared.host_memory import HostBuffer, layout_bytes, views
from vt.shared.log import get_logger
from vt.shared.runtime import encoder_dtype
from vt.shared.vae_tiling import decide, enable_tiling, free_device_memory, pass_peak, tiling

log = get_logger("vt.precompute")


class VaeOutOfMemory(UserError, RuntimeError):
    """The VAE ran out of memory on one clip of a bucket; the message names the settings to change."""


def load_encoders(spec, device: torch.device, offload: str, vae_tiling: bool | str) -> dict:
    """The stage-1 components, each loaded once: the VAE (and audio encoder) on `device`, the text parts per
    `offload`."""
    text_parts = text_components(spec)
    dtype = encoder_dtype(device, spec.frozen_dtype)
    if dtype != spec.frozen_dtype:
        log.info(
            "stage 1 on a CPU: the encoders compute in float32, not model.dtype %s (their reduced-precision "
            "kernels run tens of times slower there)",
            str(spec.frozen_dtype).removeprefix("torch."),
        )
    encoders = {}
    for name in spec.stage1_components:
        on_cpu = name in text_parts and offload != "none"
        audio = spec.config.audio and name in spec.sound.components
        encoders[name] = spec.load_component(name, "cpu" if on_cpu else device, torch.float32 if audio else dtype)
    if offload == "blocks":
        from diffusers.hooks import apply_group_offloading

        for name in text_parts:
            if isinstance(encoders[name], nn.Module):
                apply_group_offloading(
                    encoders[name],
                    onload_device=device,
                    offload_device="cpu",
                    offload_type="block_level",
                    num_blocks_per_group=1,
                    use_stream=device.type == "cuda",
                    block_modules=layer_paths(encoders[name]),
                )
    if vae_tiling is True:
        vae = encoders["vae"]
        if not hasattr(vae, "enable_tiling"):
            raise UserError(
                f"precompute.vae_tiling = true, but the {spec.family} VAE ({type(vae).__name__}) "
                "has no tiled encoding; set precompute.vae_tiling = false"
            )
        enable_tiling(vae)
    if offload != "none":
        log.info(
            "text encoders in CPU memory (precompute.text_encoder_offload = %s): %s",
            offload,
            ", ".join(n for n in text_parts if isinstance(encoders[n], nn.Module)),
        )
    return encoders


def tiled_buckets(spec, encoders: dict, buckets, device: torch.device, setting: bool | str) -> set[str]:
    """The buckets whose clips the VAE encodes tiled (`precompute.vae_tiling`): with "auto", those whose untiled
    encode of one clip, traced on fake tensors, exceeds the device memory free now (encoders loaded)."""
    vae = encoders["vae"]
    if setting is True:
        return {bucket.name for bucket in buckets}
    free = free_device_memory(device)
    if setting is False or free is None or not hasattr(vae, "enable_tiling"):
        return set()
    tiled = set()
    for bucket in buckets:
        untiled = pass_peak(
            spec.empty_component("vae", vae.dtype),
            "encode",
            (1, 3, bucket.frames, bucket.height, bucket.width),
            run=spec.vae_mode,
        )
        tile, why = decide("auto", untiled, free, True)
        log.info(
            "bucket %s: the VAE encodes %s (precompute.vae_tiling = auto: %s)",
            bucket.name,
            "tiled" if tile else "untiled",
            why,
        )
        if tile:
            tiled.add(bucket.name)
    return tiled


def text_components(spec) -> list[str]:
    """The stage-1 components the text phase moves (text and image encoders): all but the VAE and the audio
    encoder, which stay on the device."""
    audio = spec.sound.components if spec.config.audio else ()
    return [name for name in spec.stage1_components if name != "vae" and name not in audio]


def layer_paths(module: nn.Module) -> list[str]:
    """The child names leading to the module's lists of layers (UMT5's `encoder` above `encoder.block`,
    Gemma 3's `model`, `language_model`): group offloading descends through them to stream each layer."""
    lists = [path for path, child in module.named_modules() if isinstance(child, nn.ModuleList) and len(child) > 1]
    outermost = [path for path in lists if not any(path.startswith(f"{other}.") for other in lists)]
    return sorted({name for path in outermost for name in path.split(".")[:-1]})


MOVE_ON_CPU = False  # tests: a CPU run's "model" offload moves the text parts too (through the arena, counted)


def moves_text(device: torch.device, offload: str) -> bool:
    """Whether text phases move the text parts: "model" offload onto a GPU. On a CPU the device is host memory
    already and nothing moves, unless `MOVE_ON_CPU` (the same arena and copies, for tests to count and compare)."""
    return offload == "model" and (device.type != "cpu" or MOVE_ON_CPU)


class HostCopy:
    """A frozen module's weights and buffers in one host arena (vt.shared.host_memory: exactly their bytes, page-
    locked for a CUDA device; torch's caching host allocator would round each tensor up to a power of two), each a
    view of it; copied onto the device for a text phase and dropped after it. The weights never change, so going
    back copies nothing: each parameter and buffer is its host view again and the device copies are freed. Copies in
    are asynchronous (page-locked), half the bytes of `module.to(device)` then `module.to("cpu")`.

    The arena is filled tensor by tensor, each original freed once copied (where nothing else holds it), and
    page-locked only when full (locking commits every page at once), so making it holds the module about once, not
    twice. A tensor held in several places (tied weights) is one view and one copy. Phases nest: an inner one finds
    the module on the device and moves nothing."""

    def __init__(self, module: nn.Module, device: torch.device):
        self.device = device
        self.slots: list[list[tuple]] = []  # per distinct tensor, every (owner, name, kind) holding it
        index: dict[int, int] = {}
        for owner in module.modules():
            for kind, table in (("param", owner._parameters), ("buffer", owner._buffers)):
                for name, tensor in (item for item in table.items() if item[1] is not None):
                    if id(tensor) not in index:
                        index[id(tensor)] = len(self.slots)
                        self.slots.append([])
                    self.slots[index[id(tensor)]].append((owner, name, kind))
        layout = [(t.shape, t.dtype) for t in (self._get(slots[0]) for slots in self.slots)]
        self.arena = HostBuffer(layout_bytes(layout), device, lock_later=True)
        self.host = views(self.arena.bytes, layout)
        for slots, view in zip(self.slots, self.host):
            view.copy_(self._get(slots[0]))
            self._put(slots, view)  # the original is freed here (nothing else holds it)
        self.arena.lock()
        self.depth = 0  # text phases entered and not left
        self.moves = 0  # times copied onto the device (tests and logs)

    @staticmethod
    def _get(slot) -> torch.Tensor:
        owner, name, kind = slot
        return owner._parameters[name] if kind == "param" else owner._buffers[name]

    @staticmethod
    def _put(slots, tensor: torch.Tensor) -> None:
        for owner, name, kind in slots:
            if kind == "param":
                owner._parameters[name].data = tensor
            else:
                owner._buffers[name] = tensor

    def to_device(self) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        self.moves += 1
        for slots, view in zip(self.slots, self.host):  # a copy even where the device is the host (MOVE_ON_CPU)
            self._put(slots, torch.empty_like(view, device=self.device).copy_(view, non_blocking=True))

    def to_host(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            for slots, view in zip(self.slots, self.host):
                self._put(slots, view)


HOST_COPIES: "weakref.WeakKeyDictionary[nn.Module, HostCopy]" = weakref.WeakKeyDictionary()


def _text_modules(encoders: dict, spec) -> list[nn.Module]:
    return [encoders[n] for n in text_components(spec) if isinstance(encoders[n], nn.Module)]


def text_moves(encoders: dict, spec) -> int:
    """How many times the text parts were copied onto the device (text phases that moved them)."""
    return max((HOST_COPIES[m].moves for m in _text_modules(encoders, spec) if m in HOST_COPIES), default=0)


@contextlib.contextmanager
def text_phase(encoders: dict, spec, device: torch.device, offload: str) -> Iterator[None]:
    """Around text encoding: with "model" offload the text parts are on `device` inside the block (copied from
    their host arena, made at the first phase) and only in host memory after it (the device memory freed);
    otherwise nothing moves. Phases nest (the outermost moves). How often a run enters one: at start (the empty
    caption and the validation prompts together), then once per `precompute.text_phase_shards` shards with a
    caption not encoded yet (service.py encodes their captions together)."""
    if not moves_text(device, offload):
        yield
        return
    copies = []
    for module in _text_modules(encoders, spec):
        if module not in HOST_COPIES:
            HOST_COPIES[module] = HostCopy(module, device)
        copies.append(HOST_COPIES[module])
    for copy in copies:
        copy.to_device()
    try:
        yield
    finally:
        for copy in copies:
            copy.to_host()
        if device.type == "cuda" and not any(copy.depth for copy in copies):
            torch.cuda.empty_cache()


def is_out_of_memory(err: BaseException) -> bool:
    """A GPU out-of-memory error, or the CPU allocator failing to allocate (what the CPU says instead)."""
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "can't allocate memory" in str(err)
    )


def encode_videos(
    spec,
    encoders: dict,
    videos: list[torch.Tensor],
    batch: int,
    device: torch.device,
    bucket: str,
    tiled: bool,
    controls: list[torch.Tensor] | None = None,
) -> dict[str, list[torch.Tensor]]:
    """`spec.encode_video` over `videos` in batches of `batch` (with each clip's control video as
    `control=` where `controls` is given: `spec.control_video`), the VAE tiled if `tiled`; a batch that runs
    out of memory is retried one clip at a time, and a clip that still does not fit raises VaeOutOfMemory
    naming what to change."""
    with tiling(encoders["vae"], tiled):
        return _encode_videos(spec, encoders, videos, batch, device, bucket, tiled, controls)


def _encode_videos(spec, encoders, videos, batch, device, bucket, tiled, controls) -> dict[str, list[torch.Tensor]]:
    out: dict[str, list[torch.Tensor]] = {}
    for start in range(0, len(videos), batch):
        group = videos[start : start + batch]
        paired = controls[start : start + batch] if controls is not None else [None] * len(group)
        try:
            control = {} if controls is None else {"control": torch.stack(paired).to(device)}
            parts = [spec.encode_video(encoders, torch.stack(group).to(device), **control)]
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            _free(device)
            parts = [
                _encode_one(spec, encoders, video, device, bucket, tiled, control)
                for video, control in zip(group, paired)
            ]
        for part in parts:
            for name, tensor in part.items():
                out.setdefault(name, []).append(tensor.cpu())
    return out


def encode_sounds(
    spec, encoders: dict, sounds: list[torch.Tensor], bucket, batch: int, device: torch.device
) -> dict[str, list[torch.Tensor]]:
    """`spec.sound.encode` over the samples' `sounds` (channels, samples) in batches of `batch`, each cut or
    padded with silence to `spec.sound.samples(bucket)` (the decoder's rounding is the spec's; this keeps
    the family's length the one truth)."""
    length = spec.sound.samples(bucket)
    fitted = [F.pad(s[:, :length], (0, max(0, length - s.shape[1]))) for s in sounds]
    out: dict[str, list[torch.Tensor]] = {}
    for start in range(0, len(fitted), batch):
        group = torch.stack(fitted[start : start + batch]).to(device, torch.float32)
        for name, tensor in spec.sound.encode(encoders, group).items():
            out.setdefault(name, []).append(tensor.cpu())
    return out


def encode_texts_with_images(
    spec, encoders: dict, captions: list[str], videos: list[torch.Tensor], device: torch.device
) -> dict[str, list[torch.Tensor]]:
    """`spec.text_with_image.encode` of each caption with its clip's first frame, one sample at a time (the
    pipeline's prompt crop handles a caption cut at the text length only in a batch of one)."""
    out: dict[str, list[torch.Tensor]] = {}
    for caption, video in zip(captions, videos):
        first = video[:, 0].unsqueeze(0).to(device)  # (1, 3, H, W) of the clip (3, F, H, W)
        for name, tensor in spec.text_with_image.encode(encoders, [caption], first).items():
            out.setdefault(name, []).append(tensor.cpu())
    return out


def _encode_one(
    spec, encoders, video, device, bucket: str, tiled: bool, control: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    try:
        extra = {} if control is None else {"control": control.unsqueeze(0).to(device)}
        return spec.encode_video(encoders, video.unsqueeze(0).to(device), **extra)
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        _free(device)
        fix = (
            "use smaller buckets.sizes (fewer frames or pixels), or more GPU memory"
            if tiled
            else "set precompute.vae_tiling = true (tiled encoding), or use smaller buckets.sizes"
        )
        raise VaeOutOfMemory(
            f"the {spec.family} VAE ran out of memory encoding one clip of bucket {bucket} on "
            f"{device} ({type(err).__name__}): {fix}"
        ) from err


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
