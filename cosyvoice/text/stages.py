"""Stages: what happens to a session's results between its engine and its outbox.

A session's results pass, in this order, through

1. its engine's **deferred stage**, if the engine has one (``EngineSpec.stage``): a
   process-wide decoder that finishes results off the worker's loop and hands them back as
   ``messages.Scheduled`` (the 2-pass finals process, cosyvoice/text/finals.py; whisper-live's
   decode scheduler, cosyvoice/asr/scheduler.py). The model starts it once per worker
   process (``Model.start_stage``); the worker only samples its load, waits for it at
   hand-over and stops it;
2. its **text stages**: pure rules ``(session settings) -> (Result -> Result)`` (script
   conversion, number formatting), chosen from the session's settings when the worker
   takes the session (and chosen again, identically, by a worker that takes it over: the
   settings are stored with the session). A rule runs on a result when it is decoded: at
   once for a result decoded now, when its job is done for a ``Scheduled`` one;
3. its **outbox** (cosyvoice/worker/outbox.py), which publishes them in order.

Adding a text stage is one module with a ``TextStage`` and one line in ``TEXT_STAGES``
(docs/architecture.md, "Adding an engine, a stage or a face"). Each stage declares its
``cost`` (CPU seconds per audio second of a real-time session, ``text_cost``); admission
does not read it yet: it counts sessions at the engine's measured cost, and the first
stage that costs enough to matter decides how it should.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Callable, Protocol

from ..wire.languages import AUTO, ENGLISH
from ..wire.messages import Outgoing, Result, Scheduled, TextRule
from . import formatting, script


class DeferredStage(Protocol):
    """A deferred stage as the worker sees it (``Model.start_stage`` returns one)."""

    def sample(self) -> object | None:
        """The stage's load since the last call (a scheduler's ``Load``), or None where
        the stage reports none."""
        ...

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing handed over is left to decode; False on timeout."""
        ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class TextStage:
    """One text stage: ``wanted(settings)`` says whether a session with these settings
    (its hash in Redis: ``mode``, ``language``, …) runs it, ``rule(settings)`` gives the
    rule it runs on each of that session's results, and ``cost`` its CPU seconds per
    audio second."""
    name: str
    wanted: Callable[[Mapping[str, str]], bool]
    rule: Callable[[Mapping[str, str]], TextRule]
    cost: float = 0.0


def _language_rule(session: Mapping[str, str]) -> TextRule:
    """A result the engine did not label is in the session's language (an English-only
    engine's are in English)."""
    asked = session.get("language") or ENGLISH
    language = ENGLISH if asked == AUTO else asked

    def rule(result: Result) -> Result:
        return result if result.get("language") else {**result, "language": language}
    return rule


# The text stages, in the order they run: every result says its language, then Chinese is
# written in the session's script, then a session that asked for it gets digits.
TEXT_STAGES: tuple[TextStage, ...] = (
    TextStage("language", lambda session: True, _language_rule),
    TextStage("script", script.wanted, script.rule, script.COST),
    TextStage("format", formatting.wanted, formatting.rule, formatting.COST),
)


def text_rules(session: Mapping[str, str],
               stages: Sequence[TextStage] = TEXT_STAGES) -> tuple[TextRule, ...]:
    """The rules a session with these settings runs, in order."""
    return tuple(stage.rule(session) for stage in stages if stage.wanted(session))


def text_cost(session: Mapping[str, str], stages: Sequence[TextStage] = TEXT_STAGES) -> float:
    """What a session's text stages add to its cost."""
    return sum(stage.cost for stage in stages if stage.wanted(session))


def apply(rules: Sequence[TextRule], items: Sequence[Outgoing]) -> list[Outgoing]:
    """The items with the rules run on every partial and final: now on a result decoded
    now, once decoded on a ``Scheduled`` one. ``end`` passes as it is."""
    if not rules:
        return list(items)
    out: list[Outgoing] = []
    for item in items:
        if isinstance(item, Scheduled):
            out.append(replace(item, rules=item.rules + tuple(rules)))
        elif item["type"] not in ("partial", "final"):
            out.append(item)  # end, speech_started
        else:
            result: Result = item
            for rule in rules:
                result = rule(result)
            out.append(result)
    return out
