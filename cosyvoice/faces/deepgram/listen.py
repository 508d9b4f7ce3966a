"""Deepgram's face: the live ``/v1/listen`` WebSocket and the pre-recorded ``POST
/v1/listen``, over cosyvoice sessions (docs/deepgram.md).

A live connection is checked before the upgrade (cosyvoice/gateway/wshandler.py): its query
(``Params``), its key (``Authorization: Token`` or ``Bearer``, or a browser's ``token``
subprotocol: 401 when wrong) and admission (its sessions are opened there: 429 when the
service is full, with ``Retry-After``). One session is opened per channel the client
transcribes (``channels=2`` is two sessions, results tagged with ``channel_index``; with
``multichannel=false`` the channels are mixed into one).

Binary frames are audio (``linear16``/``mulaw``/``alaw`` at ``sample_rate``, or a
container stream: cosyvoice/wire/live_audio.py); they are cut into 200 ms chunks per channel
and stored as any client's. Text frames are ``KeepAlive`` (the idle timer starts again),
``Finalize`` (the utterance in progress ends: its final says ``from_finalize``, the stream
goes on), ``CloseStream`` (every result, then ``Metadata``, then close 1000) and
``Configure`` (refused: ``ConfigureFailure``).

Each session's results become ``Results`` (partials with ``interim_results``; finals with
``is_final``, and ``speech_final`` where a pause ended the utterance), ``SpeechStarted``
(``vad_events``) and ``UtteranceEnd`` (``utterance_end_ms``: a gap of that much audio after
the last word, on the audio clock). Close codes: 1000 after ``CloseStream``, 1011
``NET-0001`` when neither audio nor ``KeepAlive`` came for ``listen_idle_timeout_s``, 1008
``DATA-0000`` for audio that cannot be decoded, 1009 for a frame over
``COSYVOICE_MAX_MESSAGE_KB_LISTEN`` (refused before it is read: cosyvoice/gateway/wsframes.py),
1011 when the session store fails.

A client that loses its connection may come back within the grace period with
``session=<request_id>`` (the upgrade's ``dg-request-id``, every ``Results``'
``request_id``) and ``received=<seconds>`` (where the last final it got ends): the
sessions it had go on, and every result after that comes first.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import re
import secrets
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import parse_qs

import gevent
import gevent.event
import gevent.lock
import redis
from flask import Flask, Response, request
from geventwebsocket.exceptions import WebSocketError

from ... import metrics
from ...gateway.apikeys import ANONYMOUS
from ...gateway.core import Connection, Gateway
from ...gateway.files import IDLE_S, FileSession
from ...gateway.limits import (
    ENDPOINT_MS,
    MAX_PROMPT_CHARS,
    BadBody,
    BodyTooLarge,
    parse_auth,
    read_body,
)
from ...gateway.outputs import SessionsOutput
from ...gateway.wsframes import MESSAGE_LIMITS, ON_TOO_BIG
from ...gateway.wshandler import (
    ABANDON,
    PRECHECKS,
    SUBPROTOCOLS,
    UPGRADE_HEADERS,
    Refusal,
    close_ws,
)
from ...text import speakers
from ...wire.audio import off_the_loop
from ...wire.codecs import CHUNK_MS
from ...wire.errors import CosyvoiceError, Overloaded, RateLimited, Unauthorized, Unavailable
from ...wire.live_audio import (
    MAX_CHANNELS,
    RAW_ENCODINGS,
    BadAudio,
    ContainerInput,
    Input,
    open_input,
)

log = logging.getLogger(__name__)

PATH = "/v1/listen"
CONTAINERS = ("opus", "ogg-opus", "flac")  # encodings that name a container: PyAV reads it
RATES = (8000, 48000)  # the sample_rate a raw encoding may have (Hz, inclusive)
UTTERANCE_END_MS = (1000, 5000)
# How far past a gap the audio clock goes before UtteranceEnd is said: the VAD calls a
# start of speech a window after it began (the endpointer's window), and its
# speech_started comes that much later.
UTTERANCE_END_SLACK_S = 0.6
# A final this close to the longest utterance was cut by length, not ended by a pause.
LENGTH_CUT_S = 0.25
ENV_KEY = "cosyvoice.listen"  # the environ entry the precheck leaves for the view
try:
    VERSION = importlib.metadata.version("cosyvoice")
except importlib.metadata.PackageNotFoundError:  # run from a checkout
    VERSION = "0"
_PUNCT = re.compile(r"[^\w'\-]+", re.UNICODE)


class ListenError(Exception):
    """A handshake refused: the HTTP status, Deepgram's ``err_code`` and the message."""

    def __init__(self, status: int, code: str, message: str, retry_after_ms: int | None = None):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.retry_after_ms = retry_after_ms

    def refusal(self, request_id: str) -> Refusal:
        reason = {400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
                  413: "Payload Too Large", 429: "Too Many Requests",
                  503: "Service Unavailable"}.get(self.status, "Error")
        body = json.dumps({"err_code": self.code, "err_msg": self.message,
                           "request_id": request_id}).encode()
        headers = [("Content-Type", "application/json"), ("dg-error", header_text(self.message)),
                   ("dg-request-id", request_id)]
        if self.status == 413:  # the rest of the body is not read: this connection ends
            headers.append(("Connection", "close"))
        if self.retry_after_ms is not None:
            headers += [("Retry-After", str(max(1, round(self.retry_after_ms / 1000)))),
                        ("retry-after-ms", str(self.retry_after_ms))]
        return f"{self.status} {reason}", headers, body

    def response(self, request_id: str) -> Response:
        status, headers, body = self.refusal(request_id)
        return Response(body, status=int(status[:3]), headers=headers)


