"""OpenAI's Realtime transcription face: ``/v1/realtime?intent=transcription``, a raw
WebSocket beside Socket.IO on the gateway's port (docs/openai.md, "Realtime").

A connection speaks OpenAI's Realtime events (JSON text frames) over cosyvoice sessions:
``input_audio_buffer.append`` audio (base64 16-bit PCM at 24 kHz, the API's rate) goes into
a session as 200 ms chunks, the session's results come back as
``input_audio_buffer.speech_started``/``speech_stopped``/``committed`` and
``conversation.item.input_audio_transcription.delta``/``completed``, one item per
utterance. The session is opened at the first audio with the configuration
``session.update`` set by then (language, prompt, turn detection); a change of those once
audio went in ends that session (its results still come) and the next audio opens one with
the new configuration. Turn detection maps onto turn control: ``server_vad``'s
``silence_duration_ms`` is the session's endpointing silence and its ``speech_started``
events the VAD's; with ``turn_detection: null`` only ``input_audio_buffer.commit`` ends a
turn (a chunk with ``finalize``), and the ``finalized`` marker that follows completes it.

Bad events get an ``error`` event and the connection goes on; a refused session
(admission, limits) or a store that fails gets an ``error`` and the connection closes
(1013 when full: try again later). A bad key is refused with 401 before the upgrade
(cosyvoice/gateway/wshandler.py).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import gevent
import gevent.lock
import redis
from flask import Flask, Response, request
from geventwebsocket.exceptions import WebSocketError

from ... import metrics
from ...gateway.apikeys import ANONYMOUS
from ...gateway.core import Connection, Gateway
from ...gateway.limits import parse_auth
from ...gateway.outputs import SessionsOutput
from ...gateway.wsframes import MESSAGE_LIMITS, ON_TOO_BIG
from ...gateway.wshandler import PRECHECKS, SUBPROTOCOLS, close_ws, watch_idle
from ...wire.codecs import CHUNK_MS
from ...wire.errors import CosyvoiceError, Overloaded, Unauthorized
from ...wire.languages import joined_piece
from .realtime_setup import RATE, Config, EventError, credential, precheck, updated
from .transcriptions import ApiError

log = logging.getLogger(__name__)

PATH = "/v1/realtime"
CHUNK_BYTES = RATE * 2 * CHUNK_MS // 1000
MIN_COMMIT_MS = 100  # OpenAI's: a commit of less audio is an error


def install(app: Flask, gateway: Gateway) -> None:
    PRECHECKS[PATH] = lambda environ: precheck(gateway, environ)
    SUBPROTOCOLS[PATH] = ("realtime",)
    MESSAGE_LIMITS[PATH] = gateway.settings.max_message_kb_realtime * 1024
    # Werkzeug matches a WebSocket request only to a rule that says it is one; the plain
    # GET answers 426
    app.add_url_rule(PATH, "openai_realtime", lambda: connect(gateway), websocket=True)
    app.add_url_rule(PATH, "openai_realtime_http", lambda: connect(gateway))


def connect(gateway: Gateway):
    ws = request.environ.get("wsgi.websocket")
    if ws is None:
        return ApiError(426, "this is a WebSocket endpoint: upgrade the connection",
                        code="upgrade_required").response()
    try:  # checked before the upgrade (precheck); here for the name it counts to
        subject = gateway.auth.check(credential(request.environ))
    except Unauthorized:
        close_ws(ws, 1008, "unauthorized")
        return Response()
    Realtime(gateway, ws, subject).run(request.args.get("session") or None)
    return Response()


@dataclass
class Segment:
    """One cosyvoice session under the connection (a new one after a configuration change)."""
    conn: Connection
    base_ms: float  # audio of the connection before this session
    manual: bool  # turn_detection null: commits end the turns
    seq: int = 0
    ending: bool = False  # its last chunk went in


@dataclass
class Item:
    id: str
    transcript: str = ""  # its finals joined
    language: str | None = None  # its last final's
    start_ms: float = 0.0
    seconds: float = 0.0  # a commit's audio

    def add(self, text: str, language: str | None) -> str:
        """The delta that adds ``text``: the item's transcript grows by exactly it."""
        delta = joined_piece(self.transcript, self.language, text, language)
        if text:
            self.transcript += delta
            self.language = language
        return delta


