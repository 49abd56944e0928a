"""Tensor parallel and context parallel (Ulysses) match one process, with LoRA: LTX-Video and Wan in every layout,
the families with joint, cross-stream or text-block attention (JOINT) in CP and FSDP2 x CP where they have a CP plan,
and in TP where they have a TP plan (Kandinsky 5, Mochi, HunyuanVideo 1.5 and CogVideoX: this file is where their
TP plans are checked).

Real processes over gloo (this file's ranks forked by tests/helpers/forkserver.py, FileStore), the real tiny
transformers of the presets, fixed random inputs through the spec's own `forward`: the loss and the LoRA gradients of
the first step,
the losses of 3 AdamW steps and the LoRA weights after them must match a single-process run
within relative 1e-4. Layouts: TP 2 and CP 2 (world 2); CP 2 x TP 2, FSDP2 (dp_shard 2) x TP 2 and
FSDP2 x CP 2 (world 4, FSDP2 over dp_shard x cp as the trainer shards). LoRA also sits on the FFN,
so both split directions carry adapters; LTX runs image-to-video, so its per-token timesteps must
be split by context parallel too. The LoRA factors start random (not lora_B = 0), so every
gradient is non-trivial (but for a LoRA on an output nothing reads, whose gradient must stay zero). One world
per family and size runs all its layouts: start-up dominates.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

WORLD_TIMEOUT_S = 240
STEPS = 3
LAYOUTS = {  # name -> mesh dims (sizes in the trainer's order)
    "tp2": {"tp": 2},
    "cp2": {"cp": 2},
    "cp2_tp2": {"cp": 2, "tp": 2},
    "fsdp2_tp2": {"dp_shard": 2, "tp": 2},
    "fsdp2_cp2": {"dp_shard": 2, "cp": 2},
}
FFN = {"ltx-video": "ff", "wan": "ffn"}
# Families with joint video + text attention, fed random stage-1 tensors of their `condition_shapes` at a
# bucket whose token count divides by 4: (task, bucket, LoRA targets: both streams' attention and FFNs).
JOINT = {
    "hunyuan-video": (
        "t2v",
        (5, 32, 32),
        (
            "to_q",
            "to_k",
            "to_v",
            "to_out.0",
            "add_q_proj",
            "add_k_proj",
            "add_v_proj",
            "to_add_out",
            "ff.net.0.proj",
            "ff_context.net.2",
        ),
    ),
    # i2v: the first frame's SigLIP tokens join the text streams in the joint attention.
    "hunyuan-video-1.5": (
        "i2v",
        (5, 32, 32),
        ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "ff.net.0.proj", "ff_context.net.2"),
    ),
    # One joint self-attention over [text, video]: TP only (no CP plan), LoRA on the attention and the FFN so both
    # split directions carry adapters (the trainer-level parity row it replaces trained the same targets).
    "cogvideox": ("t2v", (5, 32, 32), ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2")),
    # Not joint (visual self-attention, cross-attention to the text blocks' output), but fed the same way.
    "mochi": ("t2v", (7, 32, 32), ("to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj", "ff.net.0.proj")),
    # Video only (the audio stream isolated); i2v: per-token timesteps split with the tokens, split rotary tables.
    "ltx-2": ("i2v", (9, 64, 64), ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "ff.net.0.proj")),
    # With audio (whole on every rank): the cross-stream attentions in both directions and the audio stream train.
    "ltx-2-audio": (
        "t2v",
        (9, 64, 64),
        (
            "attn1.to_q",
            "attn1.to_out.0",
            "video_to_audio_attn.to_q",
            "video_to_audio_attn.to_k",
            "video_to_audio_attn.to_v",
            "video_to_audio_attn.to_out.0",
            "audio_to_video_attn.to_q",
            "audio_to_video_attn.to_k",
            "audio_attn1.to_q",
            "audio_ff.net.0.proj",
        ),
    ),
    # One packed [text | audio | video] sequence per sample, its length following the caption: the two samples'
    # lengths differ by 3 rows, so one of them splits unevenly.
    "minimax-h3-audio": ("t2v", (5, 64, 64), ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj")),
    "ltx-2.3-audio": (
        "t2v",
        (9, 64, 64),
        (
            "attn1.to_q",
            "attn1.to_gate_logits",
            "video_to_audio_attn.to_q",
            "video_to_audio_attn.to_gate_logits",
            "audio_to_video_attn.to_q",
        ),
    ),
    "kandinsky5": (
        "i2v",
        (5, 32, 32),
        ("to_query", "to_key", "to_value", "attention.out_layer", "feed_forward.in_layer", "feed_forward.out_layer"),
    ),
}
TEXT_TOKENS = 8
VARIANTS = {
    "ltx-2-audio": ("ltx-2", {"audio": True}),  # key -> (family, model settings)
    "ltx-2.3-audio": ("ltx-2", {"audio": True}),  # LTX-2.3's preset: gated attention (per-head gate logits)
    "minimax-h3-audio": ("minimax-h3", {"audio": True}),
}
FPS = {"minimax-h3-audio": 24.0}  # its audio and video rows share one rotary clock at 24 fps


def _spec(family: str, model_dir):
    from vt.shared.config import ModelConfig
    from vt.shared.models import build_spec

    extra = {"max_text_tokens": TEXT_TOKENS} if family in JOINT else {}
    name, settings = VARIANTS.get(family, (family, {}))
    return build_spec(
        ModelConfig(family=name, path=str(model_dir), task=_task(family), **extra, **settings),
        frame_rate=FPS.get(family, 8.0),
    )


def _task(family: str) -> str:
    return "i2v" if family == "ltx-video" else JOINT[family][0] if family in JOINT else "t2v"


def _batch(family: str, spec=None) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Two samples: latents, text (with padding), sigmas, noise; LTX i2v adds the first-frame latents."""
    g = torch.Generator().manual_seed(7)
    if family in JOINT:
        return _joint_batch(spec, JOINT[family][1], g)
    grid = (3, 4, 4) if family == "ltx-video" else (2, 8, 8)  # 48 and 32 tokens: divide by cp x tp = 4
    latents = torch.randn(2, 16, *grid, generator=g)
    embeds = torch.randn(2, 8, 64, generator=g)
    mask = torch.ones(2, 8)
    mask[1, 5:] = 0
    batch = {"latents": latents, "prompt_embeds": embeds * mask[..., None]}
    if family == "ltx-video":
        batch["prompt_attention_mask"] = mask
        batch["first_frame_latents"] = torch.randn(2, 16, 1, *grid[1:], generator=g)
    sigmas = torch.tensor([0.3, 0.8])
    return batch, sigmas, torch.randn(latents.shape, generator=g)


