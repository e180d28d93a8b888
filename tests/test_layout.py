"""The package's layout, checked: what the wheel holds (read from pyproject.toml the way setuptools reads it: the
library and its data, no tooling or tests); no import cycle, counting imports inside functions; the top level holds
only the entry points and what users import by path, everything else in a subpackage by concern; no library function
over 60 lines but argparse builders; private names of the libraries under trl-padfree only under integrations/."""

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


def _imported_modules(path: Path, package: list[str], annotations: bool = False) -> set[str]:
    """The package's modules `path` imports, at its top level and inside functions alike: a function-level import
    only postpones a cycle to the first call. Imports for type annotations only (`if TYPE_CHECKING:`) never run; with
    `annotations`, they count too."""
    imported = set()
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for inner in ast.walk(node)
    }
    if annotations:
        typing_only = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            if node.module:
                imported.add(".".join(base + node.module.split(".")))
            else:  # `from . import a, b`: the submodules
                imported.update(".".join([*base, alias.name]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trl_padfree"):
            imported.add(node.module)
    return imported


def _package_import_graph(annotations: bool = False) -> dict[str, set[str]]:
    graph = {}
    for path in (ROOT / "trl_padfree").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        graph[module] = _imported_modules(path, parts[:-1], annotations)

    def known(name: str) -> str | None:  # `a.b.name` -> the module `a.b` when `name` is an attribute
        while name and name not in graph:
            name = name.rpartition(".")[0]
        return name or None

    return {module: {known(name) for name in names} - {None, module} for module, names in graph.items()}


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state, path = {}, []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for imported in sorted(edges[module]):
            if state.get(imported) == "open":
                return path[path.index(imported) :] + [imported]
            if imported not in state:
                cycle = visit(imported)
                if cycle:
                    return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(edges):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_no_import_cycle_in_the_library():
    cycle = _find_cycle(_package_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_even_for_annotations():
    # A type two modules annotate with lives below both (modeling/packed_batch.py's `PackedBatch`)
    cycle = _find_cycle(_package_import_graph(annotations=True))
    assert cycle is None, "import cycle, counting `if TYPE_CHECKING:` imports: " + " -> ".join(cycle)


def test_the_refusals_import_nothing_else_of_the_package():
    # Plain-value rules: a feature gathers the values and calls its rule, so a rule cannot grow a second copy there
    graph = _package_import_graph(annotations=True)
    refusals = {module for module in graph if module.split(".")[:2] == ["trl_padfree", "refusals"]}
    outside = {module: graph[module] - refusals for module in sorted(refusals) if graph[module] - refusals}
    assert len(refusals) > 1 and not outside, outside


def test_the_cycle_check_sees_imports_inside_functions(tmp_path):
    edges = {"a": {"b"}, "b": {"a"}}  # as `_imported_modules` reports a function-level import back
    assert _find_cycle(edges) == ["a", "b", "a"]
    module = tmp_path / "module.py"
    module.write_text("def late():\n    from .other import thing\n")
    assert _imported_modules(module, ["pkg"]) == {"pkg.other"}


# The package's top level: its entry points and what users import by path; every other module lives in a subpackage
TOP_LEVEL_MODULES = {"__init__", "_compat", "config", "settings", "trainer", "tiny", "sources"}
SUBPACKAGES = {
    "features", "packing", "modeling", "parallel", "placement", "integrations", "cli", "plan", "data", "costs",
    "refusals",
}  # fmt: skip


# The bottom floor: pure code that imports nothing of the package, so every package can build on it
FLOOR = ("trl_padfree.costs",)
# What packing/ and modeling/ build on stays below the planner (`trl-padfree plan`), which reads them
BELOW_THE_PLANNER = ("trl_padfree.packing", "trl_padfree.modeling")
# The trainer's feature objects (features/) drive the mechanisms: those never reach back up to a feature
BELOW_THE_FEATURES = ("trl_padfree.packing", "trl_padfree.parallel", "trl_padfree.placement", "trl_padfree.modeling")


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)


def test_the_cost_model_is_the_bottom_floor():
    graph = _package_import_graph()
    assert any(_in(module, FLOOR) for module in graph), FLOOR
    up = {
        module: sorted(names)
        for module, names in graph.items()
        if _in(module, FLOOR) and not all(_in(n, FLOOR) for n in names)
    }
    assert not up, up


def _imports_up(graph: dict[str, set[str]], below: tuple[str, ...], above: str) -> list[str]:
    """Imports from a module of the packages `below` into the package `above`."""
    return [
        f"{module} -> {name}"
        for module, names in graph.items()
        if _in(module, below)
        for name in names
        if _in(name, (above,))
    ]


def test_packing_and_modeling_import_nothing_of_the_planner():
    up = _imports_up(_package_import_graph(), BELOW_THE_PLANNER, "trl_padfree.plan")
    assert not up, up


def test_nothing_below_the_features_imports_them():
    # Annotations included: a mechanism that names a feature's type has a feature above it in its design too
    graph = _package_import_graph(annotations=True)
    assert any(_in(module, ("trl_padfree.features",)) for module in graph)
    up = _imports_up(graph, BELOW_THE_FEATURES, "trl_padfree.features")
    assert not up, up


def test_the_top_level_holds_the_entry_points_and_what_users_import_by_path():
    package = ROOT / "trl_padfree"
    modules = {path.stem for path in package.glob("*.py")}
    folders = {path.name for path in package.iterdir() if path.is_dir() and path.name != "__pycache__"}
    assert modules == TOP_LEVEL_MODULES, sorted(modules ^ TOP_LEVEL_MODULES)
    assert folders == SUBPACKAGES, sorted(folders ^ SUBPACKAGES)


def test_no_library_function_is_longer_than_60_lines():
    # argparse builders are one long list of options, read as such
    long = []
    for path in (ROOT / "trl_padfree").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name != "add_arguments":
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, long


# Underscore names of other code that are public by documentation: the standard library's immediate exit
PUBLIC_UNDERSCORE_NAMES = {"_exit"}


def _names_defined(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
            names.update(arg.arg for arg in node.args.args + node.args.kwonlyargs)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def test_private_names_of_other_libraries_only_under_integrations():
    """An underscore name the package reads outside integrations/ must be its own (defined outside integrations/):
    TRL's, transformers', accelerate's, DeepSpeed's and torch's go through integrations/, which tests/integrations/test_seams.py
    checks against the installed versions."""
    trees = {path: ast.parse(path.read_text()) for path in (ROOT / "trl_padfree").rglob("*.py")}
    outside = {path: tree for path, tree in trees.items() if "integrations" not in path.parts}
    ours = set().union(*(_names_defined(tree) for tree in outside.values())) | PUBLIC_UNDERSCORE_NAMES
    found = []
    for path, tree in outside.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if node.attr not in ours:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
            elif (
                isinstance(node, ast.ImportFrom)
                and not node.level
                and not (node.module or "").startswith("trl_padfree")
            ):
                private = [
                    alias.name for alias in node.names if alias.name.startswith("_") and alias.name != "__future__"
                ]
                found += [f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{name}" for name in private]
    assert not found, found
