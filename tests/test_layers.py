"""The library's layers: imports flow one way, from the application down to the base, and no module imports itself
back through others. Every import counts, those inside functions too (docs/DESIGN.md says which layer is which)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gallery_lib"

LAYERS = {  # lowest first: a module may import its own layer and those below it
    "config": 0,
    "data": 1, "models": 1, "tasks": 1, "accel": 1,
    "run": 2,
    "recipes": 3,
    "reports": 4,
    "app": 5,
}


def module_name(path: Path, root: Path = PACKAGE.parent) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def internal_imports(path: Path, modules: set[str], root: Path = PACKAGE.parent) -> set[str]:
    """The library modules ``path`` imports, at its top or inside its functions (``from pkg import submodule``
    names the submodule)."""
    name, is_package = module_name(path, root), path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target.startswith("gallery_lib") and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): internal_imports(path, modules) for path in paths}


def layer_of(module: str) -> int | None:
    """The module's layer; ``None`` for the package root, whose ``__init__`` only names what others define."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    if parts[1] not in LAYERS:
        raise AssertionError(f"{module} is in no layer: add gallery_lib/{parts[1]} to LAYERS and to docs/DESIGN.md")
    return LAYERS[parts[1]]


def test_every_import_goes_down_or_sideways():
    upward = []
    for module, imported in import_graph().items():
        for target in imported:
            low, high = layer_of(module), layer_of(target)
            if low is not None and high is not None and high > low:
                upward.append(f"{module} imports {target}")
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(sorted(upward))


def test_no_module_imports_itself_back():
    graph = import_graph()
    cycles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("source, expected", [
    ("from gallery_lib.app import cli\n", "upward"),
    ("def later():\n    from gallery_lib.recipes.named import baseline\n", "upward"),
    ("from gallery_lib.config.settings import ConfigError\n", "fine"),
])
def test_the_check_sees_an_upward_import_even_inside_a_function(tmp_path, source, expected):
    package = tmp_path / "gallery_lib"
    for folder in ("app", "recipes", "config", "run"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    for module in ("app/cli", "recipes/named", "config/settings"):
        (package / f"{module}.py").write_text("")
    probe = package / "run" / "probe.py"
    probe.write_text(source)
    modules = {module_name(path, tmp_path) for path in package.rglob("*.py")}
    imported = internal_imports(probe, modules, tmp_path)
    goes_up = any(LAYERS[target.split(".")[1]] > LAYERS["run"] for target in imported)
    assert goes_up == (expected == "upward")