def _joint_batch(spec, bucket: tuple[int, int, int], g: torch.Generator) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Random tensors of the spec's stage-1 shapes; each text mask pads the second sample's last 3 tokens."""
    from vt.shared.buckets import Bucket

    shapes = spec.condition_shapes(Bucket(*bucket))
    batch = {key: torch.randn(2, *shape, generator=g) for key, shape in shapes.items()}
    for embeds, mask in spec.text_masks.items():
        batch[mask] = torch.ones(2, shapes[mask][0])
        batch[mask][1, -3:] = 0
        batch[embeds] = batch[embeds] * batch[mask][..., None]
    if "audio_latents" in batch:  # the trainer draws the audio noise per sample
        batch["audio_noise"] = torch.randn(batch["audio_latents"].shape, generator=g)
    return batch, torch.tensor([0.3, 0.8]), torch.randn(batch["latents"].shape, generator=g)


def _lora_model(spec, family: str):
    """The tiny transformer with LoRA on attention and FFN, its factors drawn from a fixed seed."""
    model = spec.load_transformer()
    targets = (
        list(JOINT[family][2])
        if family in JOINT
        else ["to_q", "to_k", "to_v", "to_out.0", f"{FFN[family]}.net.0.proj", f"{FFN[family]}.net.2"]
    )
    spec.add_lora(model, rank=4, alpha=4.0, targets=targets)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, param in sorted((n, p) for n, p in model.named_parameters() if p.requires_grad):
            param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    return model


def _train(spec, model, batch, sigmas, noise, sync=None) -> dict:
    """STEPS AdamW steps; losses, the first step's LoRA gradients and the final LoRA weights (full tensors)."""
    from vt.train.objectives import joint_loss

    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([p for _, p in params], lr=1e-3, weight_decay=0.01)
    losses, grads = [], {}
    for step in range(STEPS):
        loss = joint_loss(spec.forward(model, batch, sigmas, noise), 1.0)[0]  # with audio: its loss too
        loss.backward()
        if sync is not None:
            sync()
        if step == 0:
            grads = {n: _full(p.grad) for n, p in params}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "params": {n: _full(p.detach()) for n, p in params}}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.clone()


