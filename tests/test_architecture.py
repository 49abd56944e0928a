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
