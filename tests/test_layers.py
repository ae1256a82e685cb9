"""The library's layers: imports flow one way, from the application down to the base, and no module (and no folder)
imports itself back through others. Every import counts: those inside functions, a name taken from the package root
(``from gallery_lib import compare``), and a string that names a module (``importlib.import_module("...")``, a
table of module names). ``data_prep/`` is checked too. docs/DESIGN.md says which layer is which. Inside
``accel/kernels/`` the same holds for its floors: ops, the layers built from them, the swap table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("gallery_lib", "data_prep")

LAYERS = {  # lowest first: a module may import its own layer and those below it
    "data_prep": 0,  # writes the mock data sets; imports nothing of the library
    "gallery_lib.config": 0,
    "gallery_lib.data": 1, "gallery_lib.models": 1, "gallery_lib.tasks": 1, "gallery_lib.accel": 1,
    "gallery_lib.families": 2,
    "gallery_lib.run": 3,
    "gallery_lib.recipes": 4,
    "gallery_lib.reports": 5,
    "gallery_lib.app": 6,
}
ALLOWED = {}  # "importer imports target": one-line reason; a violation not fixed yet (none now)
MODULE_STRING = re.compile(r"^(?:gallery_lib|data_prep)(?:\.\w+)+$")


def module_name(path: Path, root: Path = REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def public_names(root: Path = REPO) -> dict[str, str]:
    """The package root's lazy names (``_PUBLIC`` in ``gallery_lib/__init__.py``): name -> the module defining it."""
    for node in ast.walk(ast.parse((root / "gallery_lib" / "__init__.py").read_text())):
        if isinstance(node, ast.Assign) and any(getattr(target, "id", "") == "_PUBLIC" for target in node.targets):
            return ast.literal_eval(node.value)
    return {}


def internal_imports(path: Path, modules: set[str], root: Path, public: dict[str, str]) -> set[str]:
    """The library modules ``path`` imports: at its top or inside its functions (``from pkg import submodule`` names
    the submodule), through the package root's names, or named in a string (docstrings aside)."""
    name, is_package = module_name(path, root), path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    targets = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full not in modules and base == "gallery_lib":
                    full = public.get(alias.name, base)  # a name the root imports from its module on first use
                targets.append(full if full in modules else base)
        elif isinstance(node, ast.Attribute) and getattr(node.value, "id", "") == "gallery_lib":
            targets.append(public.get(node.attr, "gallery_lib"))  # gallery_lib.compare after `import gallery_lib`
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if MODULE_STRING.match(node.value):
                targets.append(node.value)
    found = set()
    for target in targets:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target.split(".")[0] in PACKAGES and target != name:
            found.add(target)
    return found


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    paths = sorted(path for package in PACKAGES for path in (root / package).rglob("*.py"))
    modules, public = {module_name(path, root) for path in paths}, public_names(root)
    graph = {module_name(path, root): internal_imports(path, modules, root, public) for path in paths}
    graph["gallery_lib"] = set()  # the root imports what it names on first use only: it is in no layer
    return graph


def folder_of(module: str) -> str | None:
    """``gallery_lib.<folder>`` or the top-level package; ``None`` for gallery_lib's root, whose ``__init__`` only
    names what others define."""
    parts = module.split(".")
    if parts[0] != "gallery_lib":
        return parts[0]
    return None if len(parts) == 1 else f"gallery_lib.{parts[1]}"


def layer_of(module: str) -> int | None:
    folder = folder_of(module)
    if folder is not None and folder not in LAYERS:
        raise AssertionError(f"{module} is in no layer: add {folder} to LAYERS and to docs/DESIGN.md")
    return None if folder is None else LAYERS[folder]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    upward = []
    for module, imported in graph.items():
        for target in imported:
            low, high = layer_of(module), layer_of(target)
            if low is not None and high is not None and high > low:
                upward.append(f"{module} imports {target}")
    return sorted(line for line in upward if line not in ALLOWED)


