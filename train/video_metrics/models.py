"""The metric models: a checkpoint of its field loaded through transformers, as its model card loads it.

`Encoder(key, name, device)` loads `name` (a local folder or a hub id) with `AutoModel` and `AutoProcessor`, so any
checkpoint of a supported kind works: CLIP and SigLIP (images and text), DINOv2 (images), CLAP (sound and text).
Embeddings are the checkpoint's own: `get_image_features` / `get_text_features` / `get_audio_features` (the
projected embeddings) where the model has them, else its pooled output (DINOv2: the normalized class token); every
embedding comes back unit length, so a dot product is a cosine similarity.
"""

from __future__ import annotations

import numpy as np
import torch

from vt.shared.errors import UserError

BATCH = 16  # images per forward


def check_checkpoint(key: str, name: str) -> None:
    """Stop at start-up, not at the first validation, when `name` can be neither loaded from a folder nor (offline)
    from the Hugging Face cache."""
    import os
    from pathlib import Path

    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    folder = Path(name).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise UserError(f"metrics.{key} = {name!r}: the folder holds no config.json (save_pretrained's layout)")
        return
    try:
        cached = isinstance(try_to_load_from_cache(name, "config.json"), str)
    except HFValidationError:
        raise UserError(f"metrics.{key} = {name!r}: neither a checkpoint folder nor a hub id (owner/name)") from None
    if not cached and os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise UserError(
            f"metrics.{key} = {name!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: download it "
            "first (huggingface-cli download), or give its folder"
        )


def _pooled(out) -> torch.Tensor:
    """A features call's tensor: transformers 5 returns the projected embeddings as `pooler_output` of an output
    object, older versions the tensor itself."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


class Encoder:
    def __init__(self, key: str, name: str, device: torch.device):
        from transformers import AutoModel, AutoProcessor

        try:
            self.model = AutoModel.from_pretrained(name).to(device).eval()
            self.processor = AutoProcessor.from_pretrained(name)
        except OSError as err:
            raise UserError(
                f"metrics.{key} = {name!r}: cannot load it ({err}); give a checkpoint folder, or a hub id that is in "
                "the Hugging Face cache (or reachable without HF_HUB_OFFLINE)"
            ) from err
        self.key, self.device = key, device
        # SigLIP was trained on text padded to the tokenizer's full length; CLIP and CLAP pad to the longest.
        self.padding = "max_length" if self.model.config.model_type == "siglip" else True

    @property
    def kind(self) -> str:
        return self.model.config.model_type

    def _inputs(self, **kwargs) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device) for k, v in self.processor(**kwargs, return_tensors="pt").items()}

    @torch.inference_mode()
    def images(self, frames: np.ndarray) -> torch.Tensor:
        """(N, D) unit embeddings of N (H, W, 3) uint8 frames."""
        out = []
        for start in range(0, len(frames), BATCH):
            pixels = self._inputs(images=list(frames[start : start + BATCH]))["pixel_values"]
            if hasattr(self.model, "get_image_features"):
                out.append(_pooled(self.model.get_image_features(pixel_values=pixels)))
            else:
                out.append(_pooled(self.model(pixel_values=pixels)))
        return torch.nn.functional.normalize(torch.cat(out).float(), dim=-1).cpu()

    @torch.inference_mode()
    def texts(self, texts: list[str]) -> torch.Tensor:
        """(N, D) unit embeddings of N texts."""
        if not hasattr(self.model, "get_text_features"):
            raise UserError(
                f"metrics.{self.key}: a {self.kind} checkpoint has no text encoder; give a CLIP or SigLIP one"
            )
        inputs = self._inputs(text=texts, padding=self.padding, truncation=True)
        inputs = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
        return torch.nn.functional.normalize(_pooled(self.model.get_text_features(**inputs)).float(), dim=-1).cpu()

    @torch.inference_mode()
    def sounds(self, waveforms: list[np.ndarray]) -> torch.Tensor:
        """(N, D) unit embeddings of N mono waveforms at `self.sample_rate`."""
        if not hasattr(self.model, "get_audio_features"):
            raise UserError(f"metrics.{self.key}: a {self.kind} checkpoint has no audio encoder; give a CLAP one")
        inputs = self._inputs(audio=waveforms, sampling_rate=self.sample_rate)
        return torch.nn.functional.normalize(_pooled(self.model.get_audio_features(**inputs)).float(), dim=-1).cpu()

    @property
    def sample_rate(self) -> int:
        return int(self.processor.feature_extractor.sampling_rate)
