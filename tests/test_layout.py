"""What the wheel holds, read from pyproject.toml the way setuptools reads it: the library and its data, no tooling or
tests; and the library's modules import no tooling or test code."""

import ast
from pathlib import Path

import pytest
from setuptools import find_packages

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the layout is the same on 3.10

ROOT = Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_the_wheel_packages_the_library_only():
    packages = find_packages(where=str(ROOT), include=SETUPTOOLS["packages"]["find"]["include"])
    assert packages and all(package.split(".")[0] == "trl_padfree" for package in packages), packages


def test_the_shipped_data_is_package_data():
    patterns = SETUPTOOLS["package-data"]["trl_padfree.data"]
    data = [path for path in (ROOT / "trl_padfree" / "data").iterdir() if path.suffix != ".py" and path.is_file()]
    assert data and all(any(path.match(pattern) for pattern in patterns) for path in data), data


def test_the_library_imports_no_tooling_or_tests():
    for module in (ROOT / "trl_padfree").rglob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in ("tools", "tests"), f"{module.relative_to(ROOT)} imports {name}"


def _imported_modules(path: Path, package: list[str]) -> set[str]:
    """The package's modules `path` imports at its top level (function-level imports are for what runs later)."""
    imported = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            if node.module:
                imported.add(".".join(base + node.module.split(".")))
            else:  # `from . import a, b`: the submodules
                imported.update(".".join([*base, alias.name]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trl_padfree"):
            imported.add(node.module)
    return imported


def test_no_import_cycle_in_the_library():
    graph = {}
    for path in (ROOT / "trl_padfree").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        graph[module] = _imported_modules(path, parts[:-1] if is_package else parts[:-1])

    def known(name: str) -> str | None:  # `a.b.name` -> the module `a.b` when `name` is an attribute
        while name and name not in graph:
            name = name.rpartition(".")[0]
        return name or None

    edges = {module: {known(name) for name in names} - {None, module} for module, names in graph.items()}
    state, path = {}, []

    def visit(module: str) -> None:
        state[module] = "open"
        path.append(module)
        for imported in sorted(edges[module]):
            assert state.get(imported) != "open", "import cycle: " + " -> ".join(
                path[path.index(imported) :] + [imported]
            )
            if imported not in state:
                visit(imported)
        path.pop()
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module)
