"""The package's import graph, read from the source (every import, at module level or
inside a function): no cycle, and the layers the architecture page describes."""

from __future__ import annotations

import pytest

from .. import import_graph
from ..helpers import ROOT

pytestmark = [pytest.mark.fast, pytest.mark.unit]


def graph() -> dict[str, set[str]]:
    return import_graph.graph({str(p.relative_to(ROOT)): p.read_text()
                               for p in (ROOT / "cosyvoice").rglob("*.py")})


def test_the_walk_finds_the_imports_it_should():
    g = graph()
    assert "cosyvoice.worker.outbox" in g["cosyvoice.worker.loop"]
    assert "cosyvoice.asr.whisper_rules" in g["cosyvoice.asr.tiny_whisper"]
    # a lazy import inside a function counts too
    assert "cosyvoice.asr.live_engine" in g["cosyvoice.asr.whisper_engine"]


def test_no_module_imports_itself_through_others():
    g = graph()
    assert import_graph.cyclic(g) == []


def test_settings_and_the_pure_rules_import_no_engine():
    g = graph()
    for module in ("cosyvoice.settings", "cosyvoice.wire.registry", "cosyvoice.worker.outbox",
                   "cosyvoice.text.stages", "cosyvoice.wire.messages", "cosyvoice.wire.abr"):
        reached = import_graph.reachable(g, module)
        assert not {m for m in reached if m.startswith("cosyvoice.asr")}, module
