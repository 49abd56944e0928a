"""A transformer from one .safetensors file as the community ships it (`model.components.transformer = FILE`).

The files are written here from the tiny presets in the ORIGINAL checkpoint layout, diffusers' mapping
inverted: Wan's, which only renames, and HunyuanVideo's, which splits the fused qkv projections and swaps the
final modulation's halves (those tensors are computed, not renamed). And as ComfyUI's fp8-scaled files:
float8 e4m3fn weights with a per-tensor `scale_weight` = amax / 448, the `scaled_fp8` marker and a few
`scale_input`s (ignored), under `model.diffusion_model.`. HunyuanVideo's preset is used without its
single-stream block: diffusers' mapping splits a single block's `linear1` at the real model's width (3072),
which no tiny model has. And as a GGUF file (scripts/make_gguf.py, the `gguf` package's writer) from the bf16
original, its linear weights in Q4_1 blocks.
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from safetensors.torch import save_file

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig, ParallelConfig
from vt.shared.models import build_spec
from vt.shared.models.components import ModelLoadError
from vt.shared.weights.folder import Weights
from vt.shared.weights.single_file import SingleFileError
from vt.train.fp8 import FP8_STORAGE
from vt.train.frozen_storage import StoredLinear
from vt.train.model_build import build_transformer
from vt.train.objectives import flow_matching_loss
from vt.train.packed_base import PackedLinear
from vt.train.parallel import parallelize
from vt.train.parallel.world import setup_world

FAMILIES = ("wan", "hunyuan-video")
FP8_MAX = 448.0

# diffusers' convert_wan_transformer_to_diffusers, read backwards (the rest of Wan's names are the same)
WAN = (
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn2", "cross_attn"),
    ("attn1", "self_attn"),
    (".to_out.0.", ".o."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    ("proj_out", "head.head"),
    ("norm2", "norm__swap"),
    ("norm3", "norm2"),
    ("norm__swap", "norm3"),
)
# diffusers' convert_hunyuan_video_transformer_to_diffusers, read backwards: per scope, then the fused q/k/v
HUNYUAN_REFINER = (
    (".attn.to_out.0", ".self_attn_proj"),
    (".ff.net.0.proj", ".mlp.fc1"),
    (".ff.net.2", ".mlp.fc2"),
    (".norm_out.linear", ".adaLN_modulation.1"),
)
HUNYUAN_DOUBLE = (
    (".norm1_context.linear", ".txt_mod.linear"),
    (".norm1.linear", ".img_mod.linear"),
    (".attn.norm_added_q", ".txt_attn_q_norm"),
    (".attn.norm_added_k", ".txt_attn_k_norm"),
    (".attn.norm_q", ".img_attn_q_norm"),
    (".attn.norm_k", ".img_attn_k_norm"),
    (".attn.to_out.0", ".img_attn_proj"),
    (".attn.to_add_out", ".txt_attn_proj"),
    (".ff_context.net.0.proj", ".txt_mlp.fc1"),
    (".ff_context.net.2", ".txt_mlp.fc2"),
    (".ff.net.0.proj", ".img_mlp.fc1"),
    (".ff.net.2", ".img_mlp.fc2"),
)
HUNYUAN_TOP = (
    ("context_embedder.time_text_embed.timestep_embedder.linear_1", "txt_in.t_embedder.mlp.0"),
    ("context_embedder.time_text_embed.timestep_embedder.linear_2", "txt_in.t_embedder.mlp.2"),
    ("context_embedder.time_text_embed.text_embedder", "txt_in.c_embedder"),
    ("context_embedder.proj_in", "txt_in.input_embedder"),
    ("time_text_embed.timestep_embedder.linear_1", "time_in.mlp.0"),
    ("time_text_embed.timestep_embedder.linear_2", "time_in.mlp.2"),
    ("time_text_embed.guidance_embedder.linear_1", "guidance_in.mlp.0"),
    ("time_text_embed.guidance_embedder.linear_2", "guidance_in.mlp.2"),
    ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
    ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
    ("x_embedder", "img_in"),
    ("norm_out.linear", "final_layer.adaLN_modulation.1"),
    ("proj_out", "final_layer.linear"),
)
HUNYUAN_FUSED = (
    (r"(transformer_blocks\.\d+)\.attn\.to_(q|k|v)\.(weight|bias)", r"\1.img_attn_qkv.\3"),
    (r"(transformer_blocks\.\d+)\.attn\.add_(q|k|v)_proj\.(weight|bias)", r"\1.txt_attn_qkv.\3"),
    (
        r"(context_embedder\.token_refiner\.refiner_blocks\.\d+)\.attn\.to_(q|k|v)\.(weight|bias)",
        r"\1.self_attn_qkv.\3",
    ),
)


def wan_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        name = (
            "head.modulation"
            if name == "scale_shift_table"
            else re.sub(r"^(blocks\.\d+)\.scale_shift_table$", r"\1.modulation", name)
        )
        for new, old in WAN:
            name = name.replace(new, old)
        out[name] = tensor
    return out


def _hunyuan_name(name: str) -> str:
    if name.startswith("context_embedder.token_refiner.refiner_blocks."):
        table = HUNYUAN_REFINER
        name = name.replace("context_embedder.token_refiner.refiner_blocks", "txt_in.individual_token_refiner.blocks")
    elif name.startswith("transformer_blocks."):
        table, name = HUNYUAN_DOUBLE, name.replace("transformer_blocks", "double_blocks", 1)
    else:
        table = HUNYUAN_TOP
    for new, old in table:
        name = name.replace(new, old)
    return name


def hunyuan_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, fused = {}, {}
    for name, tensor in state.items():
        for pattern, target in HUNYUAN_FUSED:
            if match := re.fullmatch(pattern, name):
                fused.setdefault(_hunyuan_name(re.sub(pattern, target, name)), {})[match.group(2)] = tensor
                break
        else:
            out[_hunyuan_name(name)] = tensor
    out.update({name: torch.cat([parts["q"], parts["k"], parts["v"]]) for name, parts in fused.items()})
    for kind in ("weight", "bias"):  # the original's (shift, scale) order
        scale, shift = out[f"final_layer.adaLN_modulation.1.{kind}"].chunk(2)
        out[f"final_layer.adaLN_modulation.1.{kind}"] = torch.cat([shift, scale])
    return out


def fp8_scaled(original: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(ComfyUI's fp8-scaled file of `original`, the original dequantized: weight.float() * scale_weight)."""
    prefix = "model.diffusion_model."
    out, dequantized = {f"{prefix}scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}, {}
    for index, (name, tensor) in enumerate(original.items()):
        if tensor.ndim == 2 and name.endswith(".weight"):
            scale = tensor.abs().amax().float() / FP8_MAX
            stored = (tensor.float() / scale).to(torch.float8_e4m3fn)
            module = name.removesuffix(".weight")
            out.update(
                {prefix + name: stored, f"{prefix}{module}.scale_weight": scale.reshape(() if index % 2 else (1,))}
            )
            if index % 3 == 0:
                out[f"{prefix}{module}.scale_input"] = torch.ones(())
            dequantized[name] = stored.float() * scale
        else:
            out[prefix + name], dequantized[name] = tensor, tensor
    return out, dequantized


@pytest.fixture(scope="module")
def preset(tiny_model_factory, tmp_path_factory):
    """preset(family) -> dict: `path` (model folder), `state` (diffusers float32), `original` / `scaled` (files),
    `dequantized` (the scaled file's model in diffusers' layout, a folder), made once per family."""
    made = {}

    def get(family: str) -> dict:
        if family in made:
            return made[family]
        out = tmp_path_factory.mktemp(f"{family}-single-file")
        path = tiny_model_factory(family)
        if family == "hunyuan-video":  # without the single-stream block (see the module docstring)
            from vt.shared.models.presets.hunyuan_video import tiny_hunyuan_transformer

            shutil.copytree(path, out / "model", ignore=shutil.ignore_patterns("transformer"))
            path = out / "model"
            torch.manual_seed(0)
            tiny_hunyuan_transformer(num_single_layers=0).save_pretrained(path / "transformer")
        cls = spec_of({"family": family, "path": path}).component_classes()["transformer"]
        state = cls.from_pretrained(path, subfolder="transformer", torch_dtype=torch.float32).state_dict()
        original = (wan_original if family == "wan" else hunyuan_original)(state)
        save_file({k: v.contiguous() for k, v in original.items()}, out / "original.safetensors")
        scaled, dequantized = fp8_scaled(original)
        save_file({k: v.contiguous() for k, v in scaled.items()}, out / "scaled.safetensors")
        # the dequantized model as diffusers' own single-file loader maps it, saved in diffusers' layout
        reference = cls.from_single_file(
            dequantized, config=str(path), subfolder="transformer", torch_dtype=torch.float32
        )
        reference.save_pretrained(out / "dequantized")
        made[family] = {
            "family": family,
            "path": path,
            "state": state,
            "original": out / "original.safetensors",
            "scaled": out / "scaled.safetensors",
            "dequantized": out / "dequantized",
            "scaled_tensors": scaled,
        }
        return made[family]

    return get


def spec_of(case: dict, transformer=None, dtype: str = "float32", path=None):
    """The spec of `case`'s family and model folder (or `path`), its transformer from `transformer` if given."""
    components = {"transformer": str(transformer)} if transformer else {}
    return build_spec(
        ModelConfig(family=case["family"], path=str(path or case["path"]), dtype=dtype, components=components), 8.0
    )


def build(spec, mode: str, storage=None, frozen=torch.float32, world=None, quantize: str = "none"):
    """The trainer's build on the CPU (float32 compute); under FSDP2 the all-gather upcasts float8 storage."""
    world = world or setup_world(ParallelConfig(), "cpu")
    gather = torch.float32 if storage == FP8_STORAGE and world.dims.fsdp_enabled else None
    return build_transformer(
        spec,
        spec.trained_component,
        world,
        mode=mode,
        lora={"rank": 4, "alpha": 4.0, "targets": []},
        storage_dtype=storage,
        compute_dtype=torch.float32,
        frozen_dtype=frozen,
        seed=0,
        parallelize=lambda model, fill: parallelize(model, spec, world, param_dtype=gather, materialize=fill),
        quantize=quantize,
    )


def batch_of(spec) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Two samples in the shapes stage 1 stores (random conditions, all-ones masks), sigmas and noise."""
    g = spec.geometry
    side = g.spatial * g.patch * 2
    generator = torch.Generator().manual_seed(0)
    masks = set(spec.text_masks.values())
    batch = {
        name: torch.ones(2, *shape, dtype=torch.long) if name in masks else torch.randn(2, *shape, generator=generator)
        for name, shape in sorted(spec.condition_shapes(Bucket(g.temporal + 1, side, side)).items())
    }
    return batch, torch.tensor([0.3, 0.8]), torch.randn(batch["latents"].shape, generator=generator)


def train(spec, model, steps: int = 2) -> dict:
    """`steps` AdamW steps on one batch: the losses and the first step's LoRA gradients."""
    params = sorted((n, p) for n, p in model.named_parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW([p for _, p in params], lr=1e-2)
    batch, sigmas, noise = batch_of(spec)
    losses, grads = [], {}
    for step in range(steps):
        loss = flow_matching_loss(spec.forward(model, batch, sigmas, noise))
        loss.backward()
        if step == 0:
            grads = {n: full(p.grad) for n, p in params}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach().clone()


def randomize_lora(model) -> None:
    """LoRA factors from a fixed seed (not lora_B = 0), so the adapters change what the base computes."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, param in sorted((n, p) for n, p in model.named_parameters() if p.requires_grad):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def trains_alike(spec, model, reference) -> None:
    """With the same LoRA factors, `model` and `reference` train alike: losses within 1e-6, each adapter's first
    gradient within 1e-5 (and the adapters do train)."""
    randomize_lora(model)
    randomize_lora(reference)
    got, want = train(spec, model), train(spec, reference)
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-6) and got["losses"][1] != got["losses"][0]
    for name, grad in want["grads"].items():
        assert float(grad.abs().max()) > 0 and relative(got["grads"][name], grad) < 1e-5, name


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("family", FAMILIES)
def test_original_layout_file_builds_the_model_from_pretrained_loads_reading_each_tensor_once(
    preset, family, monkeypatch, caplog, tmp_path
):
    """The trainer's build (frozen, bf16), `load_transformer` and `load_component` from the original-layout
    file equal `from_pretrained` of the diffusers folder, tensor for tensor; the build reads every byte of the
    file's tensors exactly once (renamed ones block by block, each computed group once) and no more."""
    case = preset(family)
    spec = spec_of(case, case["original"], dtype="bfloat16")
    cls = spec.component_classes()["transformer"]
    reads = []
    original_read = Weights._read_bytes
    monkeypatch.setattr(
        Weights,
        "_read_bytes",
        staticmethod(lambda entry, start, count: reads.append(count) or original_read(entry, start, count)),
    )
    built = build(spec, "frozen", frozen=torch.bfloat16).state_dict()
    header = Weights([case["original"]])
    assert sum(reads) == sum(e.end - e.start for e in header.entries.values())
    monkeypatch.undo()
    expected = cls.from_pretrained(case["path"], subfolder="transformer", torch_dtype=torch.bfloat16).state_dict()
    assert built.keys() == expected.keys()
    for name, tensor in expected.items():
        assert built[name].dtype == tensor.dtype and torch.equal(built[name], tensor), name
    loaded = spec.load_transformer().state_dict()
    assert all(torch.equal(loaded[n], t) for n, t in case["state"].items()) and loaded.keys() == case["state"].keys()
    frozen = spec.load_component("transformer")
    assert not any(p.requires_grad for p in frozen.parameters())
    assert all(torch.equal(frozen.state_dict()[n], t) for n, t in expected.items())
    save_file({k: v.contiguous() for k, v in case["state"].items()}, tmp_path / "diffusers-layout.safetensors")
    as_saved = spec_of(case, tmp_path / "diffusers-layout.safetensors").load_transformer().state_dict()
    assert all(torch.equal(as_saved[n], t) for n, t in case["state"].items())  # read as it is, no mapping
    # the file is what diffusers' own single-file loader reads as this model (so the layout above is the original)
    theirs = cls.from_single_file(
        str(case["original"]), config=str(case["path"]), subfolder="transformer", torch_dtype=torch.float32
    ).state_dict()
    assert all(torch.equal(theirs[n], t) for n, t in case["state"].items())
    weights = spec.weights("transformer")
    mapped = re.search(
        r"original layout, mapped by diffusers' \w+ \((\d+) tensors renamed, (\d+) computed", caplog.text
    )
    renamed, computed = map(int, mapped.groups())
    assert renamed + computed == len(case["state"])
    if family == "hunyuan-video":  # q/k/v split out of the fused tensors, the final modulation's halves swapped
        assert computed == 3 * 6 + 2
        key = "transformer_blocks.0.attn.to_k.weight"  # a shard's block of a computed tensor (FSDP2, TP)
        assert torch.equal(weights.read(key, (5, 2), (7, 9)), case["state"][key][5:12, 2:11])
    else:
        assert computed == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_scaled_file_is_dequantized_into_model_dtype(preset, family):
    """Without fp8 base weights the file's float8 weights are dequantized (weight.float() * scale_weight) at
    fill time: the built model is the one diffusers loads from the dequantized tensors; no scale reaches it."""
    case = preset(family)
    spec = spec_of(case, case["scaled"])
    built = build(spec, "frozen").state_dict()
    expected = spec_of(case, case["dequantized"]).load_transformer().state_dict()
    assert built.keys() == expected.keys() and not any("scale_weight" in n or "scaled_fp8" in n for n in built)
    assert all(torch.equal(built[n], t) for n, t in expected.items())
    queries = [n for n in case["state"] if n.endswith(("attn1.to_q.weight", "attn.to_q.weight"))]
    assert queries and not any(torch.equal(built[n], case["state"][n]) for n in queries), (
        "the dequantized weights must differ from the unquantized ones"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_fp8_scaled_base_keeps_the_files_fp8_values_and_trains_like_the_dequantized_model(preset, family):
    """`frozen_base.fp8` with an fp8-scaled file: the frozen linears hold the file's own float8 values
    (also those diffusers' mapping splits out of a fused tensor) and its scales as non-persistent buffers (no
    parameter, in no state dict); forward and backward with LoRA equal the dequantized model's."""
    case = preset(family)
    spec = spec_of(case, case["scaled"])
    model = build(spec, "lora", storage=FP8_STORAGE)
    reference = build(spec_of(case, case["dequantized"]), "lora")
    expected = dict(reference.named_parameters())
    scaled = {n: m for n, m in model.named_modules() if isinstance(m, StoredLinear) and "weight_scale" in m._buffers}
    query = "blocks.0.attn1.to_q" if family == "wan" else "transformer_blocks.0.attn.to_q"  # hunyuan: split from qkv
    assert f"{query}.base_layer" in scaled and len(scaled) >= 8
    for name, module in scaled.items():
        assert module.weight.dtype == torch.float8_e4m3fn
        dequantized = module.weight.float() * module.weight_scale
        assert torch.equal(dequantized, expected[f"{name}.weight"]), name  # the file's values, exactly
    scale_names = ("scale_weight", "weight_scale", "scale_input", "scaled_fp8")
    assert not any(n.endswith(scale_names) for n in [*dict(model.named_parameters()), *model.state_dict()])
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    randomize_lora(model)
    randomize_lora(reference)
    got, want = train(spec, model), train(spec, reference)
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
    assert got["losses"][1] != got["losses"][0], "the adapters must train"
    for name, grad in want["grads"].items():
        assert float(grad.abs().max()) > 0 and relative(got["grads"][name], grad) < 1e-4, name
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if not p.requires_grad)


def test_fp8_scaled_base_under_fsdp2_applies_the_scale_after_the_all_gather(preset):
    """FSDP2 (one rank over an in-memory group, which CPU offload turns on for one process): the frozen float8
    shards are all-gathered upcast to the compute dtype, each layer applies the file's scale, and losses and
    LoRA gradients equal the dequantized model's."""
    from torch.distributed.tensor import DTensor

    from vt.train.parallel.world import shutdown_world

    case = preset("wan")
    spec = spec_of(case, case["scaled"])
    expected = train(spec, build(spec_of(case, case["dequantized"]), "lora"))
    try:
        model = build(spec, "lora", storage=FP8_STORAGE, world=setup_world(ParallelConfig(cpu_offload=True), "cpu"))
        query = model.get_submodule("blocks.0.attn1.to_q.base_layer")
        assert isinstance(query.weight, DTensor) and query.weight.dtype == torch.float8_e4m3fn
        assert isinstance(query, StoredLinear) and float(query.weight_scale) > 0  # filled (not NaN)
        got = train(spec, model)
    finally:
        shutdown_world()
    assert got["losses"] == pytest.approx(expected["losses"], rel=1e-5)
    for name, grad in expected["grads"].items():
        if float(grad.abs().max()) > 0:  # lora_B (lora_A's gradient is 0 while lora_B starts at 0)
            assert relative(got["grads"][name], grad) < 1e-4, name


def test_missing_scale_unknown_layout_and_wrong_size_are_clear_errors(preset, tmp_path):
    """Each refusal names what is wrong: a float8 weight of a scaled file without its scale (the key), a layout
    diffusers' mapping does not turn into the model (the missing parameters, the file's keys), a tensor of
    another size than model.path's config.json, a model.path without the config, a single file for a VAE."""
    case = preset("wan")
    scaled = dict(case["scaled_tensors"])
    del scaled["model.diffusion_model.blocks.0.self_attn.k.scale_weight"]
    save_file({k: v.contiguous() for k, v in scaled.items()}, tmp_path / "no_scale.safetensors")
    with pytest.raises(
        SingleFileError,
        match=r"float8 model\.diffusion_model\.blocks\.0\.self_attn\.k\.weight has no "
        r"model\.diffusion_model\.blocks\.0\.self_attn\.k\.scale_weight",
    ):
        spec_of(case, tmp_path / "no_scale.safetensors").weights("transformer")
    # Wan's original layout given as a HunyuanVideo transformer: the mapping finds none of its parameters
    hunyuan = preset("hunyuan-video")
    with pytest.raises(
        SingleFileError,
        match=r"lacks \d+ of HunyuanVideoTransformer3DModel's \d+ parameters after "
        r"diffusers' convert_hunyuan_video_transformer_to_diffusers .* the "
        r"file's keys look like blocks\.0\.cross_attn",
    ):
        spec_of(hunyuan, case["original"]).weights("transformer")
    original = {k: v.contiguous() for k, v in wan_original(case["state"]).items()}
    original["blocks.0.ffn.0.weight"] = original["blocks.0.ffn.0.weight"][:-1].contiguous()
    save_file(original, tmp_path / "smaller.safetensors")
    with pytest.raises(
        SingleFileError,
        match=r"does not fit the config\.json .*blocks\.0\.ffn\.net\.0\.proj\.weight: "
        r"file \(\d+, \d+\), model",
    ):
        spec_of(case, tmp_path / "smaller.safetensors").weights("transformer")
    empty = tmp_path / "no-model"
    empty.mkdir()
    with pytest.raises(
        FileNotFoundError,
        match=r"model\.components\.transformer = .* is one weights file; its "
        r"config\.json is read from model\.path's 'transformer' folder",
    ):
        spec_of(case, case["original"], path=empty).empty_component("transformer")
    with pytest.raises(ValueError, match="only for a transformer"):
        build_spec(
            ModelConfig(family="wan", path=str(case["path"]), components={"vae": str(case["original"])}), 8.0
        ).load_component("vae")


def test_a_hub_file_is_read_from_the_cache_and_offline_names_the_download(preset, tmp_path, monkeypatch):
    """`org/repo/path/file.safetensors` is fetched with hf_hub_download (here: found in the local cache,
    HF_HUB_OFFLINE=1); a file the cache lacks says how to download it."""
    import huggingface_hub.constants

    case = preset("wan")
    commit = "0" * 40
    snapshot = tmp_path / "hub" / "models--org--wan-fp8" / "snapshots" / commit / "split_files"
    snapshot.mkdir(parents=True)
    shutil.copy(case["scaled"], snapshot / "wan_fp8_scaled.safetensors")
    (tmp_path / "hub" / "models--org--wan-fp8" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--wan-fp8" / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    spec = spec_of(case, "org/wan-fp8/split_files/wan_fp8_scaled.safetensors")
    expected = spec_of(case, case["dequantized"]).load_transformer().state_dict()
    got = spec.load_transformer().state_dict()
    assert all(torch.equal(got[n], t) for n, t in expected.items())
    with pytest.raises(ModelLoadError, match=r"hub is offline .*`hf download org/wan-fp8 missing\.safetensors"):
        spec_of(case, "org/wan-fp8/missing.safetensors").weights("transformer")


FORMATS = ("Q4_1", "int8", "int8-rows")  # a GGUF file; ComfyUI's int8_tensorwise layers; int8 with a scale per row


@pytest.fixture(scope="module")
def quantized(preset, tmp_path_factory):
    """quantized(format) -> dict: Wan's tiny transformer quantized from its bf16 original by
    scripts/quantize_base.py (`file`, its keys' stored types `stored`), and the model it holds, every weight
    dequantized, as a diffusers-layout file (`dequantized`); made once per format."""
    from quantize_base import write_gguf, write_int8

    made = {}

    def get(kind: str) -> dict:
        if kind not in made:
            case = preset("wan")
            out = tmp_path_factory.mktemp(f"wan-{kind}")
            original = {k: v.to(torch.bfloat16) for k, v in wan_original(case["state"]).items()}
            file = out / (f"wan-{kind}.gguf" if kind.startswith("Q") else f"wan-{kind}.safetensors")
            stored = (
                write_gguf(original, file, kind)
                if kind.startswith("Q")
                else write_int8(original, file, per_row=kind == "int8-rows")
            )
            dequantized = build(spec_of(case, file), "frozen").state_dict()
            save_file({k: v.contiguous() for k, v in dequantized.items()}, out / "dequantized.safetensors")
            made[kind] = {"file": file, "dequantized": out / "dequantized.safetensors", "stored": stored}
        return made[kind]

    return get


@pytest.mark.parametrize("kind", FORMATS)
def test_lora_on_a_quantized_base_keeps_its_stored_form_and_trains_like_the_dequantized_model(
    preset, quantized, kind, tmp_path
):
    """The linear weights of the blocks stay as the file stores them (Q4_1: uint8, 20 bytes per 32 weights; int8
    values with their scale, one or one per row), dequantized per matmul; losses and LoRA gradients equal the
    dequantized model's; the exported ComfyUI LoRA names the file's own weights (ComfyUI loads the file by them)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    from vt.train.packed_base import unpack

    case, base = preset("wan"), quantized(kind)
    spec = spec_of(case, base["file"])
    model = build(spec, "lora")
    reference = build(spec_of(case, base["dequantized"]), "lora")
    expected = dict(reference.named_parameters())
    packed = {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert "blocks.0.attn1.to_q.base_layer" in packed and "blocks.1.ffn.net.2" in packed and len(packed) >= 16
    assert sum(stored != "float32" for stored in base["stored"].values()) > len(packed)  # the embedders: dequantized
    for name, module in packed.items():
        rows, width = module.out_features, module.in_features
        if kind == "Q4_1":
            assert module.weight.dtype == torch.uint8 and module.weight.shape == (rows, width // 32 * 20)
        else:
            assert module.weight.dtype == torch.int8 and module.weight.shape == (rows, width)
            assert module.weight_scale.shape == ((rows, 1) if kind == "int8-rows" else ())
        unpacked = unpack(module.weight, module.kind, torch.float32, module._buffers.get("weight_scale"))
        assert torch.equal(unpacked, expected[f"{name}.weight"]), name
    assert not any("weight_scale" in n for n in [*dict(model.named_parameters()), *model.state_dict()])
    trains_alike(spec, model, reference)
    spec.save_lora(get_peft_model_state_dict(model), tmp_path)
    comfy = load_file(tmp_path / "lora_comfyui.safetensors")
    modules = {k.removeprefix("diffusion_model.").removesuffix(".lora_A.weight") for k in comfy if "lora_A" in k}
    assert "blocks.0.self_attn.q" in modules and all(f"{m}.weight" in base["stored"] for m in modules)


def test_a_quantized_base_under_fsdp2_is_filled_dequantized(preset, quantized):
    """FSDP2 shards the weights itself: the file's blocks are dequantized at fill, and the run trains as the
    dequantized model does."""
    from vt.train.parallel.world import shutdown_world

    case, base = preset("wan"), quantized("Q4_1")
    spec = spec_of(case, base["file"])
    expected = train(spec, build(spec_of(case, base["dequantized"]), "lora"))
    try:
        model = build(spec, "lora", world=setup_world(ParallelConfig(cpu_offload=True), "cpu"))
        assert not any(isinstance(m, PackedLinear) for m in model.modules())
        got = train(spec, model)
    finally:
        shutdown_world()
    assert got["losses"] == pytest.approx(expected["losses"], rel=1e-5)


@pytest.mark.parametrize("kind", ("Q4_1", "int8"))
def test_the_plan_counts_a_quantized_base_as_stored(preset, quantized, kind):
    """`vt-train plan` of a LoRA on a quantized file: its weights are the dequantized run's less what the packed
    layers save (4-byte float32 weights become 20 bytes per 32, or 1 byte each), and the widest dequantized weight
    is among its buffers."""
    from vt.shared.config import Config
    from vt.shared.config import build as build_config
    from vt.train.plan import make_plan

    case, base = preset("wan"), quantized(kind)

    def plan(transformer):
        config = build_config(
            Config,
            {
                "model": {
                    "family": "wan",
                    "path": str(case["path"]),
                    "components": {"transformer": str(transformer)},
                    "max_text_tokens": 16,
                },
                "buckets": {"sizes": ["5x64x64"]},
                "train": {"batch_size": 1},
            },
        )
        return make_plan(config, 1, "cpu", stage1=False).rank

    model = build(spec_of(case, base["file"]), "lora")
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    scales = sum(m.weight_scale.numel() * 4 for m in packed if hasattr(m, "weight_scale"))  # int8's, counted too
    saved = sum(m.in_features * m.out_features * 4 - m.weight.numel() for m in packed) - scales
    stored, dequantized = plan(base["file"]), plan(base["dequantized"])
    assert saved > 0 and stored.weights == dequantized.weights - saved
    assert stored.buffers >= max(m.in_features * m.out_features * 4 for m in packed)


def test_a_per_row_int8_file_reads_by_rows_and_other_scaled_formats_are_refused(preset, quantized, tmp_path):
    """An int8 weight with a scale per row reads as int8 x its rows' scales, whole or a shard's block of rows; a
    weight with a scale that is neither float8 nor int8 (ComfyUI's nvfp4: packed uint8) is refused by name."""
    case, base = preset("wan"), quantized("int8-rows")
    weights = spec_of(case, base["file"]).weights("transformer")
    stored = load_file_tensors(base["file"])
    full = stored["blocks.0.self_attn.q.weight"].float() * stored["blocks.0.self_attn.q.weight_scale"]
    assert torch.equal(weights.read("blocks.0.attn1.to_q.weight"), full)
    assert torch.equal(weights.read("blocks.0.attn1.to_q.weight", (3, 0), (4, full.shape[1])), full[3:7])
    stored["blocks.0.self_attn.k.weight"] = stored["blocks.0.self_attn.k.weight"].view(torch.uint8)
    save_file(stored, tmp_path / "nvfp4.safetensors")
    with pytest.raises(
        SingleFileError,
        match=r"blocks\.0\.self_attn\.k\.weight is uint8 with a scale .* vt does not "
        r"read",
    ):
        spec_of(case, tmp_path / "nvfp4.safetensors").weights("transformer")


def load_file_tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_a_base_quantized_as_it_is_read_trains_like_its_dequantized_model(preset, kind, tmp_path):
    """frozen_base.quantize: the diffusers folder's float weights quantized at fill (NF4 in 64-weight blocks: uint8
    codes, two a byte, and a float32 absmax per block; int8 with a scale per row), the embedders and projections
    diffusers keeps in their dtype left as they are; a LoRA on it trains exactly as on the model of its dequantized
    weights, and the plan counts the stored bytes."""
    from vt.shared.config import Config
    from vt.shared.config import build as build_config
    from vt.train.packed_base import unpack
    from vt.train.plan import make_plan

    case = preset("wan")
    spec = spec_of(case)
    model = build(spec, "lora", quantize=kind)
    packed = {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert "blocks.0.attn1.to_q.base_layer" in packed and len(packed) >= 16
    query = packed["blocks.0.attn1.to_q.base_layer"]
    rows, width = query.out_features, query.in_features
    if kind == "nf4":
        assert query.weight.dtype == torch.uint8 and query.weight.shape == (rows, width // 2)
        assert query.weight_scale.shape == (rows, width // 64)
    else:
        assert query.weight.dtype == torch.int8 and query.weight_scale.shape == (rows, 1)
    dequantized = {n: p.detach() for n, p in build(spec, "frozen").state_dict().items()}
    for name, module in packed.items():
        values = unpack(module.weight, module.kind, torch.float32, module.weight_scale)
        original = dequantized[name.replace(".base_layer", "") + ".weight"]
        assert values.shape == original.shape and not torch.equal(values, original), name  # quantized, not copied
        assert float((values - original).abs().max()) <= float(original.abs().max()) * (0.2 if kind == "nf4" else 0.01)
        dequantized[name.replace(".base_layer", "") + ".weight"] = values
    save_file({k: v.contiguous() for k, v in dequantized.items()}, tmp_path / "dequantized.safetensors")
    reference = build(spec_of(case, tmp_path / "dequantized.safetensors"), "lora")
    trains_alike(spec, model, reference)

    def plan(quantize):
        config = build_config(
            Config,
            {
                "model": {"family": "wan", "path": str(case["path"]), "max_text_tokens": 16},
                "buckets": {"sizes": ["5x64x64"]},
                "train": {"batch_size": 1},
                "frozen_base": {"quantize": quantize},
            },
        )
        return make_plan(config, 1, "cpu", stage1=False).rank

    saved = sum(
        m.in_features * m.out_features * 4 - m.weight.numel() * m.weight.element_size() - m.weight_scale.numel() * 4
        for m in packed.values()
    )
    assert saved > 0 and plan(kind).weights == plan("none").weights - saved
