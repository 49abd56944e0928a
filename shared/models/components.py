"""Finding and loading a family's components by name, each from `model.path/<name>` or its own
`model.components.<name>` (a folder, a hub id, or for a transformer one .safetensors or .gguf file), frozen in
`model.dtype`, or built on the meta device to be filled shard by shard (`empty_component`, `weights`).
Loading errors are one line (`ModelLoadError`) naming the component, where it was looked for and the fix.
docs/model_spec.md has the whole contract.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vt.shared.errors import UserError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelLoadError(UserError, OSError):
    """A component (or its config) could not be loaded; the message names it, where from, and the fix."""


@functools.cache
def load_class(path: str) -> type:
    """The class an import string names ("diffusers:WanPipeline", "diffusers.pipelines.ltx2.vocoder:LTX2Vocoder"):
    a family declares its components and pipelines this way, and nothing is imported before it is used."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def hub_offline() -> bool:
    """Whether the Hugging Face hub may not be contacted (HF_HUB_OFFLINE, as huggingface_hub reads it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


class ComponentLoader:
    """Mixed into ModelSpec: uses its `config` (ModelConfig), `family`, `frozen_dtype`,
    `example_hub_id`, `trained_component` and `component_classes()`."""

    def component_names(self) -> tuple[str, ...]:
        """Every component a config may point elsewhere (`model.components.<name>`)."""
        classes = tuple(self.component_classes())
        tokenizers = tuple(f"tokenizer{n[len('text_encoder') :]}" for n in classes if n.startswith("text_encoder"))
        return (*tokenizers, *classes, "scheduler")

    def single_file(self, name: str) -> str | None:
        """The .safetensors or .gguf file `model.components.<name>` names (a local path or a hub file), None for a folder
        or hub id. Only transformers are read from one file."""
        from vt.shared.weights.single_file import is_single_file

        override = self.config.components.get(name)
        if not is_single_file(override):
            return None
        if not name.startswith("transformer"):
            raise UserError(
                f"model.components.{name} = {override!r}: vt reads a single .safetensors or .gguf file only for a "
                f"transformer; point model.components.{name} at a folder or hub id holding the {name}"
            )
        return override

    def source(self, name: str) -> tuple[str, str | None]:
        """(path or hub id, subfolder) of a component (for a single-file transformer: where its config is read);
        errors name the config key to set."""
        override = self.config.components.get(name)
        if override and self.single_file(name):
            root = self.config.path
            if (Path(root) / name).is_dir() or (not Path(root).exists() and _HUB_ID.match(root)):
                return root, name
            raise FileNotFoundError(
                f"model.components.{name} = {override!r} is one weights file; its config.json is read from "
                f"model.path's {name!r} folder, and model.path = {root!r} has none. Set model.path to the "
                f"diffusers-layout folder or hub id of the model the file belongs to (e.g. {self.example_hub_id}); "
                f"only {name}/config.json is read from there"
            )
        if override:
            if not Path(override).exists() and not _HUB_ID.match(override):
                raise FileNotFoundError(
                    f"model.components.{name} = {override!r} is neither a folder nor a hub id (org/name). "
                    f"Point it at a folder holding only the {name}, e.g. a transformer saved by save_full."
                )
            return override, None
        root = self.config.path
        if Path(root).exists():
            if not (Path(root) / name).is_dir():
                raise FileNotFoundError(
                    f"model.path = {root!r} has no {name!r} folder. Use a diffusers-layout folder "
                    f"(model_index.json + subfolders) or set model.components.{name} = <folder or hub id>."
                )
            return root, name
        if _HUB_ID.match(root):
            return root, name
        raise FileNotFoundError(
            f"model.path = {root!r} does not exist. Build a tiny preset with "
            f"`python scripts/make_tiny_model.py --family {self.family} {root}`, or set model.path to a "
            f"diffusers-layout folder or hub id (e.g. {self.example_hub_id})."
        )

    def load_error(self, name: str, path: str, err: Exception) -> ModelLoadError:
        """One line saying which component failed to load from where, and what to do about it."""
        key = f"model.components.{name}" if name in self.config.components else "model.path"
        if not Path(path).exists() and hub_offline():
            return ModelLoadError(
                f"cannot load the {name} of {self.family!r} from hub id {path!r}: the Hugging Face hub is offline "
                f"(HF_HUB_OFFLINE=1) and {path!r} is not in the local cache. Download it where there is network "
                f'(`hf download {path} --local-dir DIR`) and set {key} = "DIR", or unset HF_HUB_OFFLINE'
            )
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return ModelLoadError(
            f"cannot load the {name} of {self.family!r} from {path!r}: {reason}. Check {key}; "
            "a hub id needs network access or a filled local cache"
        )

    def _from_pretrained(self, cls: Any, name: str, **kwargs) -> Any:
        path, subfolder = self.source(name)
        if subfolder is not None:
            kwargs["subfolder"] = subfolder
        try:
            return cls.from_pretrained(path, **kwargs)
        except (OSError, ValueError) as err:
            raise self.load_error(name, path, err) from err

    def class_of(self, name: str) -> type:
        """The class component `name` loads as (AutoTokenizer for a tokenizer); the import is its only cost."""
        classes = self.component_classes()
        if name in classes:
            return classes[name]
        if name.startswith("tokenizer"):
            from transformers import AutoTokenizer

            return AutoTokenizer
        raise UserError(
            f"{self.family!r} has no component {name!r}; its components: {', '.join(self.component_names())}"
        )

    def load_component(self, name: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Any:
        """A frozen component by name: modules in `dtype` (default `model.dtype`), eval mode, loaded straight
        onto `device` (no whole copy on the CPU first)."""
        if name == "scheduler":
            return self.load_scheduler()
        cls = self.class_of(name)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            return self._from_pretrained(cls, name)  # tokenizers, image processors
        if self.single_file(name):
            return self._load_single_file(name, device, dtype or self.frozen_dtype).requires_grad_(False).eval()
        dtype_key = "dtype" if _is_transformers(cls) else "torch_dtype"
        placement = {} if torch.device(device).type == "cpu" else {"device_map": {"": str(torch.device(device))}}
        model = self._from_pretrained(cls, name, **{dtype_key: dtype or self.frozen_dtype}, **placement)
        model.requires_grad_(False)
        return model.eval().to(device)

    def empty_component(self, name: str, dtype: torch.dtype | None = None) -> nn.Module:
        """Component `name` built from its config without weights: parameters on the meta device, each in the dtype
        `from_pretrained(torch_dtype=dtype)` gives it (`dtype`, default `model.dtype`; float32 for the
        class's `_keep_in_fp32_modules`), buffers computed on the CPU as the constructor makes them."""
        from accelerate import init_empty_weights

        cls = self.class_of(name)
        config = self.load_config(name)
        with init_empty_weights(include_buffers=False):
            model = cls._from_config(config) if _is_transformers(cls) else cls.from_config(config)
            set_load_dtypes(model, dtype or self.frozen_dtype)
        return model

    def weights(self, name: str):
        """The component's safetensors weights (`vt.shared.weights.folder.Weights`), found as `from_pretrained`
        finds them: the component folder, or the hub cache for a hub id (`model.path` or an override)."""
        from vt.shared.weights.folder import Weights

        if self.single_file(name):
            from vt.shared.weights.single_file import SingleFileWeights, resolve_file

            key = f"model.components.{name}"
            return SingleFileWeights(resolve_file(self.single_file(name), key), self.empty_component(name), key)
        path, subfolder = self.source(name)
        folder = Path(path) / subfolder if subfolder else Path(path)
        if not folder.is_dir():
            try:
                from huggingface_hub import snapshot_download

                root = snapshot_download(path, allow_patterns=[f"{subfolder}/*"] if subfolder else None)
            except Exception as err:  # offline, unknown repo, no network: one line naming the component
                raise self.load_error(name, path, err) from err
            folder = Path(root) / subfolder if subfolder else Path(root)
        try:
            return Weights.in_folder(folder)
        except FileNotFoundError as err:
            key = f"model.components.{name}" if name in self.config.components else "model.path"
            raise ModelLoadError(
                f"the {name} of {self.family!r} at {folder} has no .safetensors weights (a .bin "
                f"checkpoint?); save it with safe_serialization=True, or check {key}"
            ) from err

    def load_transformer(self, device="cpu", dtype=None, name: str | None = None) -> nn.Module:
        """The transformer this run trains (`trained_component`, or another by `name`), trainable,
        float32 unless `dtype` is given."""
        name = name or self.trained_component
        if self.single_file(name):
            return self._load_single_file(name, device, dtype or torch.float32).eval()
        model = self._from_pretrained(self.class_of(name), name, torch_dtype=dtype or torch.float32)
        return model.to(device)

    def _load_single_file(self, name: str, device, dtype: torch.dtype) -> nn.Module:
        """A transformer from its single file: built on the meta device, filled tensor by tensor onto `device`
        (a scaled float8 weight dequantized into `dtype`), as `from_pretrained` would give it."""
        from vt.shared.weights.single_file import load_weights

        return load_weights(self.empty_component(name, dtype), self.weights(name), device)

    def load_scheduler(self):
        """The scheduler class named in its own config (a real checkpoint may use another one)."""
        import diffusers

        config = self.load_config("scheduler")
        cls = getattr(diffusers, config.get("_class_name", ""), None)
        if cls is None:
            raise UserError(
                f"scheduler config of {self.source('scheduler')[0]!r} names unknown class "
                f"{config.get('_class_name')!r}; set model.components.scheduler to a diffusers scheduler"
            )
        return cls.from_config(config)

    def load_config(self, name: str) -> Any:
        """A component's config without weights: a dict (config.json / scheduler_config.json) for diffusers
        classes, the class's PretrainedConfig for transformers ones."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        reader = FlowMatchEulerDiscreteScheduler if name == "scheduler" else self.class_of(name)
        path, subfolder = self.source(name)
        kwargs = {"subfolder": subfolder} if subfolder else {}
        try:
            if _is_transformers(reader):
                return reader.config_class.from_pretrained(path, **kwargs)
            return dict(reader.load_config(path, **kwargs))
        except (OSError, ValueError) as err:
            raise self.load_error(name, path, err) from err


def _is_transformers(cls: type) -> bool:
    return cls.__module__.startswith("transformers")


def keeps_float32(model: nn.Module, name: str) -> bool:
    """Whether `from_pretrained` keeps parameter `name` of `model` in float32 whatever dtype it loads in:
    diffusers' rule, a `_keep_in_fp32_modules` entry equal to one of the name's dotted parts."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    parts = name.split(".")
    return any(module in parts for module in keep)


def set_load_dtypes(model: nn.Module, dtype: torch.dtype) -> None:
    """Give every floating parameter of `model` (in place) the dtype `from_pretrained(torch_dtype=dtype)` gives it."""
    for name, param in model.named_parameters():
        if param.is_floating_point():
            param.data = param.data.to(torch.float32 if keeps_float32(model, name) else dtype)