class Realtime:
    def __init__(self, gateway: Gateway, ws, subject: str = ANONYMOUS):
        self.gateway = gateway
        self.ws = ws
        self.subject = subject
        self.id = "sess_" + secrets.token_hex(10)
        self.config = Config()
        self.output = SessionsOutput(self.id)
        self._send_lock = gevent.lock.Semaphore()
        self.segment: Segment | None = None
        self.segments: dict[str, Segment] = {}
        self.pending = bytearray()  # audio not yet in a chunk
        self.audio_ms = 0.0  # audio of the connection that went into sessions
        self.since_commit_ms = 0.0
        self.open_items: deque[Item] = deque()  # speech started, no final yet (server_vad)
        self.commits: deque[tuple[str, int, Item]] = deque()  # (session, finalize seq, item)
        self.loose: list[tuple[str, str | None]] = []  # manual: finals before their commit
        self.previous: str | None = None
        self.last_result = "-"  # the current session's last result handled
        self.closed = False
        self.heard = time.monotonic()  # the client's last event

    # ---- the connection ---------------------------------------------------------------

    def run(self, resume: str | None = None) -> None:
        expired = resume is not None and not self._resume(resume)
        self.send({"type": "session.created", "session": self.config.ga(self.id)})
        if expired:
            self.error("the session expired; a new one was started", "session_expired",
                       param="session")
        # an event over the limit: this error, then wsframes closes 1009 unread
        self.ws.environ[ON_TOO_BIG] = lambda limit: self.error(
            f"an event is at most {limit} bytes", "event_too_large")
        relay = gevent.spawn(self.relay)
        idle = gevent.spawn(self.watch_idle)
        if self.segment is not None:
            self.gateway.relay.replay(self.segment.conn.session)  # what the client missed
        try:
            while not self.closed:
                try:
                    frame = self.ws.receive()
                except WebSocketError:
                    break
                if frame is None:
                    break
                self.heard = time.monotonic()
                self.handle(frame)
        finally:
            self.closed = True
            idle.kill()
            relay.kill()
            self._leave()

    def watch_idle(self) -> None:
        """No event for ``realtime_idle_timeout_s``: say so and close (the session waits
        for a resume, as after any disconnect)."""
        timeout = self.gateway.settings.realtime_idle_timeout_s

        def idle() -> None:
            log.info("realtime connection %s idle", self.id)
            self.error(f"no event for {timeout:g} s", "idle_timeout")
            self.closed = True
            close_ws(self.ws, 1000, f"idle for {timeout:g} s")

        watch_idle(timeout, lambda: self.heard, lambda: self.closed, idle)

    # ---- resume -----------------------------------------------------------------------

    def _state(self) -> str:
        segment = self.segment
        return json.dumps({
            "config": vars(self.config), "previous": self.previous, "audio_ms": self.audio_ms,
            "open": [[i.id, i.start_ms] for i in self.open_items],
            "commits": [[s, seq, vars(i)] for s, seq, i in self.commits],
            "loose": self.loose, "last": self.last_result,
            "segment": None if segment is None else {
                "session": segment.conn.session, "base_ms": segment.base_ms,
                "manual": segment.manual}})

    def _save(self, ttl_s: float | None = None) -> None:
        """The connection's state in Redis, for a client that comes back to it."""
        self.gateway.save_face("realtime", self.id, self._state(), ttl_s)

    def _resume(self, rid: str) -> bool:
        """Take over the state of connection ``rid`` and its session; False when it is
        gone (past the grace period)."""
        if not rid.startswith("sess_") or len(rid) > 64:
            return False
        raw = self.gateway.bus.load_face("realtime", rid)
        if raw is None:
            return False
        state = json.loads(raw)
        self.id = rid
        self.config = Config(**state["config"])
        self.previous, self.audio_ms = state["previous"], float(state["audio_ms"])
        self.open_items = deque(Item(i, start_ms=s) for i, s in state["open"])
        self.commits = deque((s, seq, Item(**i)) for s, seq, i in state["commits"])
        self.loose = [(t, lang) for t, lang in state["loose"]]
        self.last_result = state["last"]
        seg = state["segment"]
        if seg is None:
            return True
        conn = self.gateway.resume_session(seg["session"], f"{rid}-{secrets.token_hex(4)}",
                                           self.output, after=self.last_result,
                                           subject=self.subject)
        if conn is None:
            return False
        self.segment = Segment(conn, float(seg["base_ms"]), bool(seg["manual"]),
                               seq=conn.next_seq)
        self.segments[conn.session] = self.segment
        return True

    def _leave(self) -> None:
        """The connection is gone: the session in use waits for the client to come back
        (the grace period, as a Socket.IO client's), the ones that were ending go."""
        kept = self.segment is None
        for segment in list(self.segments.values()):
            if segment is not self.segment or self.gateway.settings.session_grace_s <= 0:
                self._close(segment)
                continue
            try:
                kept = self.gateway.release_session(segment.conn, self.output.id)
            except redis.RedisError as exc:
                metrics.REDIS_ERRORS.inc()
                log.warning("realtime session %s not released: %s", segment.conn.session, exc)
        if kept:  # not where a newer connection already took the session over
            self._save(self.gateway.settings.session_grace_s)

    def send(self, event: dict[str, Any]) -> None:
        event = {"event_id": "event_" + secrets.token_hex(8), **event}
        with self._send_lock:
            if self.closed and event["type"] != "error":
                return
            try:
                self.ws.send(json.dumps(event, ensure_ascii=False))
            except WebSocketError:
                self.closed = True

    def error(self, message: str, code: str, param: str | None = None,
              event_id: str | None = None, kind: str = "invalid_request_error") -> None:
        self.send({"type": "error", "error": {"type": kind, "code": code, "message": message,
                                              "param": param, "event_id": event_id}})

    def fail(self, err: CosyvoiceError, close_code: int) -> None:
        """A session refused or failed: say so and close the connection."""
        self.error(err.msg, err.code, kind="server_error")
        self.closed = True
        close_ws(self.ws, close_code, err.msg)

    # ---- client events ----------------------------------------------------------------

    def handle(self, frame: str | bytes) -> None:
        if not isinstance(frame, str):
            self.error("events are JSON text frames", "invalid_event")
            return
        try:
            event = json.loads(frame)
        except ValueError:
            self.error("the frame is not JSON", "invalid_json")
            return
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            self.error("an event is a JSON object with a type", "invalid_event")
            return
        event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
        handler = {
            "session.update": self.on_session_update,
            "transcription_session.update": self.on_session_update,
            "input_audio_buffer.append": self.on_append,
            "input_audio_buffer.commit": self.on_commit,
            "input_audio_buffer.clear": self.on_clear,
        }.get(event["type"])
        try:
            if handler is None:
                raise EventError(f"unknown event type {event['type'][:64]!r}",
                                 "unknown_event_type", "type")
            handler(event)
        except EventError as err:
            self.error(err.message, err.code, err.param, event_id)
        except CosyvoiceError as err:
            self.fail(err, 1013 if isinstance(err, Overloaded) else 1011)
        except redis.RedisError as exc:
            metrics.REDIS_ERRORS.inc()
            log.warning("realtime session store failed: %s", exc)
            self.error("the session store is unreachable", "unavailable", kind="server_error")
            self.closed = True
        except Exception:  # noqa: BLE001 - an event the checks missed ends nothing
            log.exception("realtime event %s failed", event["type"][:64])
            self.error("internal error", "internal", event_id=event_id, kind="server_error")

    def on_session_update(self, event: dict) -> None:
        beta = event["type"] == "transcription_session.update"
        session = event.get("session")
        if not isinstance(session, dict):
            raise EventError("session must be an object", param="session")
        config = updated(self.config, session, beta, self.gateway.languages)
        changed = config.session_auth() != self.config.session_auth()
        self.config = config
        if changed and self.segment is not None:
            self._end_segment()  # its results still come; the next audio opens a new one
        self._save()
        self.send({"type": "transcription_session.updated" if beta else "session.updated",
                   "session": config.beta(self.id) if beta else config.ga(self.id)})

    def on_append(self, event: dict) -> None:
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise EventError("audio must be a base64 string", param="audio")
        try:
            pcm = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise EventError("audio is not valid base64", param="audio") from None
        self.pending += pcm
        self.since_commit_ms += len(pcm) / 2 / RATE * 1000
        segment = self._segment()
        while len(self.pending) >= CHUNK_BYTES:
            chunk = bytes(self.pending[:CHUNK_BYTES])
            del self.pending[:CHUNK_BYTES]
            self._store(segment, chunk)

    def on_commit(self, event: dict) -> None:
        if self.since_commit_ms < MIN_COMMIT_MS:
            raise EventError(f"buffer too small: expected at least {MIN_COMMIT_MS} ms of "
                             f"audio, got {self.since_commit_ms:.0f} ms",
                             "input_audio_buffer_commit_empty")
        segment = self._segment()
        chunk = self._take_pending()
        seconds, self.since_commit_ms = self.since_commit_ms / 1000, 0.0
        seq = segment.seq
        if segment.manual:
            item = self._new_item()
            item.seconds = seconds
            for text, language in self.loose:
                item.add(text, language)
            self.loose = []
            self.commits.append((segment.conn.session, seq, item))
            self._committed(item)
            if item.transcript:
                self.send(self._delta(item, item.transcript))
        self._store(segment, chunk, finalize=True)
        self._save()

    def on_clear(self, event: dict) -> None:
        self.pending.clear()
        self.since_commit_ms = 0.0
        self.send({"type": "input_audio_buffer.cleared"})

    # ---- sessions ---------------------------------------------------------------------

    def _segment(self) -> Segment:
        if self.segment is not None:
            return self.segment
        try:
            req = parse_auth(self.config.session_auth(), self.gateway.modes,
                             self.gateway.settings.accepted_codecs, (), self.gateway.languages)
        except CosyvoiceError as err:
            raise EventError(err.msg, err.code) from err
        conn = self.gateway.open_session(req, f"{self.id}-{len(self.segments)}", self.output,
                                         self.subject)
        self.segment = Segment(conn, self.audio_ms, manual=self.config.vad is None)
        self.segments[conn.session] = self.segment
        self.last_result = "-"
        self._save()
        return self.segment

    def _store(self, segment: Segment, pcm: bytes, finalize: bool = False,
               last: bool = False) -> None:
        self.gateway.store_pcm(segment.conn, pcm, segment.seq, RATE, last=last,
                               finalize=finalize)
        segment.seq += 1
        self.audio_ms += len(pcm) / 2 / RATE * 1000

    def _take_pending(self) -> bytes:
        """The audio held for the next chunk, whole samples (an odd byte stays)."""
        even = len(self.pending) - len(self.pending) % 2
        chunk = bytes(self.pending[:even])
        del self.pending[:even]
        return chunk

    def _end_segment(self) -> None:
        segment, self.segment = self.segment, None
        if segment is None:
            return
        chunk = self._take_pending()
        self.pending.clear()  # an odd byte has no sample to finish in another session
        segment.ending = True
        self._store(segment, chunk, last=True)

    def _close(self, segment: Segment) -> None:
        self.segments.pop(segment.conn.session, None)
        try:
            self.gateway.close_session(segment.conn, self.output.id)
        except redis.RedisError as exc:
            metrics.REDIS_ERRORS.inc()
            log.warning("realtime session %s not deleted: %s", segment.conn.session, exc)

    # ---- results ----------------------------------------------------------------------

    def relay(self) -> None:
        for session, result_id, message in self.output.each(lambda: not self.closed):
            segment = self.segments.get(session)
            if segment is None:
                continue
            if segment is self.segment:
                self.last_result = result_id
            kind = message["type"]
            if kind == "speech_started":
                item = self._new_item()
                item.start_ms = segment.base_ms + message["start"] * 1000
                self.open_items.append(item)
                self.send({"type": "input_audio_buffer.speech_started", "item_id": item.id,
                           "audio_start_ms": round(item.start_ms)})
            elif kind == "final":
                self._final(segment, message)
            elif kind == "finalized" and segment.manual:
                if self.commits and self.commits[0][:2] == (session, message["seq"]):
                    _, _, item = self.commits.popleft()
                    self._completed(item, item.seconds)
            elif kind == "end":
                self._close(segment)
            elif kind == "error":
                self.error(message["msg"], message["code"], kind="server_error")
            if kind != "partial" and segment is self.segment:
                self._save()

    def _final(self, segment: Segment, final: Any) -> None:
        text = final["text"]
        language = final.get("language")
        if segment.manual:
            for session, seq, item in self.commits:
                if session == segment.conn.session and final.get("seq", 0) <= seq:
                    if text:
                        self.send(self._delta(item, item.add(text, language)))
                    return
            if text:
                self.loose.append((text, language))
            return
        opened = self.open_items.popleft() if self.open_items else None
        if opened is None and not text:
            return
        item = opened or self._new_item()
        self.send({"type": "input_audio_buffer.speech_stopped", "item_id": item.id,
                   "audio_end_ms": round(segment.base_ms + final["end"] * 1000)})
        self._committed(item)
        if text:
            self.send(self._delta(item, item.add(text, language)))
        self._completed(item, final["end"] - final["start"])

    def _new_item(self) -> Item:
        return Item("item_" + secrets.token_hex(8))

    def _committed(self, item: Item) -> None:
        self.send({"type": "input_audio_buffer.committed", "item_id": item.id,
                   "previous_item_id": self.previous})
        self.send({"type": "conversation.item.added", "previous_item_id": self.previous,
                   "item": {"id": item.id, "object": "realtime.item", "type": "message",
                            "status": "completed", "role": "user",
                            "content": [{"type": "input_audio", "transcript": None}]}})
        self.previous = item.id

    def _delta(self, item: Item, delta: str) -> dict[str, Any]:
        return {"type": "conversation.item.input_audio_transcription.delta",
                "item_id": item.id, "content_index": 0, "delta": delta}

    def _completed(self, item: Item, seconds: float) -> None:
        self.send({"type": "conversation.item.input_audio_transcription.completed",
                   "item_id": item.id, "content_index": 0, "transcript": item.transcript,
                   "usage": {"type": "duration", "seconds": round(max(0.0, seconds), 3)}})
