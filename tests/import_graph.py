"""The package's import graph read from its source (every import, at module level or
inside a function), for tests/unit/test_imports.py and benchmarks/import_map.py."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import PurePath


def module_of(path: str) -> str:
    """``cosyvoice/store/bus.py`` -> ``cosyvoice.store.bus`` (a package by its folder)."""
    parts = list(PurePath(path).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def graph(sources: Mapping[str, str]) -> dict[str, set[str]]:
    """Each module of ``sources`` (path relative to the root -> text) and the modules of
    ``sources`` it imports."""
    known = {module_of(p) for p in sources}
    out: dict[str, set[str]] = {}
    for path, text in sources.items():
        module = module_of(path)
        package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(text)):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                target = ".".join(base + (node.module.split(".") if node.module else []))
                # ``from . import bus`` imports the module; ``from .x import name``, x
                names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target
                         for a in node.names]
            found.update(n for n in names if n in known and n != module)
        out[module] = found
    return out


def reachable(g: Mapping[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for dep in g[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def cyclic(g: Mapping[str, set[str]]) -> list[str]:
    """The modules that import themselves through others."""
    return sorted(m for m in g if m in reachable(g, m))