def cycles(graph: dict[str, set[str]]) -> list[str]:
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                found.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Which folder imports which: two folders of one layer may share parts one way only."""
    folders: dict[str, set[str]] = {}
    for module, imported in graph.items():
        for target in imported:
            if f"{module} imports {target}" in ALLOWED:
                continue
            low, high = folder_of(module), folder_of(target)
            if low is not None and high is not None and low != high:
                folders.setdefault(low, set()).add(high)
    return folders


def test_every_import_goes_down_or_sideways():
    upward = upward_imports(import_graph())
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_module_imports_itself_back():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(found)


def test_no_folder_imports_itself_back():
    graph = import_graph()
    found = cycles(folder_graph(graph))
    examples = {(folder_of(m), folder_of(t)): f"{m} imports {t}" for m, ts in graph.items() for t in ts}
    detail = [f"{cycle}  (e.g. {examples[tuple(cycle.split(' -> ')[:2])]})" for cycle in found]
    assert not found, "folders that import each other:\n" + "\n".join(detail)


def test_every_allowed_violation_still_exists():
    graph = import_graph()
    lines = {f"{module} imports {target}" for module, imported in graph.items() for target in imported}
    assert not set(ALLOWED) - lines, "ALLOWED lists imports that are gone: remove them"


KERNELS = "gallery_lib.accel.kernels"
KERNEL_FLOORS = {  # gallery_lib/accel/kernels/__init__.py: every other module of the package is an op (floor 0)
    f"{KERNELS}.modules": 1, f"{KERNELS}.conv_bn_block": 1,  # the layers built from the ops
    f"{KERNELS}.patch": 2,  # the swap table that puts them in a model
}


def in_kernels(module: str) -> bool:
    return module == KERNELS or module.startswith(f"{KERNELS}.")


def kernel_floor_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports inside the kernels package that go up its floors (an op importing a layer, a layer the table)."""
    return sorted(f"{module} imports {target}" for module, imported in graph.items() if in_kernels(module)
                  for target in imported
                  if in_kernels(target) and KERNEL_FLOORS.get(target, 0) > KERNEL_FLOORS.get(module, 0))


def private_kernel_imports(graph: dict[str, set[str]]) -> list[str]:
    """Modules outside the kernels package that import one of its private modules (``_triton_utils``)."""
    return sorted(f"{module} imports {target}" for module, imported in graph.items() if not in_kernels(module)
                  for target in imported if target.startswith(f"{KERNELS}._"))


def test_the_kernels_import_down_their_floors():
    found = kernel_floor_violations(import_graph())
    assert not found, "imports up the kernels' floors (ops -> modules -> patch):\n" + "\n".join(found)


def test_the_library_calls_the_kernels_by_their_public_names():
    found = private_kernel_imports(import_graph())
    assert not found, "private kernel modules imported from outside the package:\n" + "\n".join(found)


# The checker's own tests: each plants a violation in a small package and sees it caught.

