"""What Kandinsky 5 and 6 store and read beside Qwen's text and the latents: CLIP's pooled embedding, the i2v first
frame's latents, and each caption's text rows (their transformers take no text mask)."""

from __future__ import annotations

from torch import Tensor

from vt.shared.caption_table import mask_rows
from vt.shared.errors import UserError


def pooled_and_image_shapes(spec, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """`shapes` with CLIP's pooled embedding and, for i2v, the first frame's latents (C, 1, H, W): what Kandinsky 5
    and 6 store beside Qwen's text and the latents."""
    shapes = {**shapes, "pooled_prompt_embeds": (spec.text_width("text_encoder_2"),)}
    if spec.config.task == "i2v":
        shapes["image_latents"] = (shapes["latents"][0], 1, *shapes["latents"][2:])
    return shapes


def with_image_latents(spec, encoders, video: Tensor, out: dict[str, Tensor]) -> dict[str, Tensor]:
    """`out` with, for i2v, `image_latents`: the first frame encoded alone (mode x scaling_factor; the VAE's group
    norms span all frames, so the clip's first latent frame is not the image's)."""
    if spec.config.task == "i2v":
        vae = encoders["vae"]
        out["image_latents"] = (spec._vae_mode(vae, video[:, :, :1]) * vae.config.scaling_factor).float()
    return out


def caption_lengths(mask: Tensor) -> list[int]:
    """Each sample's text rows (`mask_rows`); an empty caption (all-zero mask) is refused."""
    lengths = mask_rows(mask)
    empty = [row for row, length in enumerate(lengths) if length == 0]
    if empty:
        raise UserError(f"samples {empty} have no text rows (an all-zero prompt_attention_mask): stage 1 stores "
                         "at least the template's closing token per caption; re-run stage 1 for these shards")
    return lengths
