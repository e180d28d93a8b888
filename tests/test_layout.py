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
