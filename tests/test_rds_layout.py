"""The RDS package's shape: its modules import each other one way only (no cycle,
counting imports made for type checking alone), each says what it holds in a
docstring, and the node's parts stay small."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RDS = Path(__file__).parents[1] / "ulps" / "rds"
PREFIX = "rdmashim.ulps.rds."
MODULES = sorted(p.stem for p in RDS.glob("*.py"))
LIMIT = 600
"""Lines a module of the node's parts may have (``wire.py``, the protocol's formats,
is older and larger)."""


def imports(name: str) -> set[str]:
    """The package's modules ``name`` imports, at run time or for type checking."""
    out = set()
    for node in ast.walk(ast.parse((RDS / f"{name}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PREFIX):
            out.add(node.module.removeprefix(PREFIX))
    return out


def test_the_modules_import_each_other_without_a_cycle() -> None:
    graph = {name: imports(name) for name in MODULES}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        for dep in graph[name]:
            assert dep not in path, f"import cycle: {' -> '.join([*path, dep])}"
            if dep not in done:
                visit(dep, [*path, dep])
        done.add(name)

    for name in MODULES:
        visit(name, [name])


def test_connection_and_tcp_no_longer_import_each_other() -> None:
    assert "tcp" not in imports("connection") and "connection" in imports("tcp")


@pytest.mark.parametrize("name", MODULES)
def test_each_module_has_a_docstring_and_stays_small(name: str) -> None:
    text = (RDS / f"{name}.py").read_text()
    assert ast.get_docstring(ast.parse(text)), f"{name}.py has no docstring"
    if name != "wire":
        assert len(text.splitlines()) <= LIMIT, f"{name}.py has over {LIMIT} lines"
