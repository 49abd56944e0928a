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


def test_every_package_folder_ships_in_the_wheel():
    """pyproject.toml lists vt's packages by hand (three folders map onto one `vt` namespace): a folder with an
    __init__.py that is not listed imports in an editable install and is missing from a built wheel."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {folder: package for package, folder in setuptools["package-dir"].items()}
    found = {
        folders[init.parent.relative_to(ROOT).parts[0]]
        + "".join(f".{part}" for part in init.parent.relative_to(ROOT).parts[1:])
        for folder in folders
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert found == set(setuptools["packages"]), f"packages not listed: {sorted(found - set(setuptools['packages']))}"


@pytest.mark.parametrize("stage", STAGES)
def test_the_stages_name_no_model_family(stage):
    """Adding a family touches its own file, the registry line and its tests, never the stages."""
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(family_words()))) + r")\b", re.IGNORECASE)
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in python_files(stage)
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if pattern.search(line)
    ]
    assert not found, "family names in a stage:\n" + "\n".join(found)


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_imports_the_other_stage_never(stage):
    """The stages share nothing but storage and vt.shared."""
    other = next(s for s in STAGES if s != stage)
    for path in python_files(stage):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else ([alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            )
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
                found += [
                    f"{path.name}: from .{node.module or ''} import {a.name}"
                    for a in node.names
                    if a.name.startswith("_") and a.name != "__version__"
                ]
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert not found, "private names read across modules:\n" + "\n".join(found)


def test_every_test_module_has_a_basename_of_its_own():
    """tests/ has no __init__.py files outside tests/helpers, so pytest imports each test module by its basename: two
    files of one name in different folders stop the collection of the second (the whole suite fails)."""
    names: dict[str, list[str]] = {}
    for path in python_files("tests"):
        names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {name: paths for name, paths in names.items() if len(paths) > 1 and name != "conftest.py"}


# Modules of tests/ outside the helpers package, each with its reason.
HELPERS_ELSEWHERE: dict[str, str] = {}


def test_every_module_of_tests_but_a_test_or_a_conftest_lives_in_the_helpers_package():
    """What tests share (helpers, worker scripts started by path) is found in one place, imported as
    `helpers.<name>`: no test folder holds a module that another folder's tests import by its bare name."""
    found = [
        str(path.relative_to(ROOT))
        for path in python_files("tests")
        if not path.name.startswith("test_")
        and path.name != "conftest.py"
        and path.parent != ROOT / "tests" / "helpers"
        and str(path.relative_to(ROOT)) not in HELPERS_ELSEWHERE
    ]
    assert not found, "modules of tests/ outside tests/helpers:\n" + "\n".join(found)
    assert all((ROOT / path).is_file() for path in HELPERS_ELSEWHERE), "an allowed module is gone: drop its line"


@pytest.mark.parametrize("family", FAMILIES)
def test_no_family_reimplements_a_shared_job(family):
    """Building the tiny preset, adding adapters and writing the ComfyUI file are the seam's jobs (issue 26): a family
    declares its parts (presets/<module>.py, `default_lora_targets`, `original_names` ...), never its own copy."""
    from vt.shared.models.spec import ModelSpec

    cls = get_spec_class(family)
    for job in ("make_tiny", "add_lora", "save_comfy_lora", "save_lora"):
        assert getattr(cls, job).__qualname__ == getattr(ModelSpec, job).__qualname__, f"{family} re-implements {job}"


def family_modules() -> dict[str, set[str]]:
    """family -> the stems of its own modules under shared/models (its spec's module, the role modules named after
    it, `<module>_<role>.py`, and its preset, presets/<module>.py)."""
    stems = {get_spec_class(family).__module__.rsplit(".", 1)[-1]: family for family in FAMILIES}
    out: dict[str, set[str]] = {family: set() for family in FAMILIES}
    for path in python_files("shared/models"):
        owner = max(
            (stem for stem in stems if path.stem == stem or path.stem.startswith(stem + "_")), key=len, default=None
        )
        if owner:
            out[stems[owner]].add(str(path.relative_to(ROOT)))
    return out


