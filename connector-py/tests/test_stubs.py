"""The type stubs (kvd/_native.pyi) must describe the built module exactly: every name in the
stubs exists in kvd._native, and every public name of kvd._native is in the stubs."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import kvd
from kvd import _native

STUB = Path(kvd.__file__).with_name("_native.pyi")


def stub_names() -> tuple[set[str], dict[str, set[str]]]:
    tree = ast.parse(STUB.read_text())
    top: set[str] = set()
    members: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            top.add(node.name)
            members[node.name] = {
                n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("__")
            }
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            top.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            top.add(node.target.id)
    return top, members


def test_stubs_match_the_native_module():
    top, members = stub_names()
    public = {n for n in dir(_native) if not n.startswith("_")} | {"__version__"}
    assert top - public == set(), "stubbed but missing from kvd._native"
    assert public - top == set(), "in kvd._native but not in the stubs"
    for cls, names in members.items():
        obj = getattr(_native, cls)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            continue
        actual = {n for n in dir(obj) if not n.startswith("_")}
        assert names - actual == set(), f"{cls}: stubbed methods missing"
        assert actual - names == set(), f"{cls}: methods missing from the stubs"
