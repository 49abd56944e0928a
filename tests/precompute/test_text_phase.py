"""Stage 1's text phase once per several shards (`precompute.text_phase_shards`): the captions of the next full shards
are encoded together, so an offloaded text encoder (MiniMax H3's 62 GiB Qwen3-VL) crosses to the GPU once for all of
them, from page-locked host memory, and the window holds exactly what one text phase per shard writes."""

from __future__ import annotations

import json
import math

import torch
from cli_runs import write_config

from vt.shared.config import load_config


def precompute(tmp_path, model, raw, name: str, shards_per_phase: int, calls: list) -> tuple[int, dict[str, bytes]]:
    """(the text encodes of the run's shards, shard file -> bytes) of a run writing one sample a shard."""
    from vt.precompute.service import Precompute

    config = load_config(write_config(
        tmp_path / f"{name}.toml", model, raw, tmp_path / name, str(tmp_path / f"{name}-window"),
        model={"family": "wan", "max_text_tokens": 16}, buckets={"sizes": ["9x64x96"]}, window={"size": "keep"},
        precompute={"samples_per_shard": 1, "workers": 0, "text_phase_shards": shards_per_phase}))
    calls.clear()
    report = Precompute(config).run()
    window = tmp_path / f"{name}-window"
    files = {p.name: p.read_bytes() for p in window.rglob("*.safetensors") if "commits" not in p.parts}
    return report.shards, files


def content(data: bytes) -> str:
    """A shard file's metadata and tensors, whatever order its header lists them in (safetensors writes its
    header's keys in no fixed order)."""
    from safetensors.torch import load

    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    tensors = load(data)
    return json.dumps({"meta": header["__metadata__"],
                       "tensors": {name: tensors[name].flatten().tolist() for name in sorted(tensors)}}, sort_keys=True)


def test_captions_of_several_shards_are_encoded_in_one_text_phase(tmp_path, tiny_model_factory, raw_shards,
                                                                     monkeypatch):
    from vt.shared.models.wan import WanSpec

    calls: list[int] = []
    encode = WanSpec.encode_text

    def counted(self, encoders, captions):  # the family's own encoder runs; the spy counts its text phases
        calls.append(len(captions))
        return encode(self, encoders, captions)

    monkeypatch.setattr(WanSpec, "encode_text", counted)
    model = tiny_model_factory("wan")
    shards, one_by_one = precompute(tmp_path, model, raw_shards, "each", 1, calls)
    each = [n for n in calls if n]
    shards_grouped, grouped = precompute(tmp_path, model, raw_shards, "grouped", 3, calls)
    together = [n for n in calls if n]
    assert shards == shards_grouped > 3
    # each caption is encoded once either way (a clip's samples share its caption: the cache), but the text phases
    # (after the empty caption's) come once per three shards at most, against once per shard with a new caption
    assert sum(each) == sum(together) and max(together) > 1 == max(each)
    assert len(together) - 1 <= math.ceil(shards / 3) and len(together) < len(each), (each, together)
    assert sorted(map(content, grouped.values())) == sorted(map(content, one_by_one.values()))  # the same shards


def test_a_text_encoder_waits_in_one_page_locked_arena_and_comes_back_without_a_copy(tiny_model_factory):
    from vt.precompute.encoders import HostCopy, load_encoders
    from vt.shared.config import ModelConfig
    from vt.shared.models import build_spec

    spec = build_spec(ModelConfig(family="wan", path=str(tiny_model_factory("wan")), max_text_tokens=16), 8.0)
    cpu = torch.device("cpu")
    encoders = load_encoders(spec, cpu, "none", vae_tiling=False)
    expected = spec.encode_text(encoders, ["a fox in the snow"])
    module = encoders["text_encoder"]
    copy = HostCopy(module, cpu)
    storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    assert storages == {copy.arena.bytes.untyped_storage().data_ptr()}  # every weight a view of one arena
    copy.to_device()
    on_device = spec.encode_text(encoders, ["a fox in the snow"])
    copy.to_host()
    assert copy.moves == 1 and all(torch.equal(on_device[k], expected[k]) for k in expected)
    assert {p.untyped_storage().data_ptr() for p in module.parameters()} == storages  # back on its views
