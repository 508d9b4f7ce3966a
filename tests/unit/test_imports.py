"""The package's import graph, read from the source (every import, at module level or
inside a function): no cycle, and the layers the architecture page describes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ..helpers import ROOT

pytestmark = [pytest.mark.fast, pytest.mark.unit]

PACKAGE = ROOT / "cosyvoice"


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules ``module`` imports anywhere in its source."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + (node.module.split(".") if node.module else []))
            # ``from . import bus`` imports the module; ``from .x import name`` imports x
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target
                     for a in node.names]
        found.update(n for n in names if n in known and n != module)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imported(m, p, known) for m, p in known.items()}


def reachable(g: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for dep in g[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_walk_finds_the_imports_it_should():
    g = graph()
    assert "cosyvoice.worker.outbox" in g["cosyvoice.worker.loop"]
    assert "cosyvoice.asr.whisper_rules" in g["cosyvoice.asr.tiny_whisper"]
    # a lazy import inside a function counts too
    assert "cosyvoice.asr.live_engine" in g["cosyvoice.asr.whisper_engine"]


def test_no_module_imports_itself_through_others():
    g = graph()
    cycles = sorted(m for m in g if m in reachable(g, m))
    assert cycles == []


def test_settings_and_the_pure_rules_import_no_engine():
    g = graph()
    for module in ("cosyvoice.settings", "cosyvoice.wire.registry", "cosyvoice.worker.outbox",
                   "cosyvoice.text.stages", "cosyvoice.wire.messages", "cosyvoice.wire.abr"):
        assert not {m for m in reachable(g, module) if m.startswith("cosyvoice.asr")}, module
