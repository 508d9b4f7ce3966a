"""What a session's client received (``Transcript``), and which errors it recovers from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..wire.languages import join_texts
from ..wire.messages import ErrorEvent, TextEvent

# Error codes after which the client rewinds and resends rather than giving up.
RETRYABLE = {"unavailable", "rate_limited", "seq_gap"}
# errors the stream recovers from by itself: a session lost by the store is replaced by a
# new one on the same connection, whose ``session`` event starts the audio again
RECOVERED = {"session_lost"}


@dataclass
class Transcript:
    session: str = ""
    partials: list[TextEvent] = field(default_factory=list)
    finals: list[TextEvent] = field(default_factory=list)
    errors: list[ErrorEvent] = field(default_factory=list)
    # Connections the server refused (the wire error of each connect_error); an
    # `overloaded` one is retried, and only the last refusal ends the stream.
    refusals: list[dict] = field(default_factory=list)
    acks: list[dict] = field(default_factory=list)
    # (event, payload) of every switch_down / switch_up the server sent
    switches: list[tuple[str, dict]] = field(default_factory=list)
    # speech_started events (auth.speech_events) and finalized ones (chunks with finalize)
    speech_started: list[dict] = field(default_factory=list)
    finalized: list[dict] = field(default_factory=list)
    # relabel events (speaker labels): each is applied to ``finals`` as it comes
    relabels: list[dict] = field(default_factory=list)
    # load events: the server spaced this session's partials out (partial_interval_ms)
    loads: list[dict] = field(default_factory=list)
    ended: bool = False
    resumes: int = 0
    # (monotonic time, event, payload) of everything received, for latency measurements.
    events: list[tuple[float, str, Mapping[str, Any]]] = field(default_factory=list)

    @property
    def text(self) -> str:
        kept = [f for f in self.finals if f["text"]]
        return join_texts([f["text"] for f in kept], [f.get("language") for f in kept]).strip()

    @property
    def fatal_errors(self) -> list[ErrorEvent]:
        return [e for e in self.errors if e.get("code") not in RETRYABLE | RECOVERED]