def header_text(message: str, limit: int = 200) -> str:
    """``message`` as an HTTP header value: printable ASCII, anything else escaped (the
    message may echo what the client sent; gevent refuses a header that is not Latin-1,
    and a line break would end the header)."""
    text = "".join(c if " " <= c <= "~" else c.encode("unicode_escape").decode("ascii")
                   for c in message)
    return text[:limit]


def from_cosyvoice(err: CosyvoiceError) -> ListenError:
    if isinstance(err, Unauthorized):
        return ListenError(401, "INVALID_AUTH", err.msg)
    if isinstance(err, Overloaded):
        return ListenError(429, "TOO_MANY_REQUESTS", err.msg, err.retry_after_ms)
    if isinstance(err, RateLimited):
        return ListenError(429, "TOO_MANY_REQUESTS", err.msg, err.retry_after_ms or 1000)
    if isinstance(err, Unavailable):
        return ListenError(503, "SERVICE_UNAVAILABLE", err.msg, 1000)
    return ListenError(400, "Bad Request", err.msg)


# ---- the query ----------------------------------------------------------------------------


def _flag(query: dict[str, list[str]], key: str, default: bool = False) -> bool:
    values = query.get(key)
    if not values:
        return default
    value = values[-1].strip().lower()
    if value in ("true", "1"):
        return True
    if value in ("false", "0"):
        return False
    raise ListenError(400, "Bad Request", f"{key} must be true or false")


def _int(query: dict[str, list[str]], key: str) -> int | None:
    values = query.get(key)
    if not values:
        return None
    try:
        return int(values[-1])
    except ValueError:
        raise ListenError(400, "Bad Request", f"{key} must be an integer") from None


def _language(language: str, offered: tuple[str, ...]) -> str:
    """Deepgram's ``language`` (``en``, ``en-US``, ``multi``) as a session's."""
    if language in ("", "multi"):
        return "auto" if language == "multi" and "auto" in offered else offered[0]
    base = language.split("-")[0].lower()
    if base not in offered:
        raise ListenError(400, "Bad Request",
                          f"language {language[:16]!r} is not offered on this server")
    return base


