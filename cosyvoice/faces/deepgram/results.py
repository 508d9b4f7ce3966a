"""Deepgram's live results: each session's results as ``Results``, ``SpeechStarted`` and
``UtteranceEnd`` for its channel (docs/deepgram.md), the half of a live connection
(``Listen``, cosyvoice/faces/deepgram/listen.py) that goes out to the client."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import gevent
import gevent.event
import gevent.lock

from ...gateway.core import Connection, Gateway
from ...gateway.outputs import SessionsOutput
from .params import (
    LENGTH_CUT_S,
    UTTERANCE_END_SLACK_S,
    Params,
    alternative,
)

log = logging.getLogger(__name__)


@dataclass
class Channel:
    """One channel's session under the connection, and where its results stand."""
    index: int
    conn: Connection
    seq: int = 0
    pending: bytearray = field(default_factory=bytearray)
    audio_s: float = 0.0  # audio of this channel received (decoded)
    tile: float = 0.0  # where the next Results' window starts: the last final's end
    finalizes: deque = field(default_factory=deque)  # (seq, audio_s) of Finalizes pending
    held: list = field(default_factory=list)  # finals waiting for their Finalize's marker
    last_word_end: float | None = None
    utterance_ended: float | None = None  # the last_word_end an UtteranceEnd was sent for
    spoke_at: float | None = None  # the last speech start after last_word_end
    last_seq: int = -1  # the session's last chunk, once stored
    skip_until: float = -1.0  # resumed with ``received``: results that end by then are had
    ended: bool = False
    last_result: str = "-"

    def state(self) -> dict[str, Any]:
        return {"session": self.conn.session, "tile": self.tile, "audio_s": self.audio_s,
                "last_word_end": self.last_word_end, "utterance_ended": self.utterance_ended,
                "last_result": self.last_result}


