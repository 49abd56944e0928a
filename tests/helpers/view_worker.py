"""Worker of test_fsdp_views: a script the test starts as torchrun's ranks (tests/helpers/forkserver.py).

Each rank shards two families' real transformers (tiny sizes) with vt's FSDP2 and trains one step with
torch's "FSDP2-wrapped module ... returned a view tensor" warning made an error, which fails the rank."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist


def wan():
    """Wan 2.1 called as the fp8 test calls it: return_dict=True, so the root returns a BaseOutput."""
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        rope_max_seq_len=1024,
    )
    inputs = dict(
        hidden_states=torch.randn(2, 16, 2, 8, 8),
        timestep=torch.tensor([500.0, 20.0]),
        encoder_hidden_states=torch.randn(2, 8, 32),
        return_dict=True,
    )
    return "wan", model, inputs, lambda out: out.sample


def cogvideox():
    """CogVideoX as its spec calls it (return_dict=False: a tuple); its blocks return (video, text) pairs."""
    from diffusers import CogVideoXTransformer3DModel

    model = CogVideoXTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        time_embed_dim=32,
        text_embed_dim=32,
        num_layers=2,
        sample_width=8,
        sample_height=8,
        sample_frames=5,
        patch_size=2,
        max_text_seq_length=8,
    )
    inputs = dict(
        hidden_states=torch.randn(2, 2, 4, 8, 8),
        encoder_hidden_states=torch.randn(2, 8, 32),
        timestep=torch.tensor([500, 20]),
        return_dict=False,
    )
    return "cogvideox", model, inputs, lambda out: out[0]


def main() -> None:
    """One rank (torchrun's environment): both families sharded over every rank, one step each with the
    view warning an error; prints "<family>: ok, <n> of <n> parameters with gradients" per family."""
    from torch.distributed.device_mesh import init_device_mesh

    from vt.shared.config import ModelConfig
    from vt.shared.models import build_spec
    from vt.train.parallel import apply_fsdp

    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for build in (wan, cogvideox):
            torch.manual_seed(0)
            family, model, inputs, sample = build()
            apply_fsdp(model.train(), build_spec(ModelConfig(family=family), frame_rate=16.0), mesh)
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="FSDP2-wrapped module")  # raises: the rank exits 1
                sample(model(**inputs)).float().pow(2).mean().backward()
            grads = sum(1 for p in model.parameters() if p.grad is not None)
            print(
                f"rank {dist.get_rank()} {family}: ok, {grads} of {len(list(model.parameters()))} parameters "
                "with gradients",
                flush=True,
            )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