@dataclass
class Params:
    """A ``/v1/listen`` request's query, validated (docs/deepgram.md has the table)."""
    model: str = ""
    mode: str = ""
    language: str = ""
    encoding: str | None = None
    sample_rate: int | None = None
    channels: int = 1
    split: bool = False  # each channel its own session
    interim: bool = False
    endpointing: int | None = None  # ms; None: the server's
    speech_final: bool = True  # endpointing=false: never
    utterance_end_ms: int | None = None
    vad_events: bool = False
    punctuate: bool = False
    smart_format: bool = False
    diarize: bool = False
    keyterms: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, query: dict[str, list[str]], gateway: Gateway, live: bool = True) -> Params:
        p = cls()
        p.model = (query.get("model") or ["base"])[-1]
        p.mode = p.model if p.model in gateway.modes else gateway.modes[0]
        p.language = _language((query.get("language") or [""])[-1], gateway.languages)
        p._audio(query)
        p._turns(query, live)
        p.vad_events = _flag(query, "vad_events")
        p.punctuate = _flag(query, "punctuate")
        p.smart_format = _flag(query, "smart_format")
        p.diarize = _flag(query, "diarize") or bool(query.get("diarize_model"))
        p.keyterms = [k for k in query.get("keyterm", []) + query.get("keywords", []) if k][:100]
        p.tags = query.get("tag", [])[:20]
        return p

    def _audio(self, query: dict[str, list[str]]) -> None:
        p = self
        encoding = next(reversed(query.get("encoding") or []), None)
        if encoding is not None and encoding not in RAW_ENCODINGS + CONTAINERS:
            raise ListenError(400, "Bad Request", f"encoding must be one of "
                              f"{list(RAW_ENCODINGS + CONTAINERS)}, or absent for a container")
        p.encoding = encoding
        p.sample_rate = _int(query, "sample_rate")
        if encoding in RAW_ENCODINGS:
            if p.sample_rate is None:
                raise ListenError(400, "Bad Request", f"sample_rate is required with "
                                  f"encoding={encoding}")
            if not RATES[0] <= p.sample_rate <= RATES[1]:
                raise ListenError(400, "Bad Request", f"sample_rate must be from {RATES[0]} "
                                  f"to {RATES[1]} Hz")
        channels = _int(query, "channels")
        p.channels = 1 if channels is None else channels
        if not 1 <= p.channels <= MAX_CHANNELS:
            raise ListenError(400, "Bad Request", f"channels must be from 1 to {MAX_CHANNELS}")
        p.split = _flag(query, "multichannel", default=True)

    def _turns(self, query: dict[str, list[str]], live: bool) -> None:
        p = self
        p.interim = _flag(query, "interim_results")
        endpointing = next(reversed(query.get("endpointing") or []), None)
        if endpointing is not None:
            if endpointing.strip().lower() == "false":
                p.speech_final = False
            else:
                ms = _int(query, "endpointing")
                if ms is None or ms < 0:
                    raise ListenError(400, "Bad Request", "endpointing must be milliseconds "
                                      "or false")
                p.endpointing = min(ENDPOINT_MS[1], max(ENDPOINT_MS[0], ms))
        p.utterance_end_ms = _int(query, "utterance_end_ms")
        if p.utterance_end_ms is not None:
            if live and not p.interim:
                raise ListenError(400, "Bad Request",
                                  "utterance_end_ms needs interim_results=true")
            if not UTTERANCE_END_MS[0] <= p.utterance_end_ms <= UTTERANCE_END_MS[1]:
                raise ListenError(400, "Bad Request", f"utterance_end_ms must be from "
                                  f"{UTTERANCE_END_MS[0]} to {UTTERANCE_END_MS[1]}")

    @property
    def sessions(self) -> int:
        return self.channels if self.split else 1

    def session_auth(self, rate: int, file: bool = False) -> dict[str, Any]:
        """The cosyvoice session each channel is (its ``auth``)."""
        auth: dict[str, Any] = {"sample_rate": rate, "mode": self.mode, "language": self.language,
                                "interim": self.interim and not file,
                                "format": self.smart_format}
        if self.endpointing is not None:
            auth["endpoint_ms"] = self.endpointing
        elif not self.speech_final:  # only Finalize, the longest silence or length end them
            auth["endpoint_ms"] = ENDPOINT_MS[1]
        if (self.vad_events or self.utterance_end_ms) and not file:
            auth["speech_events"] = True
        if self.keyterms:  # Whisper reads them as its context
            auth["prompt"] = (", ".join(self.keyterms) + ".")[-MAX_PROMPT_CHARS:]
        if self.diarize:
            auth["diarize"] = "file" if file else "live"
        return auth


def credential(environ: dict) -> str | None:
    """The key of the handshake: ``Authorization: Token|Bearer KEY`` (any case), or a
    browser's ``Sec-WebSocket-Protocol: token, KEY`` (or ``bearer, JWT``)."""
    scheme, _, key = environ.get("HTTP_AUTHORIZATION", "").strip().partition(" ")
    if scheme.lower() in ("token", "bearer") and key.strip():
        return key.strip()
    offered = [p.strip() for p in environ.get("HTTP_SEC_WEBSOCKET_PROTOCOL", "").split(",")]
    for i, p in enumerate(offered[:-1]):
        if p.lower() in ("token", "bearer"):
            return offered[i + 1] or None
    return None


def client_address(environ: dict, trusted_proxies: int) -> str:
    """The client's address as Flask would see it behind ``trusted_proxies`` proxies."""
    forwarded = [a.strip() for a in environ.get("HTTP_X_FORWARDED_FOR", "").split(",")
                 if a.strip()]
    if trusted_proxies > 0 and len(forwarded) >= trusted_proxies:
        return forwarded[-trusted_proxies]
    return environ.get("REMOTE_ADDR", "")