def _worker(rank: int, world: int, store: str, runs: list[tuple[str, str, str]], out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        for family, model_dir, layout in runs:  # one world runs several layouts and families: start-up dominates
            checks = {"misuse": _misuse, "tp_full": _tp_full_fine_tune}
            result = checks[layout](family, model_dir) if layout in checks else _run_layout(family, model_dir, layout)
            torch.save(result, os.path.join(out_dir, f"{family}-{layout}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run_layout(family: str, model_dir: str, layout: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from vt.train.parallel.cp import apply_cp, average_gradients
    from vt.train.parallel.tp import apply_tp

    dims = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    spec = _spec(family, model_dir)
    batch, sigmas, noise = _batch(family, spec)
    model = _lora_model(spec, family)
    if "tp" in dims:
        apply_tp(model, spec, mesh["tp"])
    if "cp" in dims:
        apply_cp(model, spec, mesh["cp"])
    sync = None
    if "dp_shard" in dims:  # FSDP2 shards over dp_shard (x cp) and averages gradients there, as the trainer does
        from torch.distributed.fsdp import fully_shard

        fsdp_mesh = mesh["dp_shard", "cp"]._flatten("dp_shard_cp") if "cp" in dims else mesh["dp_shard"]
        for block in spec.blocks(model):
            fully_shard(block, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
        row = slice(mesh["dp_shard"].get_local_rank(), None, dims["dp_shard"])  # disjoint samples per dp rank
        batch, sigmas, noise = {k: v[row] for k, v in batch.items()}, sigmas[row], noise[row]
    elif "cp" in dims:
        sync = lambda: average_gradients(model, mesh["cp"])  # noqa: E731
    result = _train(spec, model, batch, sigmas, noise, sync)
    if "dp_shard" in dims:  # each dp rank saw half the batch: the step's loss is the mean over dp ranks
        losses = torch.tensor(result["losses"])
        dist.all_reduce(losses, group=mesh["dp_shard"].get_group())
        result["losses"] = (losses / dims["dp_shard"]).tolist()
    return result


def _misuse(family: str, model_dir: str) -> dict:
    """The error messages of a token count cp does not divide and of TP applied after CP."""
    from torch.distributed.device_mesh import init_device_mesh

    from vt.train.parallel.cp import apply_cp
    from vt.train.parallel.tp import apply_tp

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    spec = _spec(family, model_dir)
    model = _lora_model(spec, family)
    apply_cp(model, spec, mesh)
    batch, sigmas, _ = _batch(family)
    # 3 tokens: one latent frame of 1 x 3 (LTX, patch 1) or 2 x 6 (Wan, patch 2 x 2) latent pixels.
    size = (1, 1, 3) if family == "ltx-video" else (1, 2, 6)
    odd_batch = {k: v[:, :, : size[0], : size[1], : size[2]] if v.ndim == 5 else v for k, v in batch.items()}
    noise = torch.zeros_like(odd_batch["latents"])
    errors = {}
    try:
        spec.forward(model, odd_batch, sigmas, noise)
    except ValueError as err:
        errors["odd_tokens"] = str(err)
    try:
        apply_tp(model, spec, mesh)
    except RuntimeError as err:
        errors["order"] = str(err)
    return errors


def _tp_full_fine_tune(family: str, model_dir: str) -> dict:
    """The error of a full fine-tune under TP whose attention holds a norm shared by every head (trainable)."""
    from torch.distributed.device_mesh import init_device_mesh

    from vt.train.parallel.tp import apply_tp

    spec = _spec(family, model_dir)
    model = spec.load_transformer()
    spec.full_trainable(model)
    try:
        apply_tp(model, spec, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    except ValueError as err:
        return {"error": str(err)}
    return {}


@pytest.fixture(scope="module")
def reference(tiny_model_factory, tmp_path_factory):
    """family -> (model folder, single-process result), computed once per family."""
    from vt.shared.models.ltx2 import LTX2Spec

    cache = {}

    def get(family):
        if family not in cache:
            task = "t2v" if family == "ltx-video" else _task(family)
            from vt.shared.models.presets.ltx2 import parts_23

            model_dir = (
                LTX2Spec.make_tiny(tmp_path_factory.mktemp("ltx23"), parts=parts_23)
                if family == "ltx-2.3-audio"
                else tiny_model_factory(VARIANTS.get(family, (family,))[0], task=task)
            )
            spec = _spec(family, model_dir)
            cache[family] = (model_dir, _train(spec, _lora_model(spec, family), *_batch(family, spec)))
        return cache[family]

    return get


def _spawn(world: int, runs: list[tuple[str, str, str]], tmp_path) -> None:
    """Run `world` ranks of `_worker(rank, world, store, runs, tmp_path)`: this file as a script, one process a rank;
    `runs`: (family, model folder, layout) in order."""
    from helpers.forkserver import launch_ranks

    log = tmp_path / "world.log"
    group = launch_ranks(
        __file__, world, str(world), str(tmp_path / "store"), ",".join(map("|".join, runs)), str(tmp_path), log=log
    )
    try:
        code = group.wait(timeout=WORLD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        group.kill()
        raise AssertionError(
            f"world of {world} processes did not finish in {WORLD_TIMEOUT_S}s:\n{log.read_text()[-4000:]}"
        ) from None
    assert code == 0, f"a rank of the world of {world} failed:\n{log.read_text()[-6000:]}"


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _assert_matches(result: dict, expected: dict, where: str) -> None:
    assert result["losses"] == pytest.approx(expected["losses"], rel=1e-4), f"{where}: losses"
    assert result["grads"].keys() == expected["grads"].keys(), f"{where}: LoRA parameters differ"
    for kind in ("grads", "params"):
        dead = 0
        for name, value in expected[kind].items():
            if value.abs().max() == 0:  # a LoRA on an output nothing reads (the last block's text stream)
                assert result[kind][name].abs().max() == 0, f"{where}: {kind} of {name} should be zero"
                dead += 1
                continue
            error = _relative(result[kind][name], value)
            assert error <= 1e-4, f"{where}: {kind} of {name} differ by relative {error:.2e}"
        assert dead <= len(expected[kind]) // 4, f"{where}: {dead} reference {kind} are all zero: little tested"


WORLD2 = ["tp2", "cp2", "misuse"]
WORLD4 = ["cp2_tp2", "fsdp2_tp2", "fsdp2_cp2"]
# Wan's world-4 combinations train with LoRA in the trainer-level parity runs (test_parity.py) already;
# LTX's run there as full fine-tunes of t2v, so its LoRA + i2v combinations are checked here. The JOINT families
# (their CP plans, and the TP plans of TP_FAMILIES; their tiny presets' 2 heads leave no room for cp x tp) share one
# world per size.
CASES = {
    "ltx-video-world2": (2, [("ltx-video", layout) for layout in WORLD2]),
    "ltx-video-world4": (4, [("ltx-video", layout) for layout in WORLD4]),
    "wan-world2": (2, [("wan", layout) for layout in WORLD2]),
    # "*": every JOINT family whose spec has the layout's plans (`_planned`), so these rows are where the TP plans of
    # Kandinsky 5, Mochi, HunyuanVideo 1.5 and CogVideoX are checked (test_parity.py runs no TP row of theirs).
    "cp-world2": (2, [("*", "cp2"), ("*", "tp2"), ("mochi", "tp_full")]),
    "cp-world4": (4, [("*", "fsdp2_cp2")]),
}


def _planned(runs: list[tuple[str, str]], reference) -> list[tuple[str, str]]:
    """`runs` with each ("*", layout) expanded to the JOINT families whose spec has a plan for each of the layout's
    tp and cp (`tp_plan()` / `cp_plan()` not None; LTX-2.3's preset only at world 2, where it runs CP alone)."""
    from vt.shared.models.plans import Unplanned

    def has(family: str, kind: str) -> bool:
        try:
            return getattr(_spec(family, reference(family)[0]), f"{kind}_plan")() is not None
        except Unplanned:
            return False

    out = []
    for family, layout in runs:
        if family != "*":
            out.append((family, layout))
            continue
        kinds = [kind for kind in ("tp", "cp") if kind in LAYOUTS[layout]]
        out += [
            (name, layout)
            for name in JOINT
            if all(has(name, kind) for kind in kinds)
            and not (name == "ltx-2.3-audio" and "dp_shard" in LAYOUTS[layout])
        ]
    return out


@pytest.mark.parametrize("world, runs", list(CASES.values()), ids=list(CASES))
def test_parallel_layouts_match_single_process(world, runs, reference, tmp_path):
    runs = _planned(runs, reference)
    _spawn(world, [(family, str(reference(family)[0]), layout) for family, layout in runs], tmp_path)
    for family, layout in runs:
        if layout == "misuse":
            errors = torch.load(tmp_path / f"{family}-misuse-rank0.pt")
            assert "sequence of 3 tokens over cp=2" in errors.get("odd_tokens", ""), errors
            assert "parallel.cp" in errors["odd_tokens"], errors
            assert "apply_tp must come first" in errors.get("order", ""), errors
            continue
        if layout == "tp_full":  # refused before any forward, naming what to change
            error = torch.load(tmp_path / f"{family}-tp_full-rank0.pt").get("error", "")
            assert "norm_q.weight is shared by every head" in error and "parallel.tp = 1" in error, error
            continue
        for rank in range(world):
            result = torch.load(tmp_path / f"{family}-{layout}-rank{rank}.pt")
            _assert_matches(result, reference(family)[1], f"{family} {layout} rank {rank}")


def test_families_without_plans_say_which_setting_to_change(tiny_model_factory):
    from vt.shared.models.plans import Unplanned
    from vt.shared.models.wan_vace import WanVACESpec
    from vt.train.parallel.dims import ParallelConfigError, layout_plan

    spec = _spec("wan", tiny_model_factory("wan"))
    spec.__class__ = WanVACESpec  # a family without plans: its layout role has none (None), refused in one line
    with pytest.raises(ParallelConfigError, match="family 'wan-vace' has no TP plan; set parallel.tp = 1"):
        layout_plan(spec, "tp")
    with pytest.raises(ParallelConfigError, match="family 'wan-vace' has no CP plan; set parallel.cp = 1"):
        layout_plan(spec, "cp")
    # Families (or settings) that cannot take CP say why, and which setting to change, before any training.
    from vt.shared.config import ModelConfig
    from vt.shared.models import build_spec

    for family, task, why in (("hunyuan-video", "i2v", "first frame's tokens apart"),):
        spec = build_spec(ModelConfig(family=family, path=str(tiny_model_factory(family, task=task)), task=task), 8.0)
        with pytest.raises(Unplanned, match=f"{why}.*set parallel.cp = 1"):
            layout_plan(spec, "cp")
    # The real plans name layers that exist in the family's transformer blocks.
    for family in ("ltx-video", "wan"):
        spec = _spec(family, tiny_model_factory(family))
        block = spec.blocks(spec.load_transformer())[0]
        plan = spec.tp_plan()
        for name in (*plan.colwise, *plan.rowwise, *plan.attention, *plan.head_norms):
            block.get_submodule(name)


if __name__ == "__main__":  # one rank of a world (`_spawn`): RANK from the environment, as torchrun sets it
    world, store, runs, out_dir = sys.argv[1:]
    _worker(int(os.environ["RANK"]), int(world), store, [tuple(run.split("|")) for run in runs.split(",")], out_dir)