def test_no_module_but_a_familys_own_and_the_registry_imports_or_names_it_in_code():
    """A new family touches its own modules and the registry line: no other module of shared/, precompute/ or train/
    imports a family module or names a family in a string (docstrings and comments may cite one as an example). A
    family module may build on another family's (Kandinsky 6 on Kandinsky 5, SkyReels V2 on Wan)."""
    owned = family_modules()
    family_files = set().union(*owned.values())
    modules = {get_spec_class(family).__module__.rsplit(".", 1)[-1] for family in FAMILIES}
    names = set(FAMILIES)
    exempt = {
        "shared/models/__init__.py",  # the registry
        "shared/config.py",
    }  # `model.family`'s default: the embedded demo's family
    found = []
    for folder in ("shared", *STAGES):
        for path in python_files(folder):
            rel = str(path.relative_to(ROOT))
            if rel in family_files or rel in exempt:
                continue
            tree = ast.parse(path.read_text())
            docstrings = {
                id(node.body[0].value)
                for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and node.body
                and isinstance(node.body[0], ast.Expr)
            }
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").rsplit(".", 1)[-1] in modules:
                    found.append(f"{rel}:{node.lineno}: imports {node.module}")
                if isinstance(node, ast.ImportFrom) and node.module == "vt.shared.models":
                    found += [f"{rel}:{node.lineno}: imports {a.name}" for a in node.names if a.name in modules]
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and id(node) not in docstrings
                    and node.value in names
                ):
                    found.append(f"{rel}:{node.lineno}: names {node.value!r}")
    assert not found, "modules other than a family's own naming it:\n" + "\n".join(found)


FAMILY_MODULE_LINES = 300


def spread(text: str) -> bool:
    """A line that opens a bracketed list, holds one element of it, or only brackets: the lines ruff format spreads a
    call, literal or signature over when it is longer than a line (one element a line). The size and repeat rules
    count the others, so a module measures the same however its calls are wrapped."""
    text = text.strip()
    return text.endswith((",", "(", "[", "{")) or (bool(text) and text.strip("()[]{},:") == "")


def code_lines(path: Path) -> int:
    return sum(not spread(line) for line in path.read_text().splitlines())


def test_every_module_of_the_seam_is_small():
    """Every module under shared/models (spec, roles and family modules) is at most 300 lines (`code_lines`): tiny
    builders, tokenizer builders, pipeline handles and LoRA loaders live in modules of their own."""
    long = {
        str(path.relative_to(ROOT)): n
        for path in python_files("shared/models")
        if (n := code_lines(path)) > FAMILY_MODULE_LINES
    }
    assert not long, f"modules over {FAMILY_MODULE_LINES} lines: {long}"


SEAM_LINES = 5000


def test_the_seam_stays_small():
    """shared/models, every module under it (spec, roles, family modules, tiny presets), is at most 5,000 lines for
    its 14 families (issue 26's target; `code_lines`): weight and LoRA file formats live in shared/weights, a new family adds its
    own module(s) and shares what it has in common with another."""
    total = sum(code_lines(path) for path in python_files("shared/models"))
    assert total <= SEAM_LINES, f"shared/models is {total} lines, over {SEAM_LINES}"


def test_no_six_lines_repeat_inside_the_seam():
    """No run of six code lines stands twice in two modules under shared/models (docstrings, comments, imports, the
    lines a call or literal is spread over (`spread`) and method signatures aside): what two families share is one function of the seam's, not a copy."""
    seen: dict[tuple[str, ...], str] = {}
    repeats = []
    for path in python_files("shared/models"):
        source = path.read_text()
        tree = ast.parse(source)
        docstrings = {
            line
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
            and isinstance(node.body[0].value.value, str)
            for line in range(node.body[0].lineno, node.body[0].end_lineno + 1)
        }
        # A method's decorators and signature are the seam's interface, the same in every family by design.
        signatures = {
            line
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for line in range(min([node.lineno, *(d.lineno for d in node.decorator_list)]), node.body[0].lineno)
        }
        code = [
            (number, line.strip())
            for number, line in enumerate(source.splitlines(), start=1)
            if number not in docstrings | signatures
        ]
        code = [
            (n, text)
            for n, text in code
            if text and not text.startswith(("#", "import ", "from ")) and not spread(text)
        ]
        for start in range(len(code) - 5):
            window = tuple(text for _, text in code[start : start + 6])
            where = f"{path.relative_to(ROOT)}:{code[start][0]}"
            if window in seen and seen[window].split(":")[0] != where.split(":")[0]:
                repeats.append(f"{where} repeats {seen[window]}")
            seen.setdefault(window, where)
    assert not repeats, "\n".join(repeats)


# -- training parts: one home per option (vt.train.parts) ---------------------------------------------------------


def part_section_reads(source: str, owner: str | None) -> list[str]:
    """`config.<section>` reads of a training part's section in `source` (a module's text), but the part's own
    (`owner`: the section the module owns, None for none): an attribute of a name or attribute ending in "config"
    (config.ema, self.config.ema, trainer.config.ema), or getattr(config, "ema")."""
    from vt.train.parts import PARTS

    sections = {part.section for part in PARTS} - {owner}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in sections:
            holder = node.value
            name = holder.id if isinstance(holder, ast.Name) else getattr(holder, "attr", "")
            if name.endswith("config"):
                found.append(f"{node.lineno}: .{node.attr}")
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", "") == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in sections
        ):
            found.append(f"{node.lineno}: getattr {node.args[1].value}")
    return found