def _received(query: dict[str, list[str]]) -> float | None:
    """A resuming client's ``received``: where the last final it got ends (seconds)."""
    values = query.get("received")
    if not values:
        return None
    try:
        value = float(values[-1])
    except ValueError:
        raise ListenError(400, "Bad Request", "received must be seconds of audio") from None
    if not value >= 0:
        raise ListenError(400, "Bad Request", "received must be seconds of audio")
    return value


def install(app: Flask, gateway: Gateway) -> None:
    PRECHECKS[PATH] = lambda environ: precheck(gateway, environ)
    SUBPROTOCOLS[PATH] = ("token", "bearer")
    MESSAGE_LIMITS[PATH] = gateway.settings.max_message_kb_listen * 1024
    app.add_url_rule(PATH, "deepgram_listen", lambda: connect(gateway), websocket=True)
    app.add_url_rule(PATH, "deepgram_listen_http", lambda: http(gateway),
                     methods=["GET", "POST"])


def precheck(gateway: Gateway, environ: dict) -> Refusal | None:
    """Before the upgrade: the query, the key and admission (the sessions open here)."""
    request_id = str(uuid.uuid4())
    query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    try:
        subject = gateway.auth.check(credential(environ))
    except Unauthorized as err:
        return ListenError(401, "INVALID_AUTH", "Websocket initialized with invalid "
                           f"credentials: {err.msg}").refusal(request_id)
    try:
        listen = Listen(gateway, Params.parse(query, gateway), subject, request_id)
        resume = (query.get("session") or [""])[-1]
        if not (resume and listen.resume(resume, _received(query))):
            listen.open(client_address(environ, gateway.settings.trusted_proxies))
    except ListenError as err:
        return err.refusal(request_id)
    except CosyvoiceError as err:
        return from_cosyvoice(err).refusal(request_id)
    except redis.RedisError as exc:
        metrics.REDIS_ERRORS.inc()
        log.warning("listen sessions not opened: %s", exc)
        return ListenError(503, "SERVICE_UNAVAILABLE", "the session store is unreachable",
                           1000).refusal(request_id)
    environ[ENV_KEY] = listen
    environ[ABANDON] = listen.abandon  # the upgrade failed after all
    environ[UPGRADE_HEADERS] = [("dg-request-id", listen.request_id)]
    return None


def connect(gateway: Gateway):
    ws = request.environ.get("wsgi.websocket")
    listen = request.environ.get(ENV_KEY)
    if ws is None or listen is None:
        return http(gateway)
    listen.run(ws)
    return Response()


# ---- the live connection ------------------------------------------------------------------


def model(mode: str) -> tuple[str, dict[str, str]]:
    """The ``model_uuid`` and ``model_info`` Deepgram's messages name a session mode by."""
    name = f"cosyvoice-{mode}"
    return (str(uuid.uuid5(uuid.NAMESPACE_URL, "cosyvoice:" + name)),
            {"name": name, "version": VERSION, "arch": "cosyvoice"})


def metadata(request_id: str, sha256: str, duration: float, params: Params) -> dict[str, Any]:
    """A stream's or a recording's ``Metadata``: its id, the audio's hash and seconds, its
    channels and the model."""
    model_uuid, info = model(params.mode)
    return {"transaction_key": "deprecated", "request_id": request_id, "sha256": sha256,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()),
            "duration": round(duration, 3), "channels": params.channels,
            "models": [model_uuid], "model_info": {model_uuid: info}}


def plain(word: str) -> str:
    """Deepgram's ``word``: lower case, no punctuation around it."""
    return _PUNCT.sub("", word).strip("'-").lower()


def speaker_number(label: str | None) -> int | None:
    """``S1`` → 0: Deepgram numbers speakers from 0."""
    if not label or not label[1:].isdigit():
        return None
    return int(label[1:]) - 1


def alternative(result: dict, params: Params) -> dict[str, Any]:
    """A result's text as Deepgram's one ``alternative``: transcript, confidence, words."""
    words = []
    for w in result.get("words") or []:
        word = {"word": plain(w["word"]), "start": round(w["start"], 3),
                "end": round(w["end"], 3), "confidence": round(float(w.get("conf", 0.0)), 4)}
        if params.punctuate or params.smart_format:
            word["punctuated_word"] = w["word"].strip()
        number = speaker_number(w.get("speaker") or result.get("speaker"))
        if params.diarize and number is not None:
            word["speaker"] = number
        if word["word"]:
            words.append(word)
    text = result.get("text", "").strip()
    if not (params.punctuate or params.smart_format):
        text = " ".join(w["word"] for w in words) if words else \
            " ".join(plain(t) for t in text.split() if plain(t))
    confidence = sum(w["confidence"] for w in words) / len(words) if words else 0.0
    return {"transcript": text, "confidence": round(confidence, 4), "words": words}


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


