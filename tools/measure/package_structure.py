"""The package's structure, read from its source with `ast` alone (nothing of it is imported): the import graph between
rooms and the floors it stacks them on, the settings read again where they are used, the features' reads of each
other's private state, the refusals' re-export list, and the set-up walk from `PaddingFree.enable`.

Run from the repository root: `python tools/measure/package_structure.py [--root DIR] [--resolver PATH]` (`--root`: the
directory that holds the package, e.g. a `git archive` of another commit).

Rooms. A module's room is the folder directly under the package that holds it (its subfolders with it:
`modeling.attention` is in `modeling`), or the module itself at the top level (`trl_padfree.config`,
`trl_padfree.trainer`, `trl_padfree._compat`), or the package's own `__init__`; `cli/bench` is a room of its own
(`ROOMS_APART`: the benchmark, a command of its own). This is the rule that gives the count the package was last
described by (18 rooms on 8 floors, no cycle). A finer view, every folder a room, is reported for its cycles only.

Imports. An import at module level (in a class body, `try` or `if` too) is eager and makes the graph. One inside a
function is lazy, one under `if TYPE_CHECKING:` type-only: both are listed apart and left out of the floors. `from X
import name` points at module `X.name` when that is a module, else at `X`; relative imports are resolved against the
importing module's package. Only imports of the package itself count.

Floors. A room's floor is 0 when it imports no other room, else 1 + the highest floor of the rooms it imports (eager
imports; rooms in one cycle share a floor). A module's floor is the same, in the graph between modules. Cycles are
strongly connected components of more than one room (or module, or folder), on the eager graph and again with the lazy
imports added.

Running up. Floors are derived from the eager imports, so no eager import can run up except inside a cycle: the eager
cycles are that check. What can run up besides is an import the floors did not see: a lazy or type-only import from a
room to a room on the same floor or a higher one (made eager, it would be a cycle or move the importer up). Those are
the imports running up; imports within one room never are.

Settings read again. A call `getattr(X, "<literal>", <default>)` with three arguments, X a name or attribute chain that
ends in `args` (`args`, `self.args`, `trainer.args`) or passes through it (`args.accelerator_config`), anywhere in the
package outside the resolver module (`--resolver`, default trl_padfree/settings.py).

Private cross-feature reads. In `features/*.py`, a read (not a store) of `<...>trainer._<name>` whose attribute is a
feature's state stored by someone else: `trainer._<name> = ...` in another feature, or `self._<name> = <Feature>(...)`
/ `<Feature>.set_up(...)` in trainer.py (a name imported from features/), which keeps each feature's object on the
trainer under a private name. A read of anything else private on the trainer (TRL's, transformers', a value trainer.py
keeps that is no feature's) and a feature's read of what it stores itself are listed, not counted.

Re-exports. The names `refusals/__init__.py` binds by import, together with those in its `__all__`.

The set-up walk. From `PaddingFree.enable` (features/padding_free.py), the static call tree is walked depth first in
source order (a compound statement's header before its body; an outer call before the calls in its arguments; calls in
nested functions and lambdas where they are written). A call resolves when it names a function or method of the
package: a name defined in the module or imported into it (re-exports followed), `module.function`, `Class.method`,
`self.method` / `cls.method` (the class and its bases in the package), `super().method`, `parameter.method` where the
parameter is annotated with a class of the package (`checked: CheckedModel`), and `Class(...)` when the class (or a base
in the package) defines `__init__` or `__post_init__` (building a plain record is not a stop). Other method calls on
objects (a local's type is not inferred) are not resolved.

The figure follows the trainer (`trainer-private-functions`). In `enable`, the trainer and every local derived from it
are followed: an attribute of it, a loop over one, a call's result that was passed one (the models, the collator). A
resolved call that passes a followed value on (the value itself, or an attribute chain, subscript or call rooted at
it; or is a method called on one) is a stop, and its callee follows the parameters that received one; below `enable`, a local joins them when it is
an attribute of a followed value, a loop over one, or the result of one of the module's private helpers (`_name(...)`)
passed one (`checked = _read_model(model)` is the model read on; a public function's result there, a twin or a batch,
is a new object). Each function is a stop the first time the walk reaches it and is expanded then only. A stop's floor
is its module's floor; a climb is a stop on a higher floor than the stop just before it in visit order (the walk starts
on `enable`'s floor). On the tree the count was first made on (57 stops in 18 files, 14 climbs, 7 at
modeling/check/packability.py), this rule gives 61, 19, 15 and 9; climbs on room floors are printed beside (9 there). Every
rule tried is printed; all but the first two follow only calls that pass the trainer on:

    sites / functions    every resolved call
    trainer-*            locals derived from a followed value: `trainer-sites` / `trainer-functions` through any
                         call's result in every function, `-private-` as the figure, `-start-` derived in `enable`
                         only, `-attributes-` attribute chains only, `-direct-` none
    *-sites / *-functions  a revisited function counted at each call / each function once

Any static rule can be walked around (a value read on through a public function is no longer followed under the
figure's rule); `trainer-functions`, which derives through every call, is the one to compare when the figure drops.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "trl_padfree"
RESOLVER = "trl_padfree/settings.py"
WALK_START = ("trl_padfree.features.padding_free", "PaddingFree.enable")
# name: (follow only calls that pass the trainer on, which locals join the followed values, count revisits). Locals:
# "values" through any call's result, "attributes" attribute chains and loops only, "none"; "start" as "values" in the
# start function and "none" below it, "start-private" as "values" there and below it attributes and private helpers'
# results
WALK_VARIANTS = {
    "sites": (False, "none", True),
    "functions": (False, "none", False),
    "trainer-sites": (True, "values", True),
    "trainer-functions": (True, "values", False),
    "trainer-attributes-sites": (True, "attributes", True),
    "trainer-attributes-functions": (True, "attributes", False),
    "trainer-start-sites": (True, "start", True),
    "trainer-start-functions": (True, "start", False),
    "trainer-private-sites": (True, "start-private", True),
    "trainer-private-functions": (True, "start-private", False),
    "trainer-direct-sites": (True, "none", True),
    "trainer-direct-functions": (True, "none", False),
}
MAIN_WALK = "trainer-private-functions"
CLIMB_LEVEL = "module"  # the floors a climb is counted on
ROOMS_APART = ("cli.bench",)  # folders below the top that are rooms of their own


# ---------------------------------------------------------------------------------------------------------------- #
# Modules


@dataclass
class Module:
    name: str
    path: Path  # relative to the repository root
    tree: ast.Module
    is_package: bool  # an __init__.py

    @property
    def package(self) -> str:
        """The package relative imports are resolved against."""
        return self.name if self.is_package else self.name.rpartition(".")[0]


def read_modules(root: Path, package: str = PACKAGE) -> dict[str, Module]:
    """Every module of `package` under `root`, parsed."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        relative = path.relative_to(root)
        parts = list(relative.with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        name = ".".join(parts)
        modules[name] = Module(name, relative, ast.parse(path.read_text(), str(relative)), is_package)
    return modules


def room_of(module: str, package: str = PACKAGE, rooms_apart: tuple[str, ...] = ROOMS_APART) -> str:
    """The room `module` is in: the package's own `__init__`, a top-level module, a folder directly under the package
    (what is in its subfolders with it), or a folder of `rooms_apart` (the module docstring's rule)."""
    for room in rooms_apart:
        if module == f"{package}.{room}" or module.startswith(f"{package}.{room}."):
            return f"{package}.{room}"
    return ".".join(module.split(".")[:2])


def folder_of(module: str, packages: set[str]) -> str:
    """The finer room: the folder `module` is in (a package is its own), or the module itself at the top level."""
    if module in packages:
        return module
    folder = module.rpartition(".")[0]
    return module if "." not in folder else folder


# ---------------------------------------------------------------------------------------------------------------- #
# Imports


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    line: int
    kind: str  # "eager", "lazy" (inside a function) or "type-only" (under `if TYPE_CHECKING:`)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk_with_kind(node: ast.AST, kind: str = "eager") -> Iterator[tuple[ast.AST, str]]:
    """Every node under `node` with the kind an import there would have."""
    for child in ast.iter_child_nodes(node):
        child_kind = kind
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            child_kind = "lazy"
        if isinstance(child, ast.If) and _is_type_checking(child.test) and kind == "eager":
            yield child, kind
            for statement in child.body:
                yield statement, "type-only"
                yield from _walk_with_kind(statement, "type-only")
            for statement in child.orelse:
                yield statement, kind
                yield from _walk_with_kind(statement, kind)
            continue
        yield child, child_kind
        yield from _walk_with_kind(child, child_kind)


def resolve_from(module: Module, level: int, name: str | None) -> str:
    """The absolute name of `from <level dots><name> import ...` written in `module`."""
    if level == 0:
        return name or ""
    base = module.package.split(".")
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports_of(module: Module, modules: dict[str, Module], package: str = PACKAGE) -> list[Import]:
    """The package's modules `module` imports, each import statement's targets once."""
    found = []
    for node, kind in _walk_with_kind(module.tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = resolve_from(module, node.level, node.module)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                targets.append(submodule if submodule in modules else source)
        for target in dict.fromkeys(targets):
            if (target == package or target.startswith(package + ".")) and target != module.name:
                found.append(Import(module.name, target, node.lineno, kind))
    return found


# ---------------------------------------------------------------------------------------------------------------- #
# Graphs


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of `graph` (iterative), each sorted, those of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    counter = 0
    nodes = sorted(set(graph) | {target for targets in graph.values() for target in targets})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def floors_of(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each node's floor: 0 with no edges out, else 1 + the highest floor below it; a cycle's nodes share one."""
    component_of = {node: node for node in graph}
    for component in strongly_connected(graph):
        for node in component:
            component_of[node] = component[0]
    condensed: dict[str, set[str]] = defaultdict(set)
    for node, targets in graph.items():
        condensed[component_of[node]] |= {component_of[t] for t in targets if component_of[t] != component_of[node]}
    floors: dict[str, int] = {}

    def floor(node: str) -> int:
        if node not in floors:
            floors[node] = 1 + max((floor(t) for t in condensed[node]), default=-1)
        return floors[node]

    return {node: floor(component_of[node]) for node in graph}


# ---------------------------------------------------------------------------------------------------------------- #
# Settings read again, private cross-feature reads, re-exports


@dataclass(frozen=True)
class Site:
    file: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}  {self.text}"


def _chain(node: ast.expr) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"]; None for anything else."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(names)]


def settings_reads(modules: dict[str, Module], resolver: str = RESOLVER) -> list[Site]:
    """`getattr(<...>args[.<...>], "<literal>", <default>)` calls outside `resolver` (a path from the root)."""
    sites = []
    for module in modules.values():
        if module.path.as_posix() == resolver:
            continue
        for node in ast.walk(module.tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"):
                continue
            if len(node.args) != 3 or node.keywords:
                continue
            chain = _chain(node.args[0])
            name = node.args[1]
            if chain is None or "args" not in chain or not isinstance(name, ast.Constant):
                continue
            if not isinstance(name.value, str):
                continue
            sites.append(Site(module.path.as_posix(), node.lineno, ast.unparse(node)))
    return sorted(sites, key=lambda site: (site.file, site.line))


@dataclass(frozen=True)
class PrivateRead:
    site: Site
    attribute: str
    owner: str | None  # the file that stores it on the trainer; None: stored by no one in the package


def _trainer_private(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
        chain = _chain(node.value)
        if chain is not None and chain[-1] == "trainer":
            return node.attr
    return None


def private_cross_feature_reads(modules: dict[str, Module], package: str = PACKAGE) -> list[PrivateRead]:
    """Reads of `trainer._<name>` in features/*.py (the module docstring's rule), each with the file that stores it."""
    features = [m for m in modules.values() if m.name.startswith(f"{package}.features.") and not m.is_package]
    stores: dict[str, set[str]] = defaultdict(set)
    for module in features:
        for node in ast.walk(module.tree):
            attribute = _trainer_private(node)
            if attribute and isinstance(node.ctx, ast.Store):
                stores[attribute].add(module.path.as_posix())
    trainer_module = modules.get(f"{package}.trainer")
    if trainer_module is not None:  # `self._<name> = <a feature>(...)`: the feature's object, kept by the trainer
        feature_names = {
            alias.asname or alias.name
            for node in ast.walk(trainer_module.tree)
            if isinstance(node, ast.ImportFrom)
            and resolve_from(trainer_module, node.level, node.module).startswith(f"{package}.features")
            for alias in node.names
        }
        for node in ast.walk(trainer_module.tree):
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
                continue
            chain = _chain(node.value.func)
            if chain is None or chain[0] not in feature_names:
                continue
            for target in node.targets:
                if isinstance(target, ast.Attribute) and _chain(target) == ["self", target.attr]:
                    if target.attr.startswith("_"):
                        stores[target.attr].add(trainer_module.path.as_posix())
    reads = []
    for module in features:
        file = module.path.as_posix()
        for node in ast.walk(module.tree):
            attribute = _trainer_private(node)
            if attribute and isinstance(node.ctx, ast.Load):
                owners = stores.get(attribute, set())
                owner = None if not owners else file if file in owners else sorted(owners)[0]
                reads.append(PrivateRead(Site(file, node.lineno, ast.unparse(node)), attribute, owner))
    return sorted(reads, key=lambda read: (read.site.file, read.site.line))


def is_cross_feature(read: PrivateRead) -> bool:
    """A read of private state the package stores on the trainer, outside the one feature that stores it."""
    return read.owner is not None and read.owner != read.site.file


def reexported_names(module: Module) -> list[str]:
    """The names `module` binds by import, with those its `__all__` lists."""
    names = {}
    for node in module.tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name != "*":
                    names[alias.asname or alias.name.split(".")[0]] = None
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                value = node.value
                if isinstance(value, (ast.List, ast.Tuple)):
                    for element in value.elts:
                        if isinstance(element, ast.Constant) and isinstance(element.value, str):
                            names[element.value] = None
    names.pop("annotations", None)  # `from __future__ import annotations`
    return sorted(names)


# ---------------------------------------------------------------------------------------------------------------- #
# The set-up walk


@dataclass(frozen=True)
class Function:
    module: str
    qualname: str  # "f", "Class.method"; a class itself for `Class(...)` resolves to its __init__ / __post_init__


@dataclass(frozen=True)
class Stop:
    function: Function
    file: str
    floor: int  # of its room
    module_floor: int  # of its module, in the graph between modules
    line: int  # of the call site
    caller: Function
    depth: int

    def __str__(self) -> str:
        return (
            f"{self.file}:{self.function.qualname} (room floor {self.floor}, module floor {self.module_floor}; "
            f"called at line {self.line})"
        )


class Definitions:
    """Where names are defined and bound in each module, to resolve call sites."""

    def __init__(self, modules: dict[str, Module]):
        self.modules = modules
        self.functions: dict[tuple[str, str], ast.FunctionDef | ast.AsyncFunctionDef] = {}
        self.classes: dict[tuple[str, str], ast.ClassDef] = {}
        self.bindings: dict[str, dict[str, tuple[str, str | None]]] = {}  # module -> name -> (module, attr or None)
        for module in modules.values():
            self.bindings[module.name] = self._bindings(module, module.tree.body)
            for node in module.tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.functions[module.name, node.name] = node
                elif isinstance(node, ast.ClassDef):
                    self.classes[module.name, node.name] = node
                    for item in node.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            self.functions[module.name, f"{node.name}.{item.name}"] = item

    def _bindings(self, module: Module, body) -> dict[str, tuple[str, str | None]]:
        bindings = {}
        for node in body:
            for statement in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
                if isinstance(statement, ast.Import):
                    for alias in statement.names:
                        if alias.asname:
                            bindings[alias.asname] = (alias.name, None)
                        else:
                            bindings[alias.name.split(".")[0]] = (alias.name.split(".")[0], None)
                elif isinstance(statement, ast.ImportFrom):
                    source = resolve_from(module, statement.level, statement.module)
                    for alias in statement.names:
                        submodule = f"{source}.{alias.name}"
                        bound = (submodule, None) if submodule in self.modules else (source, alias.name)
                        bindings[alias.asname or alias.name] = bound
        return bindings

    def local_bindings(self, module: str, function: ast.AST) -> dict[str, tuple[str, str | None]]:
        """The module's bindings with the function's own (lazy) imports over them."""
        lazy = [node for node in ast.walk(function) if isinstance(node, (ast.Import, ast.ImportFrom))]
        return {**self.bindings[module], **self._bindings(self.modules[module], lazy)}

    def symbol(self, module: str, name: str, depth: int = 0) -> tuple[str, Function | None, str | None]:
        """What `name` in `module` is: ("function", f), ("class", c) or ("module", None, module name)."""
        if depth > 10 or module not in self.modules:
            return ("unknown", None, None)
        if (module, name) in self.functions:
            return ("function", Function(module, name), None)
        if (module, name) in self.classes:
            return ("class", Function(module, name), None)
        if f"{module}.{name}" in self.modules:
            return ("module", None, f"{module}.{name}")
        bound = self.bindings[module].get(name)
        if bound is None:
            return ("unknown", None, None)
        return self.bound(bound, depth + 1)

    def bound(self, bound: tuple[str, str | None], depth: int = 0) -> tuple[str, Function | None, str | None]:
        source, attribute = bound
        if attribute is None:
            return ("module", None, source) if source in self.modules else ("unknown", None, None)
        return self.symbol(source, attribute, depth)

    def bases(self, cls: Function) -> list[Function]:
        node = self.classes[cls.module, cls.qualname]
        found = []
        for base in node.bases:
            chain = _chain(base)
            if chain is None:
                continue
            kind, target, _ = self.attribute_chain(cls.module, self.bindings[cls.module], chain)
            if kind == "class":
                found.append(target)
        return found

    def method(self, cls: Function, name: str, seen: frozenset = frozenset()) -> Function | None:
        """`name` looked up on class `cls` and its bases in the package."""
        if cls in seen:
            return None
        if (cls.module, f"{cls.qualname}.{name}") in self.functions:
            return Function(cls.module, f"{cls.qualname}.{name}")
        for base in self.bases(cls):
            found = self.method(base, name, seen | {cls})
            if found is not None:
                return found
        return None

    def attribute_chain(
        self, module: str, bindings: dict, chain: list[str]
    ) -> tuple[str, Function | None, str | None]:
        """What `a.b.c` names in `module`, given its bindings."""
        head, *rest = chain
        if (module, head) in self.functions:
            kind, target, where = "function", Function(module, head), None
        elif (module, head) in self.classes:
            kind, target, where = "class", Function(module, head), None
        elif head in bindings:
            kind, target, where = self.bound(bindings[head])
        else:
            return ("unknown", None, None)
        for name in rest:
            if kind == "module":
                kind, target, where = self.symbol(where, name)
            elif kind == "class":
                method = self.method(target, name)
                if method is None:
                    return ("unknown", None, None)
                kind, target, where = "function", method, None
            else:
                return ("unknown", None, None)
        return kind, target, where

    def constructor(self, cls: Function) -> Function | None:
        return self.method(cls, "__init__") or self.method(cls, "__post_init__")

    def enclosing_class(self, function: Function) -> Function | None:
        owner, _, _ = function.qualname.rpartition(".")
        return Function(function.module, owner) if owner else None

    def typed_parameters(self, function: Function, bindings: dict) -> dict[str, Function]:
        """The parameters of `function` annotated with one of the package's classes, with that class."""
        node = self.functions[function.module, function.qualname]
        arguments = node.args
        typed = {}
        for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs):
            annotation = argument.annotation
            if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
                try:
                    annotation = ast.parse(annotation.value, mode="eval").body
                except SyntaxError:
                    continue
            chain = _chain(annotation) if annotation is not None else None
            if chain is not None:
                kind, target, _ = self.attribute_chain(function.module, bindings, chain)
                if kind == "class":
                    typed[argument.arg] = target
        return typed

    def resolve_call(
        self, caller: Function, bindings: dict, call: ast.Call, typed: dict[str, Function] | None = None
    ) -> Function | None:
        """The package function `call` (written in `caller`) runs, or None; `typed`: the caller's parameters annotated
        with a class of the package, whose methods `parameter.method(...)` resolves to."""
        func = call.func
        owner = self.enclosing_class(caller)
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call):
            inner = func.value.func
            if isinstance(inner, ast.Name) and inner.id == "super" and owner is not None:
                for base in self.bases(owner):
                    found = self.method(base, func.attr)
                    if found is not None:
                        return found
            return None
        chain = _chain(func)
        if chain is None:
            return None
        if chain[0] in ("self", "cls") and owner is not None:
            return self.method(owner, chain[1]) if len(chain) == 2 else None
        if typed and chain[0] in typed:
            return self.method(typed[chain[0]], chain[1]) if len(chain) == 2 else None
        kind, target, _ = self.attribute_chain(caller.module, bindings, chain)
        if kind == "function":
            return target
        if kind == "class":
            return self.constructor(target)
        return None


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    arguments = function.args
    return [a.arg for a in (*arguments.posonlyargs, *arguments.args)]


def _rooted_at(node: ast.expr, followed: set[str], through_calls: bool | str = True) -> bool:
    """`node` is a followed name, an attribute chain / subscript rooted at one, or (`through_calls`) a call that passes
    one on; with `through_calls="private"`, only a call of a private helper (`_name(...)`) does."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
        node = node.value
    if isinstance(node, ast.Name):
        return node.id in followed
    if through_calls == "private" and isinstance(node, ast.Call):
        if not (isinstance(node.func, ast.Name) and node.func.id.startswith("_")):
            return False
    if isinstance(node, ast.Call) and through_calls:
        return _rooted_at(node.func, followed) or any(
            _rooted_at(a, followed) for a in (*node.args, *(k.value for k in node.keywords))
        )
    return False


def _passes(call: ast.Call, callee: ast.FunctionDef, is_bound_method: bool, followed: set[str]) -> set[str] | None:
    """The callee's parameters that receive a followed value (a bound method's `self` too, when it is called on one);
    None when the call passes none on."""
    parameters = _parameters(callee)
    received = set()
    passed = False
    if is_bound_method and parameters:
        receiver = _chain(call.func)
        if receiver is not None and len(receiver) == 2 and receiver[0] in followed:
            passed = True
            received.add(parameters[0])
        parameters = parameters[1:]
    for position, argument in enumerate(call.args):
        if _rooted_at(argument, followed):
            passed = True
            if position < len(parameters) and not isinstance(argument, ast.Starred):
                received.add(parameters[position])
    for keyword in call.keywords:
        if _rooted_at(keyword.value, followed):
            passed = True
            if keyword.arg:
                received.add(keyword.arg)
    return received if passed else None


def _is_bound(definitions: Definitions, target: Function, call: ast.Call, typed: dict[str, Function]) -> bool:
    """Whether the callee's first parameter (self / cls) is filled by the call, not by an argument (`typed`: the
    caller's parameters annotated with a class of the package, whose methods are called bound)."""
    node = definitions.functions[target.module, target.qualname]
    if "." not in target.qualname:
        return False
    if any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list):
        return False
    chain = _chain(call.func)
    # `Class.method(obj, ...)` on a plain method passes self explicitly
    if chain is not None and chain[0] not in ("self", "cls", *typed) and len(chain) >= 2:
        is_classmethod = any(isinstance(d, ast.Name) and d.id == "classmethod" for d in node.decorator_list)
        constructing = target.qualname.endswith(("__init__", "__post_init__"))
        return is_classmethod or constructing
    return True


def _calls_in_order(
    function: ast.AST, followed: set[str] | None, taint: str = "values"
) -> Iterator[tuple[ast.Call, set[str] | None]]:
    """The calls in `function`'s body in source order (outer call before the calls in its arguments, a compound
    statement's header before its body), each with the names followed at that point: with `taint`, a local assigned
    from a followed value (or a loop variable over one) joins them."""
    followed = set(followed) if followed is not None else None
    yield from _calls_in_statements(getattr(function, "body", []), followed, taint)


def _calls_in_statements(statements: list, followed: set[str] | None, taint: str) -> Iterator:
    for statement in statements:
        blocks = [value for name, value in ast.iter_fields(statement) if _is_block(value)]
        headers = [value for name, value in ast.iter_fields(statement) if not _is_block(value)]
        header_nodes = [node for value in headers for node in (value if isinstance(value, list) else [value])]
        calls = sorted(
            (node for header in header_nodes if isinstance(header, ast.AST)
             for node in ast.walk(header) if isinstance(node, ast.Call)),
            key=lambda node: (node.lineno, node.col_offset),
        )  # fmt: skip
        for call in calls:
            yield call, followed
        if followed is not None and taint != "none":
            _taint(statement, followed, through_calls="private" if taint == "private" else taint == "values")
        for block in blocks:
            yield from _calls_in_statements(block, followed, taint)


def _is_block(value) -> bool:
    """A field that holds statements (a body, `orelse`, `finalbody`, `handlers`, a match's `cases`)."""
    return (
        isinstance(value, list) and bool(value) and isinstance(value[0], (ast.stmt, ast.ExceptHandler, ast.match_case))
    )


def _pairs(target: ast.expr, value: ast.expr) -> list[tuple[ast.expr, ast.expr]]:
    """`a, b = x, y` as [(a, x), (b, y)]; anything else as one pair."""
    shapes = (ast.Tuple, ast.List)
    if isinstance(target, shapes) and isinstance(value, shapes) and len(target.elts) == len(value.elts):
        if not any(isinstance(element, ast.Starred) for element in (*target.elts, *value.elts)):
            return [pair for t, v in zip(target.elts, value.elts, strict=True) for pair in _pairs(t, v)]
    return [(target, value)]


def _taint(statement: ast.AST, followed: set[str], through_calls: bool | str) -> None:
    """Names bound by `statement` from a followed value join `followed` (a call's result is one when `through_calls`
    and the call passes a followed value on)."""

    def derived(value: ast.expr) -> bool:
        if isinstance(value, (ast.Tuple, ast.List)):
            return any(derived(element) for element in value.elts)
        return _rooted_at(value, followed, through_calls)

    bound: list[ast.AST] = []
    if isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and statement.value is not None:
        targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
        for whole in targets:
            bound += [target for target, value in _pairs(whole, statement.value) if derived(value)]
    elif isinstance(statement, (ast.For, ast.AsyncFor)) and derived(statement.iter):
        bound = [statement.target]
    elif isinstance(statement, (ast.With, ast.AsyncWith)):
        bound = [i.optional_vars for i in statement.items if i.optional_vars and derived(i.context_expr)]
    for walrus in (n for n in ast.walk(statement) if isinstance(n, ast.NamedExpr)):
        if derived(walrus.value):
            bound.append(walrus.target)
    followed.update(n.id for target in bound for n in ast.walk(target) if isinstance(n, ast.Name))


@dataclass
class Walk:
    variant: str
    start: Function
    stops: list[Stop]
    start_floors: tuple[int, int]  # the start's room floor and module floor

    def climbs(self, level: str = CLIMB_LEVEL) -> list[Stop]:
        """The stops on a higher floor ("room" or "module") than the stop before them."""
        previous = self.start_floors[0 if level == "room" else 1]
        climbs = []
        for stop in self.stops:
            floor = stop.floor if level == "room" else stop.module_floor
            if floor > previous:
                climbs.append(stop)
            previous = floor
        return climbs

    @property
    def files(self) -> list[str]:
        return sorted({stop.file for stop in self.stops})

    def visits(self, file: str) -> int:
        return sum(stop.file == file for stop in self.stops)


def set_up_walk(
    structure: Structure, variant: str = MAIN_WALK, start: tuple[str, str] = WALK_START, followed: str = "trainer"
) -> Walk:
    """The static call tree from `start`, walked by `variant`'s rule (`WALK_VARIANTS`, the module docstring)."""
    definitions = structure.definitions
    follow, taint, count_revisits = WALK_VARIANTS[variant]
    root = Function(*start)
    if (root.module, root.qualname) not in definitions.functions:
        raise ValueError(f"The walk's start {root.qualname} is not in {root.module}: name where set-up starts now.")
    expanded: set[Function] = set()
    stops: list[Stop] = []

    def floor(function: Function) -> int:
        return structure.room_floors[structure.place(function.module, "room")]

    def file(function: Function) -> str:
        return structure.modules[function.module].path.as_posix()

    def expand(function: Function, names: set[str] | None, depth: int) -> None:
        expanded.add(function)
        node = definitions.functions[function.module, function.qualname]
        bindings = definitions.local_bindings(function.module, node)
        taint_here = taint
        if taint in ("start", "start-private"):
            taint_here = "values" if function == root else "none" if taint == "start" else "private"
        typed = definitions.typed_parameters(function, bindings)
        for call, followed_here in _calls_in_order(node, names, taint_here):
            target = definitions.resolve_call(function, bindings, call, typed)
            if target is None:
                continue
            received = None
            if follow:
                callee = definitions.functions[target.module, target.qualname]
                received = _passes(call, callee, _is_bound(definitions, target, call, typed), followed_here)
                if received is None:
                    continue
            first = target not in expanded
            if first or count_revisits:
                module_floor = structure.module_floors[target.module]
                stops.append(Stop(target, file(target), floor(target), module_floor, call.lineno, function, depth))
            if first:
                expand(target, received, depth + 1)

    expand(root, {followed} if follow else None, 1)
    return Walk(variant, root, stops, (floor(root), structure.module_floors[root.module]))


# ---------------------------------------------------------------------------------------------------------------- #
# The report


@dataclass
class Structure:
    modules: dict[str, Module]
    imports: list[Import]
    definitions: Definitions = field(repr=False)
    package: str = PACKAGE
    room_floors: dict[str, int] = field(default_factory=dict)
    module_floors: dict[str, int] = field(default_factory=dict)

    @property
    def packages(self) -> set[str]:
        return {name for name, module in self.modules.items() if module.is_package}

    def place(self, module: str, level: str) -> str:
        """`module`'s node at `level`: "room", "folder" or "module"."""
        if level == "room":
            return room_of(module, self.package)
        if level == "folder":
            return folder_of(module, self.packages)
        return module

    def graph(self, kinds: tuple[str, ...] = ("eager",), level: str = "room") -> dict[str, set[str]]:
        """Who imports whom, between rooms (or folders, or modules), by the import kinds given."""
        graph: dict[str, set[str]] = {self.place(module, level): set() for module in self.modules}
        for edge in self.imports:
            source, target = self.place(edge.importer, level), self.place(edge.target, level)
            if edge.kind in kinds and source != target:
                graph[source].add(target)
        return graph


def read_structure(root: Path = ROOT, package: str = PACKAGE) -> Structure:
    modules = read_modules(root, package)
    imports = [edge for module in modules.values() for edge in imports_of(module, modules, package)]
    structure = Structure(modules, imports, Definitions(modules), package)
    structure.room_floors = floors_of(structure.graph())
    structure.module_floors = floors_of(structure.graph(level="module"))
    return structure


@dataclass
class Report:
    rooms: dict[str, int]  # room -> floor
    floors: int
    eager_imports: int
    lazy_imports: list[Import]
    type_only_imports: list[Import]
    room_cycles: list[list[str]]
    module_cycles: list[list[str]]
    room_cycles_with_lazy: list[list[str]]
    module_cycles_with_lazy: list[list[str]]
    folder_cycles: list[list[str]]  # the finer rooms: every folder
    imports_running_up: list[Import]
    settings_reads: list[Site]
    private_reads: list[PrivateRead]
    refusals_reexports: list[str]
    walks: dict[str, Walk] = field(repr=False)

    def __repr__(self) -> str:
        return (
            f"Report({len(self.rooms)} rooms on {self.floors} floors, {len(self.settings_reads)} settings reads, "
            f"{len(self.cross_feature_reads)} cross-feature reads, {len(self.refusals_reexports)} re-exports, "
            f"walk {len(self.walk.stops)} stops / {len(self.walk.climbs())} climbs)"
        )

    @property
    def cross_feature_reads(self) -> list[PrivateRead]:
        return [read for read in self.private_reads if is_cross_feature(read)]

    @property
    def walk(self) -> Walk:
        return self.walks[MAIN_WALK]


def measure(
    root: Path = ROOT, package: str = PACKAGE, resolver: str = RESOLVER, walk_start: tuple[str, str] = WALK_START
) -> Report:
    """Every figure of the module docstring for the package under `root`."""
    structure = read_structure(root, package)
    floors = structure.room_floors
    running_up = []
    for edge in structure.imports:
        source, target = structure.place(edge.importer, "room"), structure.place(edge.target, "room")
        if edge.kind != "eager" and source and target and source != target and floors[target] >= floors[source]:
            running_up.append(edge)
    refusals = structure.modules.get(f"{package}.refusals")
    with_lazy = ("eager", "lazy")
    return Report(
        rooms=dict(sorted(floors.items(), key=lambda item: (item[1], item[0]))),
        floors=1 + max(floors.values(), default=-1),
        eager_imports=sum(edge.kind == "eager" for edge in structure.imports),
        lazy_imports=[edge for edge in structure.imports if edge.kind == "lazy"],
        type_only_imports=[edge for edge in structure.imports if edge.kind == "type-only"],
        room_cycles=strongly_connected(structure.graph()),
        module_cycles=strongly_connected(structure.graph(level="module")),
        room_cycles_with_lazy=strongly_connected(structure.graph(with_lazy)),
        module_cycles_with_lazy=strongly_connected(structure.graph(with_lazy, level="module")),
        folder_cycles=strongly_connected(structure.graph(level="folder")),
        imports_running_up=running_up,
        settings_reads=settings_reads(structure.modules, resolver),
        private_reads=private_cross_feature_reads(structure.modules, package),
        refusals_reexports=reexported_names(refusals) if refusals is not None else [],
        walks={variant: set_up_walk(structure, variant, walk_start) for variant in WALK_VARIANTS},
    )


def _short(module: str) -> str:
    return module.partition(".")[2] or module


def format_report(report: Report, package: str = PACKAGE) -> str:
    lines = [f"Rooms: {len(report.rooms)} on {report.floors} floors ({report.eager_imports} eager imports)"]
    by_floor: dict[int, list[str]] = defaultdict(list)
    for room, floor in report.rooms.items():
        by_floor[floor].append(_short(room))
    for floor in sorted(by_floor, reverse=True):
        lines.append(f"  floor {floor}: {', '.join(by_floor[floor])}")
    lines.append(
        f"Cycles (eager imports): rooms {report.room_cycles or 'none'}; modules {report.module_cycles or 'none'}"
    )
    lines.append(
        f"Cycles (eager + lazy imports): rooms {report.room_cycles_with_lazy or 'none'}; "
        f"modules {report.module_cycles_with_lazy or 'none'}"
    )
    lines.append(f"Cycles between folders (every folder a room, eager imports): {report.folder_cycles or 'none'}")
    lines.append(f"Lazy imports: {len(report.lazy_imports)}; type-only imports: {len(report.type_only_imports)}")
    lines.append(
        f"Imports running up (lazy or type-only, to the same floor or higher): {len(report.imports_running_up)}"
    )
    for edge in report.imports_running_up:
        source, target = room_of(edge.importer, package), room_of(edge.target, package)
        lines.append(
            f"  {_short(edge.importer)}:{edge.line} ({edge.kind}) -> {_short(edge.target)}  "
            f"[floor {report.rooms[source]} -> {report.rooms[target]}]"
        )
    lines.append(f"getattr(<...>args, '<name>', <default>) reads outside the resolver: {len(report.settings_reads)}")
    lines.extend(f"  {site}" for site in report.settings_reads)
    cross = report.cross_feature_reads
    lines.append(f"Private cross-feature reads (trainer._<name> in features/, stored elsewhere): {len(cross)}")
    lines.extend(f"  {read.site}  (stored in {read.owner})" for read in cross)
    others = [read for read in report.private_reads if not is_cross_feature(read)]
    if others:
        lines.append(f"  not counted ({len(others)}): " + ", ".join(f"{r.site.file}:{r.site.line} {r.attribute}"
                                                                     f" ({'own' if r.owner else 'not the package'})"
                                                                     for r in others))  # fmt: skip
    lines.append(f"refusals/__init__.py re-exports: {len(report.refusals_reexports)} names")
    start = report.walk.start
    lines.append(
        f"Set-up walk from {start.qualname} ({_short(start.module)}); climbs on module floors (on room floors):"
    )
    for variant, walk in report.walks.items():
        packability = walk.visits(f"{package}/modeling/packability.py")
        marker = "  <- the figure" if variant == MAIN_WALK else ""
        lines.append(
            f"  {variant:28} {len(walk.stops):3} stops in {len(walk.files):2} files, {len(walk.climbs('module')):2} "
            f"climbs ({len(walk.climbs('room')):2}), {packability:2} at modeling/check/packability.py{marker}"
        )
    per_file = defaultdict(int)
    for stop in report.walk.stops:
        per_file[stop.file] += 1
    ranked = sorted(per_file.items(), key=lambda item: (-item[1], item[0]))
    lines.append(
        f"Stops per file ({MAIN_WALK}): " + ", ".join(f"{file.partition('/')[2]} {count}" for file, count in ranked)
    )
    lines.append(f"The walk ({MAIN_WALK}), in visit order (indent: depth; ^ a climb on module floors):")
    climbed = {id(stop) for stop in report.walk.climbs()}
    for stop in report.walk.stops:
        mark = "^" if id(stop) in climbed else " "
        lines.append(f"  {mark} {'  ' * (stop.depth - 1)}{stop}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the directory that holds the package")
    parser.add_argument("--package", default=PACKAGE)
    parser.add_argument("--resolver", default=RESOLVER, help="the settings resolver's path from the root")
    options = parser.parse_args(argv)
    print(format_report(measure(options.root, options.package, options.resolver), options.package))


if __name__ == "__main__":
    sys.exit(main())
