"""Worker of tests/shared/test_skyreels_v2.py's context-parallel check, and the case it runs: started by path as
torchrun's ranks, forked from the warm interpreter (tests/helpers/forkserver.py); each rank runs one LoRA step of the
diffusion-forcing transformer under CP (Ulysses) and saves its loss and LoRA gradients to OUT_DIR/rank<rank>.pt."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers package

import torch  # noqa: E402

from helpers.lora_init import randomise_lora  # noqa: E402


def cp_case(folder: str):
    """The DF spec (text of 16 tokens), its LoRA transformer (random factors) and two samples of 3 latent frames
    (96 tokens): a frame count cp = 2 does not divide, a token count it does."""
    from vt.shared.config import ModelConfig
    from vt.shared.models import build_spec

    config = ModelConfig(family="skyreels-v2", path=folder, max_text_tokens=16, diffusion_forcing=True)
    spec = build_spec(config, frame_rate=8.0)
    model = spec.load_transformer()
    spec.add_lora(model, rank=4, alpha=4.0, targets=["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj"])
    randomise_lora(model, seed=6, scale=0.1)
    g = torch.Generator().manual_seed(9)
    latents = torch.randn(2, 16, 3, 8, 8, generator=g)
    batch = {"latents": latents, "prompt_embeds": torch.randn(2, 8, 64, generator=g)}
    return spec, model, (batch, torch.rand(2, 3, generator=g), torch.randn(latents.shape, generator=g))


def cp_step(spec, model, inputs, sync=None) -> dict:
    """One forward and backward: the loss and every trainable parameter's gradient."""
    from vt.train.objectives import flow_matching_loss

    loss = flow_matching_loss(spec.forward(model, *inputs))
    loss.backward()
    if sync is not None:
        sync()
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}}


def worker(rank: int, world: int, store: str, folder: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from vt.train.parallel.cp import apply_cp, average_gradients

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        spec, model, inputs = cp_case(folder)
        apply_cp(model, spec, mesh)
        result = cp_step(spec, model, inputs, lambda: average_gradients(model, mesh))
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":  # one rank (RANK from the environment, as torchrun sets it): WORLD STORE FOLDER OUT_DIR
    world, store, folder, out_dir = sys.argv[1:]
    worker(int(os.environ["RANK"]), int(world), store, folder, out_dir)