class Listen:
    """One ``/v1/listen`` connection: its sessions, its audio in, its results out."""

    def __init__(self, gateway: Gateway, params: Params, subject: str = ANONYMOUS,
                 request_id: str | None = None):
        self.gateway = gateway
        self.params = params
        self.subject = subject
        self.request_id = request_id or str(uuid.uuid4())
        self.output = SessionsOutput("listen-" + secrets.token_hex(6))
        self.channels: list[Channel] = []
        self.by_session: dict[str, Channel] = {}
        self.input: Input | None = None
        self.ws: Any = None
        self._send_lock = gevent.lock.Semaphore()
        self._take_lock = gevent.lock.Semaphore()
        self.sha = hashlib.sha256()
        self.heard = time.monotonic()
        self.closing = False  # CloseStream came: results still go out
        self.closed = False
        self.failed = False  # closed for a reason the client was told
        self.resumed = False
        self.created = time.time()
        self.ended = gevent.event.Event()
        self.model_uuid, self.model_info = model(params.mode)

    # ---- sessions ---------------------------------------------------------------------

    @property
    def rate(self) -> int:
        assert self.input is not None
        return self.input.rate

    def _input(self) -> Input:
        p = self.params
        return open_input(p.encoding, p.sample_rate, p.channels, p.split)

    def open(self, client: str) -> None:
        """Open and admit a session per channel (all or none); raises the refusal."""
        self.input = self._input()
        try:
            req = parse_auth(self.params.session_auth(self.input.rate), self.gateway.modes,
                             self.gateway.settings.accepted_codecs, (),
                             self.gateway.languages)
            for index in range(self.params.sessions):
                conn = self.gateway.open_session(req, f"{self.request_id}-{index}",
                                                 self.output, self.subject, client=client)
                self._add(Channel(index, conn))
        except Exception:
            self.abandon()
            raise
        self._save()

    def _add(self, channel: Channel) -> None:
        self.channels.append(channel)
        self.by_session[channel.conn.session] = channel

    def resume(self, request_id: str, received: float | None = None) -> bool:
        """Take over connection ``request_id``'s sessions (False: past the grace period,
        or not a request id). ``received``: where the last final the client got ends
        (seconds): every result after it is sent again; None: those the server had not
        sent yet."""
        try:
            uuid.UUID(request_id)
        except ValueError:
            return False
        raw = self.gateway.bus.load_face("listen", request_id)
        if raw is None:
            log.info("listen resume of %s: expired, a new stream starts", request_id)
            return False
        state = json.loads(raw)
        self.params = Params(**state["params"])
        self.request_id = request_id
        self.input = self._input()
        for index, ch in enumerate(state["channels"]):
            again = received is not None and received < ch["tile"]
            conn = self.gateway.resume_session(ch["session"],
                                               f"{request_id}-{index}-{secrets.token_hex(3)}",
                                               self.output,
                                               after="-" if again else ch["last_result"],
                                               subject=self.subject)
            if conn is None:
                self.abandon()
                return False
            channel = Channel(index, conn, seq=conn.next_seq, audio_s=ch["audio_s"],
                              last_word_end=ch["last_word_end"],
                              utterance_ended=ch["utterance_ended"],
                              last_result=ch["last_result"])
            if received is not None and again:  # the results after ``received`` go out
                channel.tile = channel.skip_until = received  # again; the rest is skipped
            else:
                channel.tile = ch["tile"]
            self._add(channel)
        self.resumed = True
        return True

    def _state(self) -> str:
        return json.dumps({"params": asdict(self.params),
                           "channels": [c.state() for c in self.channels]})

    def _save(self, ttl_s: float | None = None) -> None:
        self.gateway.save_face("listen", self.request_id, self._state(), ttl_s)

    def abandon(self) -> None:
        """Every session goes (the connection never came to be, or it is over)."""
        for channel in self.channels:
            try:
                self.gateway.close_session(channel.conn, self.output.id)
            except redis.RedisError as exc:
                metrics.REDIS_ERRORS.inc()
                log.warning("listen session %s not deleted: %s", channel.conn.session, exc)
        self.channels, self.by_session = [], {}
        if self.input is not None:
            self.input.close()

    def _leave(self) -> None:
        """The connection is gone without CloseStream: the sessions wait for the client
        to come back (the grace period), as a Socket.IO client's do."""
        if self.gateway.settings.session_grace_s <= 0:
            self.abandon()
            return
        kept = False
        for channel in self.channels:
            try:
                kept = self.gateway.release_session(channel.conn, self.output.id) or kept
            except redis.RedisError as exc:
                metrics.REDIS_ERRORS.inc()
                log.warning("listen session %s not released: %s", channel.conn.session, exc)
        if kept:
            self._save(self.gateway.settings.session_grace_s)
        if self.input is not None:
            self.input.close()

    # ---- the connection ---------------------------------------------------------------

    def run(self, ws) -> None:
        self.ws = ws
        ws.environ[ON_TOO_BIG] = self.too_big
        self.heard = time.monotonic()
        relay = gevent.spawn(self.relay)
        idle = gevent.spawn(self.watch_idle)
        pump = gevent.spawn(self.pump) if isinstance(self.input, ContainerInput) else None
        clean = False
        try:
            if self.resumed:
                for channel in self.channels:
                    self.gateway.relay.replay(channel.conn.session)
            while not self.closed and not self.closing:
                try:
                    frame = ws.receive()
                except WebSocketError:
                    break
                if frame is None:
                    break
                self.handle(frame)
            if self.closing and not self.closed:
                clean = self._drain()
        except CosyvoiceError as err:
            self.fail(1011, "NET-0000", err.msg)
        except redis.RedisError as exc:
            metrics.REDIS_ERRORS.inc()
            log.warning("listen session store failed: %s", exc)
            self.fail(1011, "NET-0000", "the session store is unreachable")
        finally:
            idle.kill()
            if pump is not None:
                pump.kill()
            relay.kill()
            if clean or self.failed:
                self.abandon()  # over: its sessions go
            else:
                self._leave()  # the client may come back
            self.closed = True

    def send(self, message: dict[str, Any]) -> None:
        with self._send_lock:
            if self.closed:
                return
            try:
                self.ws.send(json.dumps(message, ensure_ascii=False))
            except WebSocketError:
                self.closed = True

    def fail(self, code: int, dg_code: str, description: str) -> None:
        """Say why, then close with ``code``: the sessions go."""
        self.send({"type": "Error", "variant": "error", "code": dg_code,
                   "description": description, "message": f"{dg_code}: {description}"})
        self._close(code, f"{dg_code}: {description}")
        self.failed = True

    def too_big(self, limit: int) -> None:
        """A frame over the limit (its payload unread): say so; wsframes closes 1009."""
        self.fail(1009, "DATA-0001", f"a frame is at most {limit} bytes")

    def _close(self, code: int, reason: str) -> None:
        with self._send_lock:
            if not self.closed:
                self.closed = True
                close_ws(self.ws, code, reason)

    def watch_idle(self) -> None:
        timeout = self.gateway.settings.listen_idle_timeout_s
        if timeout <= 0:
            return
        while not self.closed:
            gevent.sleep(min(0.5, timeout / 4))
            if not self.closing and time.monotonic() - self.heard > timeout:
                log.info("listen connection %s idle", self.request_id)
                self.fail(1011, "NET-0001", f"no audio and no KeepAlive for {timeout:g} s")
                return

    # ---- client frames ----------------------------------------------------------------

    def handle(self, frame: str | bytes | bytearray) -> None:
        self.heard = time.monotonic()
        if isinstance(frame, str):
            self.control(frame)
            return
        if not frame:  # not the end of the stream (Deepgram deprecated that): nothing
            return
        self.sha.update(frame)
        if isinstance(self.input, ContainerInput):
            self.input.write(bytes(frame))  # decoded on its thread: ``pump`` takes it
            return
        assert self.input is not None
        self._take(self.input.feed(bytes(frame)))

    def pump(self) -> None:
        """A container's audio into the sessions as its decoder gives it (a greenlet)."""
        assert isinstance(self.input, ContainerInput)
        while not (self.closed or self.closing):
            if self.input.wait(1.0):
                self._take(self._decoded())
                if self.failed:
                    return

    def _take(self, streams: list[bytes], finalize: tuple[int, ...] = (),
              last: bool = False) -> None:
        """Decoded audio per channel into the sessions, as whole 200 ms chunks (the rest
        waits; all of it for the channels in ``finalize``, and with ``last``). One at a
        time: a container's audio comes from ``pump`` as the client's frames go on."""
        with self._take_lock:
            self._take_locked(streams, finalize, last)

    def _take_locked(self, streams: list[bytes], finalize: tuple[int, ...],
                     last: bool) -> None:
        rate = self.rate
        size = rate * 2 * CHUNK_MS // 1000
        if time.time() - self.created > self.gateway.settings.max_session_s:
            self.fail(1011, "NET-0000", "the stream reached its maximum length")
            return
        for channel, pcm in zip(self.channels, streams, strict=False):
            channel.pending += pcm
            channel.audio_s += len(pcm) / 2 / rate
            while len(channel.pending) >= size:
                self._store(channel, bytes(channel.pending[:size]))
                del channel.pending[:size]
            if channel.index in finalize or last:
                chunk = bytes(channel.pending)
                channel.pending.clear()
                if channel.index in finalize:
                    channel.finalizes.append((channel.seq, channel.audio_s))
                self._store(channel, chunk, finalize=channel.index in finalize, last=last)
            self._utterance_end(channel)

    def _store(self, channel: Channel, pcm: bytes, finalize: bool = False,
               last: bool = False) -> None:
        # busy with the client's audio (a large frame at the rate limit takes a while):
        # not idle
        self.heard = time.monotonic()
        self.gateway.store_pcm(channel.conn, pcm, channel.seq, self.rate, finalize=finalize,
                               last=last)
        if last:
            channel.last_seq = channel.seq
        channel.seq += 1

    def control(self, frame: str) -> None:
        try:
            message = json.loads(frame)
        except ValueError:
            message = None
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "KeepAlive":
            for channel in self.channels:
                self.gateway.touch(channel.conn)
        elif kind == "Finalize":
            assert message is not None
            only = message.get("channel")
            self._take(self._decoded(), finalize=tuple(
                c.index for c in self.channels if only is None or only == c.index))
        elif kind == "CloseStream":
            self.closing = True
        elif kind == "Configure":
            assert message is not None
            self.send({"type": "ConfigureFailure", "request_id": self.request_id,
                       "code": "CONFIGURE_KEYTERMS_NOT_SUPPORTED",
                       "description": "keyterms are set when the stream opens (keyterm=...)"})
        else:
            self.send({"type": "Error", "variant": "warning", "code": "INVALID_MESSAGE",
                       "description": "text frames are KeepAlive, Finalize, CloseStream or "
                                      "Configure JSON messages; audio goes in binary frames",
                       "message": "INVALID_MESSAGE"})

    def _decoded(self) -> list[bytes]:
        """What the input holds decoded and not yet handed on (nothing for raw audio)."""
        assert self.input is not None
        if self.closed:
            return [b""] * len(self.channels)
        try:
            return self.input.feed(b"")
        except BadAudio as err:
            self._bad_audio(err)
            return [b""] * len(self.channels)

    def _drain(self) -> bool:
        """CloseStream: the last audio in, every result out, then Metadata and close."""
        assert self.input is not None
        try:
            streams = self.input.flush()
        except BadAudio as err:
            self._bad_audio(err)
            return False
        self._take(streams, last=True)
        deadline = time.monotonic() + IDLE_S
        while not self.ended.wait(timeout=1.0):
            if self.closed:  # the client left meanwhile: its sessions wait for it
                return False
            if time.monotonic() > deadline:
                self.fail(1011, "NET-0000", "the last results did not come in time")
                return False
        duration = max((c.audio_s for c in self.channels), default=0.0)
        self.send({"type": "Metadata", **metadata(self.request_id, self.sha.hexdigest(),
                                                  duration, self.params)})
        self._close(1000, "")
        return True

    def _bad_audio(self, err: BadAudio) -> None:
        self.fail(1008, "DATA-0000", f"the payload cannot be decoded as audio: {err}")

    # ---- results ----------------------------------------------------------------------

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