def plant(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    """A package tree under ``tmp_path`` (``{"gallery_lib/run/probe.py": source}``; folders get an ``__init__``),
    and its import graph."""
    for relative, source in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    for package in PACKAGES:
        (tmp_path / package).mkdir(exist_ok=True)
        for folder in [tmp_path / package, *(p for p in (tmp_path / package).rglob("*") if p.is_dir())]:
            (folder / "__init__.py").touch()
    return import_graph(tmp_path)


LOWER = {"gallery_lib/app/cli.py": "", "gallery_lib/recipes/named.py": "", "gallery_lib/config/settings.py": ""}


@pytest.mark.parametrize("source, expected", [
    ("from gallery_lib.app import cli\n", "upward"),
    ("def later():\n    from gallery_lib.recipes.named import baseline\n", "upward"),
    ("from gallery_lib.config.settings import ConfigError\n", "fine"),
    ("from gallery_lib import compare\n", "upward"),  # through the package root's lazy names
    ("import gallery_lib\nrun = gallery_lib.compare\n", "upward"),
    ("from gallery_lib import __version__\n", "fine"),
    ("import importlib\nimportlib.import_module('gallery_lib.app.cli')\n", "upward"),
    ("PLUGINS = ('gallery_lib.recipes.named',)\n", "upward"),  # a table of names imported later
    ("'''See gallery_lib.app.cli.'''\n", "fine"),  # a docstring only points
])
def test_the_check_sees_every_kind_of_upward_import(tmp_path, source, expected):
    init = "_PUBLIC = {'compare': 'gallery_lib.app.cli'}\n__version__ = '0'\n"
    graph = plant(tmp_path, {**LOWER, "gallery_lib/__init__.py": init, "gallery_lib/run/probe.py": source})
    assert bool(upward_imports({"gallery_lib.run.probe": graph["gallery_lib.run.probe"]})) == (expected == "upward")


def test_the_check_sees_folders_of_one_layer_import_each_other(tmp_path):
    graph = plant(tmp_path, {
        "gallery_lib/models/family.py": "from gallery_lib.tasks.task import Task\n",
        "gallery_lib/tasks/task.py": "def later():\n    from gallery_lib.models.parts import block\n",
        "gallery_lib/models/parts.py": "",
    })
    assert not cycles(graph)  # no module imports itself back ...
    assert cycles(folder_graph(graph)) == ["gallery_lib.models -> gallery_lib.tasks -> gallery_lib.models"]


def test_the_check_sees_an_import_up_the_kernels_floors(tmp_path):
    graph = plant(tmp_path, {
        "gallery_lib/accel/kernels/geglu.py": "def later():\n    from gallery_lib.accel.kernels.modules import m\n",
        "gallery_lib/accel/kernels/modules.py": "from gallery_lib.accel.kernels.geglu import geglu\n",
        "gallery_lib/accel/kernels/patch.py": "from gallery_lib.accel.kernels.modules import m\n",
        "gallery_lib/accel/kernels/_triton_utils.py": "",
        "gallery_lib/accel/ema.py": "from gallery_lib.accel.kernels._triton_utils import sm_count\n",
    })
    assert kernel_floor_violations(graph) == [f"{KERNELS}.geglu imports {KERNELS}.modules"]
    assert private_kernel_imports(graph) == [f"gallery_lib.accel.ema imports {KERNELS}._triton_utils"]


def test_the_check_reads_data_prep(tmp_path):
    graph = plant(tmp_path, {**LOWER, "data_prep/maker.py": "from gallery_lib.app.cli import main\n"})
    assert upward_imports(graph) == ["data_prep.maker imports gallery_lib.app.cli"]
    with pytest.raises(AssertionError, match="no layer"):
        upward_imports(plant(tmp_path, {"gallery_lib/newfolder/x.py": "from gallery_lib.config import settings\n"}))


# In run/ and the parts below it a function takes the section of the config it needs; recipes and the app handle
# whole configs by their nature. The goal is 10 or fewer; this ceiling only falls, each time one is rewritten.
WHOLE_CONFIG_CEILING = 10
WHOLE_CONFIG_FOLDERS = ("run", "data", "models", "tasks", "accel")


def whole_config_functions(root: Path = REPO) -> list[str]:
    """``module:function`` for each function in those folders with a parameter annotated ``RunConfig``, or one
    named ``cfg`` without an annotation (the same config, unseen by a type checker)."""
    found = []
    for folder in WHOLE_CONFIG_FOLDERS:
        for path in sorted((root / "gallery_lib" / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                        "RunConfig" in ast.unparse(arg.annotation) if arg.annotation is not None else arg.arg == "cfg"
                        for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs):
                    found.append(f"{module_name(path, root)}:{node.name}")
    return found


def test_few_functions_below_the_recipes_take_the_whole_config():
    found = whole_config_functions()
    assert len(found) <= WHOLE_CONFIG_CEILING, (
        f"{len(found)} functions in {', '.join(WHOLE_CONFIG_FOLDERS)} take the whole RunConfig (at most "
        f"{WHOLE_CONFIG_CEILING}): pass the fields or section a new one needs instead. All: {found}")


def test_the_count_sees_a_function_taking_the_whole_config(tmp_path):
    module = tmp_path / "gallery_lib" / "run" / "planted.py"
    module.parent.mkdir(parents=True)
    module.write_text("def planted(cfg: 'RunConfig', *, other: int) -> None: ...\ndef fine(steps: int): ...\n"
                      "def unannotated(model, cfg): ...\ndef section(cfg: 'Training'): ...\n")
    assert whole_config_functions(tmp_path) == ["gallery_lib.run.planted:planted",
                                                "gallery_lib.run.planted:unannotated"]