def test_no_module_outside_a_part_reads_its_config_section():
    """A training part's section (shared/part_configs.py) is read by its own module in train/parts only: the trainer,
    the plan and everything else call the part's hooks. The sections' declarations (shared/config.py,
    shared/part_configs.py) aside."""
    from vt.train.parts import PARTS

    owners = {ROOT / "train" / "parts" / f"{part.__module__.rsplit('.', 1)[-1]}.py": part.section for part in PARTS}
    declared = {ROOT / "shared" / "config.py", ROOT / "shared" / "part_configs.py"}
    reads = [
        f"{path.relative_to(ROOT)}:{read}"
        for folder in ("train", "precompute", "shared", "scripts")
        for path in python_files(folder)
        if path not in declared
        for read in part_section_reads(path.read_text(), owners.get(path))
    ]
    assert not reads, "a part's config section read outside its module:\n" + "\n".join(reads)
    planted = "def f(trainer):\n    return trainer.config.ema.decay, getattr(trainer.config, 'block_swap')\n"
    assert sorted(part_section_reads(planted, None)) == ["2: .ema", "2: getattr block_swap"]
    assert part_section_reads(planted, "ema") == ["2: getattr block_swap"]  # the EMA part's own module reads .ema


def test_every_part_has_a_section_a_test_and_a_docs_entry():
    """Adding an option is its part's module, its section, a test that sets it and its line in docs/stage2.md."""
    from vt.shared.config import Config
    from vt.train.parts import PARTS

    stage2 = (ROOT / "docs" / "stage2.md").read_text()
    tests = "\n".join(path.read_text() for path in (ROOT / "tests").rglob("test_*.py"))
    for part in PARTS:
        module = part.__module__
        assert part.section in Config.model_fields, f"{module}: no [{part.section}] section in the config"
        assert f"train/parts/{module.rsplit('.', 1)[-1]}.py" in stage2, f"docs/stage2.md does not name {module}"
        assert f"[{part.section}]" in stage2, f"docs/stage2.md shows no [{part.section}] section"
        used = re.search(rf'"{part.section}"|\b{part.section}=|\b{part.section}\.\w+\s*=|\[{part.section}\]', tests)
        assert used, f"no test sets [{part.section}] ({module})"


def private_spec_reads(source: str) -> list[int]:
    """Lines of `source` reading a private name (`_x`, not `__x__`) of a Model Spec: of a variable or attribute named
    `spec` or `<something>_spec`, or of a parameter annotated with a spec class (`ModelSpec`, `WanSpec` ...)."""
    tree = ast.parse(source)
    typed = {
        node.arg
        for node in ast.walk(tree)
        if isinstance(node, ast.arg) and node.annotation is not None
        for name in [ast.unparse(node.annotation)]
        if re.search(r"Spec\b", name)
    }

    def is_spec(node: ast.expr) -> bool:
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return name.lower().endswith("spec") or (isinstance(node, ast.Name) and node.id in typed)

    return sorted(
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and is_spec(node.value)
    )


def test_the_private_spec_check_finds_a_planted_read():
    planted = (
        "def f(spec, other, model: ModelSpec, w: 'WanSpec'):\n"
        "    spec.class_of('vae')\n"
        "    other._x\n"
        "    spec.__class__\n"
        "    spec._class_of('vae')\n"
        "    self.spec._vae_mode\n"
        "    model._geometry_from_config()\n"
        "    w._y\n"
        "    wan_spec._z\n"
    )
    assert private_spec_reads(planted) == [5, 6, 7, 8, 9]


def test_no_private_name_of_a_spec_is_read_outside_the_seam():
    """A spec's private names are its own and the seam's (shared/models): the stages, the rest of vt.shared, the
    scripts and the tests use its public accessors (`class_of`, `vae_mode`, `vae_tiles` ...)."""
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for folder in ("shared", *STAGES, "scripts", "tests")
        for path in python_files(folder)
        if not path.is_relative_to(ROOT / "shared" / "models")
        for line in private_spec_reads(path.read_text())
    ]
    assert not found, "private names of a spec read outside shared/models:\n" + "\n".join(found)


TASK_READERS = ("shared/config.py", "shared/models/frame_conditions.py")


def test_model_task_is_read_only_by_the_frame_conditions_role():
    """`model.task` decides which of a clip's frames condition it (i2v, flf2v): the spec's `frame_conditions` role
    (shared/models/frame_conditions.py) owns that, so families, stages and scripts ask the role, never `.task`."""
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for folder in ("shared", *STAGES, "scripts")
        for path in python_files(folder)
        if str(path.relative_to(ROOT)) not in TASK_READERS
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "task"
    ]
    assert not found, "`.task` read outside the frame-conditions role:\n" + "\n".join(found)
