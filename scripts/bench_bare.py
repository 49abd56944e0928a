"""The baseline of the training benchmarks: a bare PyTorch loop that imports nothing from vt.

It trains the same diffusers LTX-Video transformer with the same peft LoRA, the same AdamW and the
same flow-matching math the trainer uses (logit-normal sigmas and Gaussian noise from a seeded
generator; x_t = (1 - s) x0 + s noise; the transformer on packed tokens; MSE against noise - x0;
backward, clip, step), written out by hand, so what `vt.train` adds on top of it is what the
benchmark measures. `step` can also take the sigmas and noise from outside: the benchmark feeds it
the very draws the trainer made, and the two must then report the same losses, which is the check
that both do the same work.

Run as a script, it is the launch baseline: process start -> imports -> load -> steps on batches
read from a window's shard files, printing the wall-clock end time of every step as JSON.

    python scripts/bench_bare.py --transformer DIR --window DIR [--batch-size 2] [--steps 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

NUM_TRAIN_TIMESTEPS = 1000


@dataclass
class BareSettings:
    """What both sides must agree on; the benchmark fills it from the trainer's own config."""

    seed: int = 0
    lora_rank: int = 16
    lora_alpha: float = 16.0
    lora_targets: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    rope_scale: tuple[float, float, float] = (8 / 8.0, 32.0, 32.0)  # (VAE time / buckets.fps, space, space)
    device: str = "cpu"
    amp_dtype: torch.dtype | None = None  # autocast dtype (bf16 on a GPU), None for plain fp32


class BareLoop:
    """One LTX transformer with LoRA and AdamW; `step(batch)` is one optimizer step on one batch."""

    def __init__(self, transformer_dir: str | Path, settings: BareSettings):
        from diffusers import LTXVideoTransformer3DModel
        from peft import LoraConfig

        self.settings = settings
        self.device = torch.device(settings.device)
        torch.manual_seed(settings.seed)  # LoRA init draws from the global RNG, as in the trainer
        model = LTXVideoTransformer3DModel.from_pretrained(str(transformer_dir), torch_dtype=torch.float32)
        model = model.to(self.device)
        model.requires_grad_(False)
        model.add_adapter(
            LoraConfig(
                r=settings.lora_rank,
                lora_alpha=settings.lora_alpha,
                target_modules=list(settings.lora_targets),
                init_lora_weights=True,
            )
        )
        model.train()
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=settings.lr, weight_decay=settings.weight_decay)
        self.step_index = 0

    @torch.no_grad()
    def copy_trainable(self, source: torch.nn.Module) -> None:
        """Start from `source`'s adapter values (the trainer's own LoRA init) instead of this loop's draw."""
        values = dict(source.named_parameters())
        for name, param in self.model.named_parameters():
            if param.requires_grad:
                param.copy_(values[name].detach())

    def step(
        self, batch: dict[str, torch.Tensor], sigmas: torch.Tensor | None = None, noise: torch.Tensor | None = None
    ) -> float:
        """One optimizer step; draws its own sigmas (B,) and noise (like the latents) unless given."""
        s = self.settings
        x0 = batch["latents"].to(self.device).float()
        text = batch["prompt_embeds"].to(self.device)
        mask = batch["prompt_attention_mask"].to(self.device)
        if sigmas is None or noise is None:
            generator = torch.Generator().manual_seed(s.seed * 1_000_003 + self.step_index)
            sigmas = torch.sigmoid(torch.randn(x0.shape[0], generator=generator))
            noise = torch.randn(x0.shape, generator=generator, dtype=torch.float32)
        sigmas, noise = sigmas.to(x0).flatten(), noise.to(x0)
        sig = sigmas.view(-1, 1, 1, 1, 1)
        noisy = (1 - sig) * x0 + sig * noise
        b, c, f, h, w = noisy.shape
        tokens = noisy.permute(0, 2, 3, 4, 1).reshape(b, f * h * w, c)  # frame-major tokens, patch 1
        with torch.autocast(self.device.type, dtype=s.amp_dtype or torch.float32, enabled=s.amp_dtype is not None):
            out = self.model(
                hidden_states=tokens,
                encoder_hidden_states=text,
                timestep=sigmas * NUM_TRAIN_TIMESTEPS,
                encoder_attention_mask=mask,
                num_frames=f,
                height=h,
                width=w,
                rope_interpolation_scale=s.rope_scale,
                return_dict=False,
            )[0]
        prediction = out.reshape(b, f, h, w, c).permute(0, 4, 1, 2, 3)
        loss = ((prediction.float() - (noise - x0)) ** 2).mean()
        loss.backward()
        value = loss.item()
        torch.nn.utils.clip_grad_norm_(self.params, s.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_index += 1
        return value


def read_shard(path: Path) -> dict[str, torch.Tensor]:
    """A shard's tensors, one row per sample: its caption table (each caption's kept rows, `text_rows.*`
    counts, `text_index` per sample, full lengths in the metadata) padded back with zeros by hand."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        stored = {name: f.get_tensor(name) for name in f.keys()}
        lengths = json.loads(f.metadata().get("text_lengths", "{}"))
    out = {n: t for n, t in stored.items() if not n.startswith(("text.", "text_rows.")) and n != "text_index"}
    for name, full in lengths.items():
        rows, kept = stored[f"text.{name}"], stored[f"text_rows.{name}"].tolist()
        table = rows.new_zeros((len(kept), full, *rows.shape[1:]))
        starts = [sum(kept[:c]) for c in range(len(kept))]
        for caption, (start, n) in enumerate(zip(starts, kept)):
            table[caption, :n] = rows[start : start + n]
        out[name] = table[stored["text_index"]]
    return out


def window_batches(window: Path, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of a local vt window's shards (producer 0, in commit order), each read when it is
    needed as a plain safetensors file, over and over. A shard holds one bucket; its rows are cut
    into batches (the trainer also joins same-bucket remainders, so a few batches may differ)."""
    commits = sorted((Path(window) / "commits" / "p0").glob("*.json"))
    if not commits:
        raise SystemExit(f"no commit records under {window}/commits/p0: run vt-precompute into that window first")
    while True:
        for path in commits:
            tensors = read_shard(Path(window) / json.loads(path.read_text())["data"])
            rows = next(iter(tensors.values())).shape[0]
            for start in range(0, rows, batch_size):
                yield {name: t[start : start + batch_size].float() for name, t in tensors.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="bare PyTorch launch baseline: start -> LoRA steps on a window")
    parser.add_argument("--transformer", type=Path, required=True, help="diffusers LTX transformer folder")
    parser.add_argument("--window", type=Path, required=True, help="a local vt window (read as plain files)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # what the trainer's train.device = "auto" picks
    amp = torch.bfloat16 if device == "cuda" and torch.cuda.is_bf16_supported() else None
    loop = BareLoop(args.transformer, BareSettings(device=device, amp_dtype=amp))
    batches = window_batches(args.window, args.batch_size)
    done, losses = [], []
    for _ in range(args.steps):
        losses.append(loop.step(next(batches)))
        if device == "cuda":
            torch.cuda.synchronize()
        done.append(time.time())  # wall clock, like the trainer's metrics.jsonl "time"
    print(json.dumps({"step_done": done, "losses": losses}), flush=True)


if __name__ == "__main__":
    main()