# ---- pre-recorded: POST /v1/listen -------------------------------------------------------


def http(gateway: Gateway):
    """``POST /v1/listen``: a whole recording's transcript, per channel with
    ``multichannel=true``; a plain ``GET`` is told to upgrade."""
    request_id = str(uuid.uuid4())
    if request.method != "POST":
        return ListenError(426, "UPGRADE_REQUIRED", "this is a WebSocket endpoint for live "
                           "audio, or POST a recording").response(request_id)
    try:
        return prerecorded(gateway, request_id)
    except ListenError as err:
        return err.response(request_id)


def prerecorded(gateway: Gateway, request_id: str):
    try:
        subject = gateway.auth.check(credential(request.environ))
    except Unauthorized as err:
        raise ListenError(401, "INVALID_AUTH", f"invalid credentials: {err.msg}") from None
    query = parse_qs(request.query_string.decode("latin-1"), keep_blank_values=True)
    params = Params.parse(query, gateway, live=False)
    params.split = _flag(query, "multichannel")
    if "json" in (request.content_type or ""):
        raise ListenError(400, "Bad Request", "send the recording itself as the request "
                          "body: this server does not fetch URLs")
    limit = gateway.settings.max_upload_mb * 1024 * 1024
    try:
        body = read_body(request.environ, limit)
    except BadBody as err:
        raise ListenError(400, "Bad Request", str(err)) from None
    except BodyTooLarge:
        raise ListenError(413, "PAYLOAD_TOO_LARGE", f"the recording is larger than "
                          f"{gateway.settings.max_upload_mb} MB "
                          f"(COSYVOICE_MAX_UPLOAD_MB)") from None
    if not body:
        raise ListenError(400, "Bad Request", "the request body holds no audio")
    streams, rate = off_the_loop(decode_recording, body, params)
    if not any(streams):
        raise ListenError(400, "Bad Request", "the payload cannot be decoded as audio")
    if params.split:
        params.channels = len(streams)
    finals = transcribe_channels(gateway, params, streams, rate, subject)
    about = metadata(request_id, hashlib.sha256(body).hexdigest(),
                     max(len(pcm) / 2 / rate for pcm in streams), params)
    channels = []
    for channel_finals in finals:
        joined = {"text": " ".join(f["text"].strip() for f in channel_finals
                                   if f["text"].strip()),
                  "words": [{**w, "speaker": w.get("speaker") or f.get("speaker")}
                            for f in channel_finals for w in f.get("words") or []]}
        channels.append({"alternatives": [alternative(joined, params)]})
    results: dict[str, Any] = {"channels": channels}
    if _flag(query, "utterances"):
        results["utterances"] = utterances(finals, params, request_id)
    return Response(json.dumps({"metadata": about, "results": results}),
                    mimetype="application/json", headers={"dg-request-id": request_id})


