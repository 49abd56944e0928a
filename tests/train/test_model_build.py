"""The trainer's transformer, built on the meta device and filled from the safetensors files, is the model
`from_pretrained` loads: same names, same values, same dtypes (frozen in model.dtype, the class's float32
modules kept), for every family; what trains is float32; LoRA adapters start the same in every build."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vt.shared.config import ModelConfig, ParallelConfig
from vt.shared.models import FAMILIES, build_spec
from vt.shared.weights.folder import Weights
from vt.train.model_build import build_transformer, plain_name
from vt.train.parallel import parallelize
from vt.train.parallel.world import setup_world


def build(spec, mode: str, dtype: torch.dtype, seed: int = 0):
    world = setup_world(ParallelConfig(), "cpu")
    lora = {"rank": 4, "alpha": 4.0, "targets": []}
    return build_transformer(
        spec,
        spec.trained_component,
        world,
        mode=mode,
        lora=lora,
        storage_dtype=None,
        compute_dtype=torch.float32,
        frozen_dtype=dtype,
        parallelize=lambda model, fill: parallelize(model, spec, world, materialize=fill),
        seed=seed,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_built_transformer_is_what_from_pretrained_loads(tiny_model_factory, family):
    spec = build_spec(ModelConfig(family=family, path=str(tiny_model_factory(family)), dtype="bfloat16"), 8.0)
    frozen = build(spec, "frozen", torch.bfloat16)
    expected = (
        spec.component_classes()[spec.trained_component]
        .from_pretrained(spec.config.path, subfolder=spec.trained_component, torch_dtype=torch.bfloat16)
        .state_dict()
    )
    got = frozen.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, f"{name}: {got[name].dtype}, from_pretrained {tensor.dtype}"
        assert torch.equal(got[name], tensor), name
    assert {t.dtype for t in got.values() if t.is_floating_point()} >= {torch.bfloat16}
    assert not any(p.requires_grad for p in frozen.parameters())
    assert not any(b.is_meta for b in frozen.buffers())


def test_lora_base_stays_in_model_dtype_adapters_train_in_float32_and_start_alike(tiny_model_factory):
    spec = build_spec(ModelConfig(family="wan", path=str(tiny_model_factory("wan")), dtype="bfloat16"), 8.0)
    first, again, other_seed = (
        build(spec, "lora", torch.bfloat16),
        build(spec, "lora", torch.bfloat16),
        build(spec, "lora", torch.bfloat16, seed=1),
    )
    trained = {n: p for n, p in first.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n and p.dtype == torch.float32 for n, p in trained.items())
    frozen = [p for p in first.parameters() if not p.requires_grad]
    assert frozen and {p.dtype for p in frozen} == {torch.bfloat16, torch.float32}  # Wan keeps its norms in fp32
    assert all(torch.equal(p, again.get_parameter(n)) for n, p in trained.items())  # keyed by name, not RNG state
    lora_a = [n for n in trained if ".lora_A." in n]
    assert all(float(trained[n].detach().abs().max()) > 0 for n in lora_a)
    assert all(float(trained[n].detach().abs().max()) == 0 for n in trained if ".lora_B." in n)  # peft's start: B = 0
    assert any(not torch.equal(trained[n], other_seed.get_parameter(n)) for n in lora_a)


@pytest.mark.parametrize("kind", ["lora", "dora", "loha"])
def test_adapters_of_a_meta_built_model_are_made_on_the_meta_device_as_peft_makes_them(tiny_model_factory, kind):
    """prepare_transformer adds the adapters of a meta-built model on the meta device (peft would make and initialize
    each on the host first, then move it: ~1 GB of Kaiming draws for a 14B's rank 32, thrown away by `fill`): the same
    parameters, names, shapes, dtypes and what trains, as peft's own way gives, and nothing of them on the host."""
    from vt.train.model_build import prepare_transformer

    spec = build_spec(ModelConfig(family="wan", path=str(tiny_model_factory("wan")), dtype="bfloat16"), 8.0)
    lora = {"rank": 4, "alpha": 4.0, "targets": [], "kind": kind}
    host_draws = []

    class HostDraws(TorchDispatchMode):  # a random start drawn for a host tensor
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._overloadpacket in (torch.ops.aten.uniform_, torch.ops.aten.normal_) and not args[0].is_meta:
                host_draws.append(func)
            return func(*args, **(kwargs or {}))

    with HostDraws():
        built = prepare_transformer(
            spec,
            spec.trained_component,
            mode="lora",
            lora=lora,
            storage_dtype=None,
            sharded=False,
            compute_dtype=torch.float32,
            frozen_dtype=torch.bfloat16,
        )
    assert host_draws == []
    peft_way = spec.empty_component(spec.trained_component, dtype=torch.bfloat16).requires_grad_(False)
    spec.add_lora(peft_way, 4, 4.0, None, kind=kind)  # through the host, then moved to the base's device
    for param in peft_way.parameters():
        if param.requires_grad:
            param.data = param.data.float()

    def layout(model):
        return {n: (tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()}

    assert layout(built) == layout(peft_way) and any(n for n, (_, _, trains) in layout(built).items() if trains)
    assert all(p.is_meta for p in built.parameters())


def test_full_fine_tune_trains_float32_master_weights(tiny_model_factory):
    spec = build_spec(ModelConfig(family="ltx-video", path=str(tiny_model_factory("ltx-video")), dtype="bfloat16"), 8.0)
    model = build(spec, "full", torch.bfloat16)
    assert all(p.requires_grad and p.dtype == torch.float32 for p in model.parameters())
    reference = spec.load_transformer(dtype=torch.float32).state_dict()
    assert all(torch.equal(model.get_parameter(plain_name(n)), t) for n, t in reference.items())


def test_weights_reader_reads_blocks_of_tensors_across_index_files(tmp_path):
    from safetensors.torch import save_file

    tensors = {
        "a": torch.arange(60, dtype=torch.float32).reshape(6, 10),
        "b": torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4),
        "c": torch.tensor(3.5),
    }
    save_file({"a": tensors["a"]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": tensors["b"], "c": tensors["c"]}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors", '
        '"c": "model-00002-of-00002.safetensors"}}'
    )
    weights = Weights.in_folder(tmp_path)
    assert sorted(weights.names()) == ["a", "b", "c"] and weights.shape("b") == (2, 3, 4)
    assert torch.equal(weights.read("a"), tensors["a"]) and weights.read("c").item() == 3.5
    assert torch.equal(weights.read("a", (2, 0), (3, 10)), tensors["a"][2:5])  # rows: one contiguous read
    assert torch.equal(weights.read("a", (0, 4), (6, 3)), tensors["a"][:, 4:7])  # columns (row-wise TP)
    assert torch.equal(weights.read("b", (1, 1, 0), (1, 2, 4)), tensors["b"][1:2, 1:3])
    assert weights.read("a", (6, 0), (0, 10)).shape == (0, 10)  # an empty shard (more ranks than rows)
    with pytest.raises(ValueError, match="outside a"):
        weights.read("a", (5, 0), (2, 10))


def test_a_stored_linear_computes_in_float32_and_keeps_only_its_stored_weight():
    """bf16 weights in a float32 run (one process): each frozen Linear upcasts per matmul, forward and
    backward, and what the backward keeps is the stored bf16 weight itself, never an upcast copy."""
    from vt.train.frozen_storage import StoredLinear, store_frozen

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))
    reference = [p.detach().clone() for p in model.parameters()]
    store_frozen(model, torch.bfloat16, torch.float32, sharded=False)
    model.requires_grad_(False)
    assert isinstance(model[0], StoredLinear) and model[0].weight.dtype == torch.bfloat16
    assert model[1].weight.dtype == torch.float32  # a norm computes in (and is held in) float32
    x = torch.randn(5, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = model(x)
    assert out.dtype == torch.float32
    stored = {model[0].weight.data_ptr(), model[2].weight.data_ptr()}
    big = [t for t in saved if t.numel() >= 32 * 8]
    assert {t.data_ptr() for t in big if t.dtype == torch.bfloat16} == stored  # the weights as stored
    assert not [t for t in big if t.dtype == torch.float32 and t.shape in ((32, 64), (8, 32))]  # no upcast copies
    out.sum().backward()
    plain = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))
    with torch.no_grad():
        for p, r, s in zip(plain.parameters(), reference, model.parameters()):
            p.copy_(s.float() if s.dtype == torch.bfloat16 else r)
    x2 = x.detach().clone().requires_grad_(True)
    plain(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
