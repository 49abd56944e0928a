"""Contracts of the layout: families live behind the Model Spec seam, and the stages share only vt.shared."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from vt.shared.models import FAMILIES, get_spec_class

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("precompute", "train")


def python_files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def family_words() -> set[str]:
    """Every spelling of a registered family a stage could branch on: its name, module and class."""
    words = set()
    for family in FAMILIES:
        cls = get_spec_class(family)
        words |= {family, family.replace("-", "_"), cls.__module__.rsplit(".", 1)[-1], cls.__name__}
    return words


@pytest.mark.parametrize("stage", STAGES)
def test_the_stages_name_no_model_family(stage):
    """Adding a family touches its own file, the registry line and its tests, never the stages."""
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(family_words()))) + r")\b", re.IGNORECASE)
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in python_files(stage)
             for number, line in enumerate(path.read_text().splitlines(), start=1) if pattern.search(line)]
    assert not found, "family names in a stage:\n" + "\n".join(found)


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_imports_the_other_stage_never(stage):
    """The stages share nothing but storage and vt.shared."""
    other = next(s for s in STAGES if s != stage)
    for path in python_files(stage):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            assert not any(n.startswith(f"vt.{other}") for n in names), f"{path.relative_to(ROOT)} imports vt.{other}"


PACKAGES = ("shared/window", "shared/storage")  # split by role: each module's imports stay inside the rules below


def package_imports(folder: str) -> dict[str, set[str]]:
    """module -> the names of its package's modules it imports (relative imports, `from . import x` included)."""
    modules = {path.stem for path in (ROOT / folder).glob("*.py")}
    out = {}
    for module in modules:
        found = set()
        for node in ast.walk(ast.parse((ROOT / folder / f"{module}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found |= {node.module} if node.module else {alias.name for alias in node.names}
        out[module] = found & modules
    return out


@pytest.mark.parametrize("folder", PACKAGES)
def test_a_package_by_role_has_no_import_cycle_and_no_module_imports_its_front(folder):
    """The modules import one another only downward: a cycle is an error, and so is a module importing the
    package's `__init__` (the front that composes them)."""
    graph = package_imports(folder)
    assert not any("__init__" in names for module, names in graph.items() if module != "__init__")
    visiting, done = set(), set()

    def visit(module, path):
        assert module not in visiting, f"import cycle in {folder}: {' -> '.join(path + [module])}"
        if module in done:
            return
        visiting.add(module)
        for name in sorted(graph[module]):
            visit(name, path + [module])
        visiting.discard(module)
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


@pytest.mark.parametrize("folder", PACKAGES)
def test_a_package_by_role_reads_no_private_name_across_its_modules(folder):
    """No `from .x import _private`, no `x._private` on a sibling module, and no `obj._private` on an object
    of another module (a leading underscore is that module's own business)."""
    found = []
    for path in sorted((ROOT / folder).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 1:
                found += [f"{path.name}: from .{node.module or ''} import {a.name}" for a in node.names
                          if a.name.startswith("_") and a.name != "__version__"]
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert not found, "private names read across modules:\n" + "\n".join(found)



def test_every_test_module_has_a_basename_of_its_own():
    """tests/ has no __init__.py files, so pytest imports each test module by its basename: two files of one
    name in different folders stop the collection of the second (the whole suite fails)."""
    names: dict[str, list[str]] = {}
    for path in python_files("tests"):
        names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {name: paths for name, paths in names.items() if len(paths) > 1 and name != "conftest.py"}


@pytest.mark.parametrize("family", FAMILIES)
def test_no_family_reimplements_a_shared_job(family):
    """Building the tiny preset, adding adapters and writing the ComfyUI file are the seam's jobs (issue 26): a family
    declares its parts (presets/<module>.py, `default_lora_targets`, `original_names` ...), never its own copy."""
    from vt.shared.models.spec import ModelSpec

    cls = get_spec_class(family)
    for job in ("make_tiny", "add_lora", "save_comfy_lora", "save_lora"):
        assert getattr(cls, job).__qualname__ == getattr(ModelSpec, job).__qualname__, f"{family} re-implements {job}"