def transcribe_channels(gateway: Gateway, params: Params, streams: list[bytes], rate: int,
                        subject: str) -> list[list[Any]]:
    """Each stream's finals, the streams through sessions of their own at once."""
    try:
        req = parse_auth(params.session_auth(rate, file=True), gateway.modes,
                         gateway.settings.accepted_codecs, (), gateway.languages)
    except CosyvoiceError as err:
        raise ListenError(400, "Bad Request", err.msg) from None
    sessions = [FileSession(gateway, pcm, rate, req, label="listen", subject=subject)
                for pcm in streams]
    try:
        for session in sessions:
            session.open()
        jobs = [gevent.spawn(lambda s=s: list(s.finals())) for s in sessions]
        gevent.joinall(jobs)
        for job in jobs:
            if job.exception is not None:
                raise job.exception
        finals = [job.value for job in jobs]
    except CosyvoiceError as err:
        raise from_cosyvoice(err) from err
    finally:
        for session in sessions:
            session.close()
    if params.diarize:  # every piece of the recording at once labels better than live
        finals = [speakers.recluster(f) for f in finals]
    return finals


def utterances(finals: list[list[Any]], params: Params, request_id: str) -> list[dict]:
    """``utterances=true``: every final of every channel, as Deepgram lists them."""
    return [{"start": f["start"], "end": f["end"], "channel": index,
             "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"{request_id}/{index}/{i}")),
             **alternative(f, params),
             **({"speaker": speaker_number(f.get("speaker"))} if params.diarize else {})}
            for index, channel_finals in enumerate(finals)
            for i, f in enumerate(channel_finals) if f["text"].strip()]


def decode_recording(body: bytes, params: Params) -> tuple[list[bytes], int]:
    """A recording's PCM per session (per channel with ``split``) and its rate."""
    if params.encoding in RAW_ENCODINGS:
        decoder = open_input(params.encoding, params.sample_rate, params.channels,
                             params.split)
        streams = decoder.feed(body)
        streams = [a + b for a, b in zip(streams, decoder.flush(), strict=True)]
        return streams, decoder.rate
    from ...wire.audio import AudioFileError, read_channels
    try:
        streams, rate = read_channels(body, split=params.split)
    except AudioFileError as err:
        raise ListenError(400, "Bad Request", str(err)) from None
    return streams, rate
