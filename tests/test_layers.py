"""The library's map is enforced: core never imports a recipe or tooling, no import cycles."""

import ast
import re
from pathlib import Path

import pytest

import recipes_lib

PACKAGE = Path(recipes_lib.__file__).parent
LAYERS = {name: set(re.findall(r"[\w_]+", block.split(":", 1)[1].split(".\n")[0]))
          for name, block in zip(("core", "recipe", "tooling"),
                                 re.split(r"\n(?=Recipes|Tooling)",
                                          recipes_lib.__doc__.split("\n\n", 1)[1]))}
RANK = {"core": 0, "recipe": 1, "tooling": 2}


def imports_of(path: Path) -> set[str]:
    """recipes_lib modules imported anywhere in ``path`` (function-local imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "recipes_lib":
                found |= {a.name for a in node.names}
            elif node.module.startswith("recipes_lib."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names
                      if a.name.startswith("recipes_lib.")}
    return found


GRAPH = {p.stem: imports_of(p) - {p.stem} for p in PACKAGE.glob("*.py") if p.stem != "__init__"}


def layer(module: str) -> str:
    return next(name for name, members in LAYERS.items() if module in members)


def test_every_module_has_one_layer():
    listed = [m for members in LAYERS.values() for m in members]
    assert sorted(listed) == sorted(GRAPH), "recipes_lib/__init__.py must list every module once"


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_go_down_the_layers(module):
    upward = {dep: layer(dep) for dep in GRAPH[module] if RANK[layer(dep)] > RANK[layer(module)]}
    assert not upward, f"{layer(module)} module {module} imports {upward}"


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(GRAPH.get(module, ())):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])


def test_the_checker_finds_a_cycle_and_an_upward_import(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    from recipes_lib.b import g\n")
    (tmp_path / "b.py").write_text("from recipes_lib import a, fsdp\n")
    assert imports_of(tmp_path / "a.py") == {"b"}
    assert imports_of(tmp_path / "b.py") == {"a", "fsdp"}
