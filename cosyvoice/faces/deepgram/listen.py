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
import json
import logging
import secrets
import time
import uuid
from dataclasses import asdict
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
from ...gateway.core import Gateway
from ...gateway.files import IDLE_S
from ...gateway.limits import (
    parse_auth,
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
    watch_idle,
)
from ...wire.codecs import CHUNK_MS
from ...wire.errors import CosyvoiceError, Unauthorized
from ...wire.live_audio import (
    BadAudio,
    ContainerInput,
    Input,
    open_input,
)
from .params import (
    ENV_KEY,
    PATH,
    ListenError,
    Params,
    client_address,
    credential,
    from_cosyvoice,
    metadata,
    model,
    received,
)
from .prerecorded import http
from .results import Channel, Results

log = logging.getLogger(__name__)

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
        if not (resume and listen.resume(resume, received(query))):
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

class Listen(Results):
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

        def idle() -> None:
            log.info("listen connection %s idle", self.request_id)
            self.fail(1011, "NET-0001", f"no audio and no KeepAlive for {timeout:g} s")

        watch_idle(timeout, lambda: None if self.closing else self.heard,
                   lambda: self.closed, idle)

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