class Results:
    """What turns a connection's session results into Deepgram's messages; mixed into
    ``Listen``, whose state it reads."""

    gateway: Gateway
    params: Params
    request_id: str
    output: SessionsOutput
    channels: list[Channel]
    by_session: dict[str, Channel]
    closed: bool
    ended: gevent.event.Event
    model_uuid: str
    model_info: dict[str, str]

    def send(self, message: dict[str, Any]) -> None:
        raise NotImplementedError

    def fail(self, code: int, dg_code: str, description: str) -> None:
        raise NotImplementedError

    def _save(self, ttl_s: float | None = None) -> None:
        raise NotImplementedError

    def relay(self) -> None:
        for session, result_id, message in self.output.each(lambda: not self.closed):
            channel = self.by_session.get(session)
            if channel is None:
                continue
            self.result(channel, message)
            if message["type"] != "partial":
                channel.last_result = result_id
                if message["type"] in ("final", "finalized"):
                    self._save()

    def result(self, channel: Channel, message: Any) -> None:
        kind = message["type"]
        if channel.skip_until >= 0 and self._had(channel, message):
            return
        if kind == "partial":
            if self.params.interim and message.get("text", "").strip():
                self.send(self.results(channel, message, is_final=False))
        elif kind == "speech_started":
            self._speech_started(channel, float(message["start"]))
        elif kind == "final":
            if channel.finalizes:
                channel.held.append(message)
            else:
                self._final(channel, message, from_finalize=False)
        elif kind == "finalized":
            self._finalized(channel, int(message["seq"]))
        elif kind == "end":
            for final in channel.held:
                self._final(channel, final, from_finalize=False)
            channel.held = []
            channel.ended = True
            if all(c.ended for c in self.channels):
                self.ended.set()
        elif kind == "error":
            self.fail(1011, "NET-0000", message["msg"])

    def _had(self, channel: Channel, message: Any) -> bool:
        """A resume's replay: whether the client had ``message`` (it ends by the
        ``received`` the client named); the first result after that ends the skipping."""
        kind = message["type"]
        if kind == "speech_started":
            return float(message["start"]) < channel.skip_until
        if kind not in ("partial", "final"):
            return False
        if float(message["end"]) <= channel.skip_until:
            return True
        channel.skip_until = -1.0
        return False

    def _speech_started(self, channel: Channel, start: float) -> None:
        gap_ms = self.params.utterance_end_ms
        last = channel.last_word_end
        if (gap_ms and last is not None and channel.utterance_ended != last
                and start - last >= gap_ms / 1000):
            self._say_utterance_end(channel)  # the gap before this start was enough
        if channel.spoke_at is None:
            channel.spoke_at = start
        if self.params.vad_events:
            self.send({"type": "SpeechStarted", "channel": self._index(channel),
                       "timestamp": round(start, 3)})

    def _finalized(self, channel: Channel, seq: int) -> None:
        """A Finalize's audio is all decoded: its finals go, the last ``from_finalize``
        (an empty one where it ended no utterance)."""
        if not channel.finalizes or channel.finalizes[0][0] > seq:
            return
        _, audio_s = channel.finalizes.popleft()
        held, channel.held = channel.held, []
        for final in held[:-1]:
            self._final(channel, final, from_finalize=False)
        if held:
            self._final(channel, held[-1], from_finalize=True)
        else:
            self._final(channel, {"type": "final", "text": "", "start": channel.tile,
                                  "end": max(channel.tile, audio_s), "words": []},
                        from_finalize=True)

    def _index(self, channel: Channel) -> list[int]:
        return [channel.index, self.params.channels if self.params.split else 1]

    def results(self, channel: Channel, result: dict, is_final: bool,
                speech_final: bool = False, from_finalize: bool = False) -> dict[str, Any]:
        start = min(channel.tile, float(result["start"]))
        end = max(float(result["end"]), start)
        message: dict[str, Any] = {
            "type": "Results", "channel_index": self._index(channel),
            "duration": round(end - start, 3), "start": round(start, 3),
            "is_final": is_final, "speech_final": speech_final,
            "channel": {"alternatives": [alternative(result, self.params)]},
            "metadata": {"request_id": self.request_id, "model_uuid": self.model_uuid,
                         "model_info": self.model_info}}
        if is_final:
            message["from_finalize"] = from_finalize
        return message

    def _final(self, channel: Channel, final: dict, from_finalize: bool) -> None:
        length = float(final["end"]) - float(final["start"])
        by_pause = (self.params.speech_final and not from_finalize
                    and length < self.gateway.settings.max_utterance_s - LENGTH_CUT_S
                    and not (channel.last_seq >= 0 and final.get("seq", -1) >= channel.last_seq))
        has_text = bool(final.get("text", "").strip())
        self.send(self.results(channel, final, True, by_pause and has_text, from_finalize))
        channel.tile = max(channel.tile, float(final["end"]))
        if has_text:
            words = final.get("words") or []
            channel.last_word_end = float(words[-1]["end"] if words else final["end"])
            channel.spoke_at = None
        self._utterance_end(channel)

    def _utterance_end(self, channel: Channel) -> None:
        """UtteranceEnd once the audio clock is ``utterance_end_ms`` (and the VAD's
        slack) past the last word, with no speech started in between."""
        gap_ms = self.params.utterance_end_ms
        last = channel.last_word_end
        if not gap_ms or last is None or channel.utterance_ended == last or channel.held:
            return
        gap_end = last + gap_ms / 1000
        if channel.spoke_at is not None and channel.spoke_at < gap_end:
            return
        if channel.audio_s >= gap_end + UTTERANCE_END_SLACK_S or channel.ended:
            self._say_utterance_end(channel)

    def _say_utterance_end(self, channel: Channel) -> None:
        last = channel.last_word_end
        assert last is not None
        channel.utterance_ended = last
        self.send({"type": "UtteranceEnd", "channel": self._index(channel),
                   "last_word_end": round(last, 3)})
