"""The Socket.IO face: namespace ``/ws``, what the page and ``cosyvoice transcribe`` speak
(docs/protocol.md): ``connect`` opens or resumes a session, ``audio_chunk`` stores a
protobuf chunk and is acked, ``stop`` and ``keepalive``; results come back as the
session's events (``partial``, ``final``, ``end``, ``error``) through the relay.

Names: ``socket_id`` is a Socket.IO connection (python-socketio's ``sid``), ``session`` a
cosyvoice session id. Imports: the gateway, the wire, settings and metrics.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import gevent
import redis
from flask import request
from socketio.exceptions import ConnectionRefusedError as Refused

from .. import metrics
from ..gateway.core import Connection, Gateway, session_limits
from ..gateway.limits import ConnectRequest, parse_auth
from ..wire import abr, abr_estimator, codecs
from ..wire.errors import (
    BadChunk,
    CosyvoiceError,
    IdleTimeout,
    Internal,
    RateLimited,
    SessionExpired,
    SessionLost,
    Unavailable,
)
from ..wire.languages import HANS
from ..wire.protocol import CHUNK_MS, NAMESPACE, Chunk, decode_chunk

log = logging.getLogger("cosyvoice.gateway")

# How long a connection whose session the store lost waits for a new one (the store
# starting again, the workers registering again) before it is told to start over.
LOST_RETRY_S = 60.0
def current_socket_id() -> str:
    """The Socket.IO connection whose handler is running (Flask-SocketIO's ``request.sid``)."""
    # Flask-SocketIO adds ``sid`` to Flask's request object; Flask's types do not know it.
    socket_id: str = request.sid  # type: ignore[attr-defined]
    return socket_id


def error_ack(err: CosyvoiceError) -> dict:
    """The ack of a refused chunk: its code, and its seq when the error names one."""
    ack: dict[str, str | int] = {"error": err.code}
    if err.seq is not None:
        ack["seq"] = err.seq
    return ack


def session_event(conn: "Connection", resumed: bool, limits: dict) -> dict:
    """The ``session`` event that tells a client its session and where to go on."""
    return {"session": conn.session, "resumed": resumed, "next_seq": conn.next_seq,
            "sample_rate": conn.rate, "chunk_ms": CHUNK_MS, "mode": conn.mode,
            "codec": conn.codec, "bitrate": conn.bitrate, "abr": conn.estimator is not None,
            "language": conn.options.get("language", ""),
            "script": conn.options.get("script", HANS),
            "format": conn.options.get("format") == "1",
            "diarize": conn.options.get("diarize") or False, "limits": limits}


class SocketIOFace:
    """The namespace's handlers over one process's ``Gateway``; its connections by
    ``socket_id``."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway
        self.settings = gateway.settings
        self.socketio = gateway.socketio
        self.connections: dict[str, Connection] = {}
        # the rungs a client that follows switches moves between (fixed by the settings)
        self.rungs = abr.rungs_for(self.settings.accepted_codecs,
                                   self.settings.opus_bitrate_list)
        # the idle timeout's watcher (not in in-process tests, where nothing runs the hub)
        if gateway.background and self.settings.idle_timeout_s > 0:
            gevent.spawn(self.watch_idle)

    def register(self) -> None:
        on = self.socketio.on
        on("connect", namespace=NAMESPACE)(self.on_connect)
        on("disconnect", namespace=NAMESPACE)(self.on_disconnect)
        # The hot path goes to python-socketio directly: Flask-SocketIO would build a
        # Flask request context for every chunk (environ copy, URL matching, session
        # object), about a tenth of the gateway's CPU under load, for nothing this
        # handler uses. Errors are handled inside, as on_handler_error does for the rest.
        self.socketio.server.on("audio_chunk", self.on_audio_chunk, namespace=NAMESPACE)
        on("stop", namespace=NAMESPACE)(self.on_stop)
        on("keepalive", namespace=NAMESPACE)(self.on_keepalive)
        on("*", namespace=NAMESPACE)(self.on_unknown_event)
        self.socketio.on_error(NAMESPACE)(self.on_handler_error)

    def _emit_error(self, err: CosyvoiceError, socket_id: str | None = None) -> None:
        self.socketio.emit("error", err.to_wire(), to=socket_id or current_socket_id(),
                           namespace=NAMESPACE)

    def on_connect(self, auth=None):
        """Open or resume a session. A refusal is a Socket.IO connect error,
        ``{message, data}`` with the wire error (``{code, msg, ...}``) as ``data``.

        Everything the client must see after connecting is emitted by a greenlet that
        runs once the connect packet is out: events sent from inside this handler would
        precede it and be dropped by clients.
        """
        notices: list[CosyvoiceError] = []
        socket_id = current_socket_id()
        try:
            req = parse_auth(auth, self.gateway.modes, self.settings.accepted_codecs,
                             self.settings.opus_bitrate_list, self.gateway.languages)
            subject = self.gateway.auth.check(req.token)
            conn = self._resume(req, socket_id, notices) if req.session else None
            resumed = conn is not None
            if conn is None:
                conn = self.gateway.open_session(req, socket_id, subject=subject)
            conn.subject = subject
            conn.request = req
            conn.codec, conn.bitrate = self._codec(req)
            if req.abr and self.settings.abr:
                self._start_abr(conn, req)
        except CosyvoiceError as err:
            log.info("connection refused: %s", err.code, extra={"event": "refuse"})
            raise Refused(err.msg, err.to_wire()) from err
        except redis.RedisError as exc:
            log.warning("cannot open a session: %s", exc)
            metrics.REDIS_ERRORS.inc()
            unavailable = Unavailable("the session store is unreachable")
            raise Refused(unavailable.msg, unavailable.to_wire()) from exc
        self.connections[socket_id] = conn
        gevent.spawn(self._welcome, socket_id, conn, resumed, notices)
        return True

    def _codec(self, req: ConnectRequest) -> tuple[str, int]:
        """The codec and bitrate a connection said it will send: what it asked for (already
        checked against the offer), else PCM where the server takes it."""
        accepted = self.settings.accepted_codecs
        codec = req.codec or (codecs.PCM16 if codecs.PCM16 in accepted else accepted[0])
        if codec != codecs.OPUS:
            return codec, 0
        return codec, req.bitrate or self.settings.opus_bitrate_list[0]

    def _start_abr(self, conn: Connection, req: ConnectRequest) -> None:
        """A client that follows switches starts on the rung it asked for (else the highest),
        or lower where its network hint says the link is slower (the session event names
        the rung), and gets an estimator."""
        rungs = self.rungs
        if len(rungs) < 2:
            return  # one rung: nothing to switch between
        asked = abr.rung_for(req.codec, conn.bitrate or 0, rungs) if req.codec else None
        start = asked or rungs[0]
        hinted, why = abr.start_rung(req.network_hint, rungs)
        if why == "network_hint" and rungs.index(hinted) > rungs.index(start):
            start = hinted  # the hint says the link is slower than the rung asked for
        conn.codec, conn.bitrate = start.codec, start.bitrate if start.codec == codecs.OPUS else 0
        conn.estimator = abr_estimator.Estimator(start, rungs=rungs)

    def _judge(self, conn: Connection, chunk: Chunk, payload_bytes: int, arrival_s: float,
               socket_id: str) -> None:
        """Feed a stored chunk to the connection's estimator; tell the client of a switch."""
        estimator = conn.estimator
        if estimator is None:
            return
        rung = abr.rung_for(chunk.codec, chunk.bitrate or conn.bitrate, estimator.rungs)
        if rung is None:
            return
        decision = estimator.on_chunk(chunk.sent_ms, arrival_s,
                                      payload_bytes + abr.CHUNK_FRAMING_BYTES, rung.name)
        metrics.ABR_RUNG_SECONDS.labels(rung.name).inc(chunk.duration_s)
        metrics.ABR_QUEUE_DELAY.observe(max(0.0, estimator.queue_delay_ms) / 1000)
        if decision is None:
            return
        metrics.ABR_SWITCHES.labels(decision.direction, decision.reason).inc()
        conn.codec, conn.bitrate = decision.rung.codec, decision.rung.bitrate
        log.info("switch %s to %s (%s)", decision.direction, decision.rung.name,
                 decision.reason, extra={"session": conn.session, "event": "abr"})
        self.socketio.emit(f"switch_{decision.direction}",
                           {**decision.rung.to_wire(), "reason": decision.reason},
                           to=socket_id, namespace=NAMESPACE)

    def _welcome(self, socket_id: str, conn: Connection, resumed: bool,
                 notices: list[CosyvoiceError]) -> None:
        to = {"to": socket_id, "namespace": NAMESPACE}
        for notice in notices:
            self.socketio.emit("error", notice.to_wire(), **to)
        self.socketio.emit("session", session_event(conn, resumed,
                                                    session_limits(self.settings)), **to)
        if resumed:
            try:
                self.gateway.relay.replay(conn.session)
            except redis.RedisError as exc:
                log.warning("replay of %s failed: %s", conn.session, exc)

    def _resume(self, req: ConnectRequest, socket_id: str,
                notices: list[CosyvoiceError]) -> Connection | None:
        if req.session is None:
            return None
        conn = self.gateway.resume_session(req.session, socket_id, after=req.last_result or "-")
        if conn is None:
            # Past the grace period: say so, then carry on with a fresh session.
            notices.append(SessionExpired("the session expired; a new one was started"))
        return conn

    def on_disconnect(self, reason=None):
        conn = self.connections.pop(current_socket_id(), None)
        if conn is None:
            return
        try:
            self.gateway.release_session(conn, current_socket_id())
        except redis.RedisError as exc:
            metrics.REDIS_ERRORS.inc()
            log.warning("disconnect cleanup of %s failed: %s", conn.session, exc)
        log.info("session disconnected", extra={"session": conn.session, "event": "disconnect"})

    @metrics.counts_chunks
    def on_audio_chunk(self, socket_id: str, data=None):
        """python-socketio handler (no Flask request context): the ack, or an error."""
        arrival_s = time.monotonic()
        conn = self.connections.get(socket_id)
        if conn is not None:
            conn.heard = arrival_s
        if conn is not None and conn.lost:  # said once; the new session's event follows
            return error_ack(SessionLost("a new session is being opened"))
        try:
            if conn is None or conn.stopped:
                raise SessionExpired("this connection has no active session")
            chunk = decode_chunk(data, conn.rate, self.settings.max_chunk_ms,
                                 self.settings.accepted_codecs)
            self._check_limits(conn, chunk)
            conn.rate = chunk.sample_rate
            ack = self.gateway.store(conn, chunk, data)
            conn.ended = conn.ended or chunk.last
            if "duplicate" not in ack:
                metrics.count_audio(chunk.codec, len(data), chunk.duration_s)
                self._judge(conn, chunk, len(data), arrival_s, socket_id)
            return ack
        except SessionLost as err:
            assert conn is not None
            self._replace_lost(socket_id, conn, err)
            return error_ack(err)
        except CosyvoiceError as err:
            self._emit_error(err, socket_id)
            return error_ack(err)
        except Exception as exc:  # noqa: BLE001 - as on_handler_error for the other events
            log.error("handler failed", exc_info=exc)
            self._emit_error(Internal("internal error"), socket_id)
            return {"error": Internal.code}

    def _replace_lost(self, socket_id: str, conn: Connection, err: SessionLost) -> None:
        """The store lost the connection's session (a Redis that restarted without its
        data): say once which audio went with it, and open a new session with the same
        request (``_reopen``); its ``session`` event tells the client to send its audio
        again (a file) or go on (a microphone)."""
        if conn.lost:
            return
        conn.lost = conn.stopped = True
        start = self.gateway.final_ends.pop(conn.session, 0.0)
        lost = [round(start, 3), round(max(conn.audio_s, start), 3)]
        self.socketio.emit("error", {**err.to_wire(), "lost": lost}, to=socket_id,
                           namespace=NAMESPACE)
        log.warning("session lost by the store", extra={"session": conn.session,
                                                        "event": "lost"})
        self.gateway.release_session(conn, socket_id)  # stopped: only its results stop
        gevent.spawn(self._reopen, socket_id, conn)

    def _reopen(self, socket_id: str, conn: Connection) -> None:
        """A new session for a connection whose session was lost, as soon as one can be
        opened (the store may still be starting, the workers registering again): tried
        every second for ``LOST_RETRY_S`` while the client stays; then it is told
        ``session_expired`` and disconnected (it reconnects into a fresh session)."""
        req = replace(conn.request or ConnectRequest(), session=None, last_result=None)
        deadline = time.monotonic() + LOST_RETRY_S
        while self.connections.get(socket_id) is conn:
            try:
                new = self.gateway.open_session(req, socket_id, client=conn.client)
            except (CosyvoiceError, redis.RedisError) as exc:
                if time.monotonic() > deadline:
                    self._emit_error(SessionExpired("no new session could be opened"),
                                     socket_id)
                    self.socketio.server.disconnect(socket_id, namespace=NAMESPACE)
                    return
                log.info("no new session for a lost one yet: %s", exc)
                gevent.sleep(1.0)
                continue
            new.subject, new.request = conn.subject, conn.request
            new.codec, new.bitrate = conn.codec, conn.bitrate
            self.connections[socket_id] = new
            self._welcome(socket_id, new, False, [])
            return

    def _check_limits(self, conn: Connection, chunk: Chunk) -> None:
        duration = chunk.duration_s
        if conn.bucket is not None and not conn.bucket.take(duration):
            raise RateLimited("sending faster than the configured rate; resend later",
                              seq=chunk.seq)
        if time.time() - conn.created > self.settings.max_session_s:
            raise SessionExpired("the session reached its maximum length", seq=chunk.seq)

    def on_stop(self, data=None):
        conn = self.connections.get(current_socket_id())
        if conn is None or conn.stopped:
            return {"stopped": False}
        conn.stopped = True
        try:
            self.gateway.close_session(conn, current_socket_id())
        except redis.RedisError as exc:
            conn.stopped = False
            metrics.REDIS_ERRORS.inc()
            self._emit_error(Unavailable("could not delete the session"))
            log.warning("stop of %s failed: %s", conn.session, exc)
            return {"stopped": False}
        log.info("session stopped", extra={"session": conn.session, "event": "stop"})
        return {"stopped": True, "session": conn.session}

    def on_keepalive(self, data=None):
        """The client is there though it sends no audio now: the idle timeout starts
        again, and the sweeper sees the session as alive."""
        conn = self.connections.get(current_socket_id())
        if conn is None or conn.stopped:
            return {"ok": False}
        conn.heard = time.monotonic()
        self.gateway.touch(conn)
        return {"ok": True}

    def watch_idle(self) -> None:
        """End the sessions of connections idle for ``idle_timeout_s`` (a greenlet)."""
        timeout = self.settings.idle_timeout_s
        while True:
            gevent.sleep(min(1.0, timeout / 4))
            now = time.monotonic()
            for socket_id, conn in list(self.connections.items()):
                if not (conn.stopped or conn.ended) and now - conn.heard > timeout:
                    self._end_idle(socket_id, conn, timeout)

    def _end_idle(self, socket_id: str, conn: Connection, timeout: float) -> None:
        self._emit_error(IdleTimeout(f"no audio and no keepalive for {timeout:g} s; the "
                                     f"session ended"), socket_id)
        try:
            self.gateway.close_session(conn, socket_id)
        except redis.RedisError as exc:
            metrics.REDIS_ERRORS.inc()
            log.warning("idle session %s not deleted: %s", conn.session, exc)
        log.info("session idle", extra={"session": conn.session, "event": "idle"})
        self.socketio.server.disconnect(socket_id, namespace=NAMESPACE)

    def on_unknown_event(self, event, *args):
        self._emit_error(BadChunk(f"unknown event {str(event)[:64]!r}"))
        return {"error": "bad_chunk"}

    def on_handler_error(self, exc):
        log.error("handler failed", exc_info=exc)
        self._emit_error(Internal("internal error"))

