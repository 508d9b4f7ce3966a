"""The gateway: Flask app and Socket.IO handlers on namespace ``/ws``.

It validates chunks and appends them to Redis, and relays results from Redis to the
client; it never decodes audio. Run it under gunicorn's GeventWebSocketWorker
(``gunicorn -c gunicorn.conf.py cosyvoice.webui:app``) or with ``cosyvoice gateway``;
either way gevent has patched the standard library before this module is imported.

The gateway is WebSocket-only, so a connection lives in exactly one process: each
process keeps its connections in memory and subscribes only to their result channels.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import gevent
import redis
from flask import Flask, jsonify, request, send_from_directory
from flask_socketio import SocketIO
from gevent.event import AsyncResult
from gevent.lock import Semaphore
from gevent.queue import Queue
from socketio.exceptions import ConnectionRefusedError as Refused

from . import bus as busmod
from . import fastws
from . import tokens
from .errors import (BadChunk, CosyvoiceError, Internal, Overloaded, RateLimited, SeqGap,
                     SessionExpired, Unavailable)
from .asr import ENGINE_MODES
from .limits import ConnectRequest, TokenBucket, parse_auth, result_id_key
from .protocol import CHUNK_MS, SUPPORTED_RATES, Chunk, decode_chunk, max_payload_bytes
from .settings import Settings
from . import debug_mem, metrics, probes

log = logging.getLogger("cosyvoice.gateway")

NAMESPACE = "/ws"
STATIC_DIR = Path(__file__).parent / "static"
# Largest batch of chunks written to Redis in one round trip.
WRITE_BATCH = 256
# How long a handler waits for its chunk to be stored before answering `unavailable`.
WRITE_TIMEOUT_S = 10.0
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; worker-src 'self'; media-src 'self'; object-src 'none'; "
    "base-uri 'self'; form-action 'self'; frame-ancestors 'none'")
# Cap of the pause between attempts to reach Redis again.
MAX_BACKOFF_S = 2.0


@dataclass
class Connection:
    """One client connection's state; lives in the process that holds the socket."""

    session: str
    rate: int
    conn_id: str
    client: str
    bucket: TokenBucket | None
    next_seq: int = 0  # as the session was opened or resumed
    created: float = field(default_factory=time.time)  # wall clock, for max_session_s
    stopped: bool = False
    mode: str = ""


class ChunkWriter:
    """Appends chunks to Redis from one greenlet, in arrival order, batched per round trip.

    A connection's events are handled one after another in its reader greenlet
    (``async_handlers=False``), and chunks of all connections meet on this queue, so
    chunks reach Redis in the order they arrived; the append script then checks each
    seq atomically.
    """

    def __init__(self, bus: busmod.Bus):
        self.bus = bus
        self.queue: Queue = Queue()
        self._greenlet = gevent.spawn(self._run)

    def append(self, sid: str, chunk: Chunk, pb: bytes):
        done = AsyncResult()
        self.queue.put((sid, chunk.seq, pb, chunk.sample_rate, chunk.last, done))
        return done.get(timeout=WRITE_TIMEOUT_S)

    def _run(self) -> None:
        while True:
            batch = [self.queue.get()]
            # Let the other handlers that are ready now queue their chunks first: one
            # round trip then carries all of them.
            gevent.sleep(0)
            while len(batch) < WRITE_BATCH and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            try:
                replies = self.bus.append_chunks([item[:5] for item in batch])
            except redis.RedisError as exc:
                log.warning("redis append failed: %s", exc)
                metrics.REDIS_ERRORS.inc()
                replies = [exc] * len(batch)
            for item, reply in zip(batch, replies):
                item[5].set(reply)


@dataclass
class Route:
    """Where one session's results go, and which of them the connection already has."""

    socket_sid: str
    last_id: str | None = None
    replaying: bool = True
    held: list = field(default_factory=list)


class ResultRelay:
    """One Redis subscriber per gateway process, routing results to connections.

    Results carry their replay-stream id; a route drops any id it has already passed,
    so replay (after a resume, or after the subscriber lost Redis) and live delivery
    never show a client the same result twice.
    """

    def __init__(self, client: redis.Redis, bus: busmod.Bus, socketio: SocketIO,
                 start: bool = True):
        self.socketio = socketio
        self.bus = bus
        self.pubsub = client.pubsub(ignore_subscribe_messages=True)
        self.routes: dict[str, Route] = {}  # session id -> route
        self._lock = Semaphore()
        self._greenlet = gevent.spawn(self._run) if start else None

    def subscribe(self, session: str, socket_sid: str, after: str | None = None) -> None:
        """Route the session's results to ``socket_sid``.

        ``after=None`` means a new session: nothing to replay. Otherwise live results are
        held until ``replay`` has sent those stored after ``after`` ("-": all of them).
        """
        last = None if after in (None, "-") else after
        self.routes[session] = Route(socket_sid, last, replaying=after is not None)
        with self._lock:
            self.pubsub.subscribe(busmod.text_key(session))

    def replay(self, session: str) -> None:
        route = self.routes.get(session)
        if route is not None:
            self._replay(session, route)

    def unsubscribe(self, session: str, socket_sid: str | None = None) -> None:
        route = self.routes.get(session)
        if route is None or (socket_sid is not None and route.socket_sid != socket_sid):
            return
        del self.routes[session]
        with self._lock:
            self.pubsub.unsubscribe(busmod.text_key(session))

    def _replay(self, session: str, route: Route) -> None:
        route.replaying = True
        try:
            for result_id, payload in self.bus.results_after(session, route.last_id or "-"):
                self._send(session, route, result_id, payload)
        finally:
            route.replaying = False
            held, route.held = route.held, []
            for result_id, payload in held:
                self._send(session, route, result_id, payload)

    def _run(self) -> None:
        backoff = 0.1
        lost = False
        while True:
            try:
                if not self.pubsub.subscribed:
                    gevent.sleep(0.05)
                    continue
                msg = self.pubsub.get_message(timeout=1.0)
                if lost:
                    # The connection came back and redis-py re-subscribed: fetch what
                    # was published while we were not listening.
                    lost = False
                    log.info("result subscriber reconnected; replaying missed results")
                    for session, route in list(self.routes.items()):
                        gevent.spawn(self._replay, session, route)
                backoff = 0.1
            except redis.RedisError as exc:
                lost = True
                log.warning("result subscriber lost redis, retrying in %.1fs: %s", backoff, exc)
                metrics.REDIS_ERRORS.inc()
                gevent.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            if msg and msg["type"] == "message":
                try:
                    self._deliver(msg["channel"].decode(), msg["data"].decode())
                except Exception:  # noqa: BLE001 - one bad message must not stop delivery
                    log.exception("could not deliver a result")

    def _deliver(self, channel: str, data: str) -> None:
        session = busmod.sid_from_channel(channel)
        route = self.routes.get(session)
        if route is None:
            return
        result_id, _, payload = data.partition(" ")
        if route.replaying:
            route.held.append((result_id, payload))
        else:
            self._send(session, route, result_id, payload)

    def _send(self, session: str, route: Route, result_id: str, payload: str) -> None:
        if route.last_id is not None and result_id_key(result_id) <= result_id_key(route.last_id):
            return
        route.last_id = result_id
        result = json.loads(payload)
        kind = result.get("type")
        to = {"to": route.socket_sid, "namespace": NAMESPACE}
        if kind == "end":
            self.socketio.emit("end", {"session": session, "id": result_id}, **to)
        elif kind == "error":
            self.socketio.emit("error", {"code": result["code"], "msg": result["msg"]}, **to)
        else:
            result["id"] = result_id
            self.socketio.emit("text", result, **to)


class Gateway:
    """Socket.IO handlers bound to one settings object and one Redis client."""

    def __init__(self, settings: Settings, socketio: SocketIO, client: redis.Redis,
                 relay_results: bool = True):
        self.settings = settings
        self.socketio = socketio
        self.bus = busmod.Bus(client, settings.stream_maxlen)
        self.writer = ChunkWriter(self.bus)
        self.relay = ResultRelay(client, self.bus, socketio, start=relay_results)
        self.connections: dict[str, Connection] = {}
        # Session modes the workers' engine offers (auth ``mode``); the first is the default.
        self.modes = ENGINE_MODES.get(settings.engine, (settings.engine,))

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
        on("*", namespace=NAMESPACE)(self.on_unknown_event)
        self.socketio.on_error(NAMESPACE)(self.on_handler_error)

    # ---- helpers ----------------------------------------------------------------------

    def _emit_error(self, err: CosyvoiceError, sid: str | None = None) -> None:
        self.socketio.emit("error", err.to_wire(), to=sid or request.sid, namespace=NAMESPACE)

    def _limits(self) -> dict:
        s = self.settings
        return {"max_chunk_ms": s.max_chunk_ms, "sample_rates": list(SUPPORTED_RATES),
                "grace_s": s.session_grace_s, "max_session_s": s.max_session_s,
                "rate_limit_factor": s.rate_limit_factor}

    def _bucket(self) -> TokenBucket | None:
        s = self.settings
        return TokenBucket(s.rate_limit_factor, s.rate_limit_burst_s) if s.rate_limit_factor > 0 else None

    # ---- handlers ---------------------------------------------------------------------

    def on_connect(self, auth=None):
        """Open or resume a session. A refusal is a Socket.IO connect error,
        ``{message, data}`` with the wire error (``{code, msg, ...}``) as ``data``.

        Everything the client must see after connecting is emitted by a greenlet that
        runs once the connect packet is out: events sent from inside this handler would
        precede it and be dropped by clients.
        """
        notices: list[CosyvoiceError] = []
        try:
            req = parse_auth(auth, self.modes)
            if self.settings.auth_secret:
                tokens.verify(self.settings.auth_secret, req.token, self.settings.token_ttl_s)
            conn = self._resume(req, notices) if req.session else None
            resumed = conn is not None
            if conn is None:
                conn = self._open(req)
        except CosyvoiceError as err:
            log.info("connection refused: %s", err.code, extra={"event": "refuse"})
            raise Refused(err.msg, err.to_wire()) from err
        except redis.RedisError as exc:
            log.warning("cannot open a session: %s", exc)
            metrics.REDIS_ERRORS.inc()
            err = Unavailable("the session store is unreachable")
            raise Refused(err.msg, err.to_wire()) from exc
        self.connections[request.sid] = conn
        gevent.spawn(self._welcome, request.sid, conn, resumed, notices)
        return True

    def _welcome(self, socket_sid: str, conn: Connection, resumed: bool,
                 notices: list[CosyvoiceError]) -> None:
        to = {"to": socket_sid, "namespace": NAMESPACE}
        for notice in notices:
            self.socketio.emit("error", notice.to_wire(), **to)
        self.socketio.emit("session", {
            "session": conn.session, "resumed": resumed, "next_seq": conn.next_seq,
            "sample_rate": conn.rate, "chunk_ms": CHUNK_MS, "mode": conn.mode,
            "limits": self._limits()}, **to)
        if resumed:
            try:
                self.relay.replay(conn.session)
            except redis.RedisError as exc:
                log.warning("replay of %s failed: %s", conn.session, exc)

    def _open(self, req: ConnectRequest) -> Connection:
        rate = req.sample_rate or self.settings.default_sample_rate
        mode = req.mode or self.modes[0]
        session = secrets.token_hex(12)
        client = request.remote_addr or ""
        if not self.bus.claim_client_slot(client, session, self.settings.max_sessions_per_client,
                                          self.settings.max_session_s + self.settings.session_grace_s):
            raise RateLimited(f"this address already holds "
                              f"{self.settings.max_sessions_per_client} sessions")
        try:
            self.bus.create_session(session, rate, conn=request.sid, client=client, mode=mode)
            admission = self.bus.admit(session)
        except redis.RedisError:
            self._discard(session, client)
            raise
        if not admission.admitted:
            self._discard(session, client)
            raise Overloaded("every ASR worker is busy; try again later",
                             retry_after_ms=self.settings.overload_retry_ms)
        # No result can come before the client's first chunk, which needs the session
        # event that follows this handler.
        try:
            self.relay.subscribe(session, request.sid)
        except redis.RedisError:
            self.relay.unsubscribe(session)
            self._discard(session, client)
            raise
        log.info("session opened", extra={"session": session, "event": "connect"})
        return Connection(session=session, rate=rate, conn_id=request.sid, client=client,
                          bucket=self._bucket(), mode=mode)

    def _discard(self, session: str, client: str) -> None:
        """Undo a session that is not going ahead (best effort: Redis may be down)."""
        try:
            self.bus.delete_session(session)
            self.bus.release_client_slot(client, session)
        except redis.RedisError as exc:
            log.warning("could not discard session %s: %s", session, exc)

    def _resume(self, req: ConnectRequest, notices: list) -> Connection | None:
        info = self.bus.resume_session(req.session, request.sid)
        if not info:
            # Past the grace period: say so, then carry on with a fresh session.
            notices.append(SessionExpired("the session expired; a new one was started"))
            return None
        conn = Connection(session=req.session, rate=int(info.get("rate", 16000)),
                          conn_id=request.sid, client=info.get("client", ""),
                          bucket=self._bucket(), next_seq=int(info.get("next_seq", 0)),
                          created=int(info.get("created_ms", 0)) / 1000 or time.time(),
                          mode=info.get("mode", self.modes[0]))
        self.bus.hold_client_slot(conn.client, conn.session,
                                  self.settings.max_session_s + self.settings.session_grace_s)
        self.relay.subscribe(conn.session, request.sid, after=req.last_result or "-")
        log.info("session resumed", extra={"session": conn.session, "event": "resume"})
        return conn

    def on_disconnect(self, reason=None):
        conn = self.connections.pop(request.sid, None)
        if conn is None:
            return
        try:
            self.relay.unsubscribe(conn.session, request.sid)
            if not conn.stopped:
                grace = self.settings.session_grace_s
                if self.bus.release_connection(conn.session, conn.conn_id, grace):
                    self.bus.hold_client_slot(conn.client, conn.session, grace)
        except redis.RedisError as exc:
            metrics.REDIS_ERRORS.inc()
            log.warning("disconnect cleanup of %s failed: %s", conn.session, exc)
        log.info("session disconnected", extra={"session": conn.session, "event": "disconnect"})

    @metrics.counts_chunks
    def on_audio_chunk(self, sid: str, data=None):
        """python-socketio handler (no Flask request context): the ack, or an error."""
        conn = self.connections.get(sid)
        try:
            if conn is None or conn.stopped:
                raise SessionExpired("this connection has no active session")
            chunk = decode_chunk(data, conn.rate, self.settings.max_chunk_ms)
            self._check_limits(conn, chunk)
            conn.rate = chunk.sample_rate
            return self._store(conn, chunk, data)
        except CosyvoiceError as err:
            self._emit_error(err, sid)
            ack = {"error": err.code}
            if err.seq is not None:
                ack["seq"] = err.seq
            return ack
        except Exception as exc:  # noqa: BLE001 - as on_handler_error for the other events
            log.error("handler failed", exc_info=exc)
            self._emit_error(Internal("internal error"), sid)
            return {"error": Internal.code}

    def _check_limits(self, conn: Connection, chunk: Chunk) -> None:
        duration = chunk.duration_s
        if conn.bucket is not None and not conn.bucket.take(duration):
            raise RateLimited("sending faster than the configured rate; resend later",
                              seq=chunk.seq)
        if time.time() - conn.created > self.settings.max_session_s:
            raise SessionExpired("the session reached its maximum length", seq=chunk.seq)

    def _store(self, conn: Connection, chunk: Chunk, pb: bytes) -> dict:
        try:
            reply = self.writer.append(conn.session, chunk, bytes(pb))
        except gevent.Timeout as exc:
            raise Unavailable("timed out storing the chunk", seq=chunk.seq) from exc
        if isinstance(reply, Exception):
            raise Unavailable("the session store is unreachable", seq=chunk.seq) from reply
        status = reply.status
        if status == busmod.AppendStatus.APPENDED:
            return {"seq": chunk.seq}
        if status == busmod.AppendStatus.DUPLICATE:
            return {"seq": chunk.seq, "duplicate": True}
        if status == busmod.AppendStatus.GAP:
            raise SeqGap(expected=reply.next_seq, got=chunk.seq)
        if status == busmod.AppendStatus.ENDED:
            raise BadChunk("the stream already ended with last=true", seq=chunk.seq)
        raise SessionExpired("the session no longer exists", seq=chunk.seq)

    def on_stop(self, data=None):
        conn = self.connections.get(request.sid)
        if conn is None or conn.stopped:
            return {"stopped": False}
        conn.stopped = True
        try:
            self.relay.unsubscribe(conn.session, request.sid)
            self.bus.delete_session(conn.session)
            self.bus.release_client_slot(conn.client, conn.session)
        except redis.RedisError as exc:
            conn.stopped = False
            metrics.REDIS_ERRORS.inc()
            self._emit_error(Unavailable("could not delete the session"))
            log.warning("stop of %s failed: %s", conn.session, exc)
            return {"stopped": False}
        log.info("session stopped", extra={"session": conn.session, "event": "stop"})
        return {"stopped": True, "session": conn.session}

    def on_unknown_event(self, event, *args):
        self._emit_error(BadChunk(f"unknown event {str(event)[:64]!r}"))
        return {"error": "bad_chunk"}

    def on_handler_error(self, exc):
        log.error("handler failed", exc_info=exc)
        self._emit_error(Internal("internal error"))


def create_app(settings: Settings | None = None, client: redis.Redis | None = None,
               relay_results: bool = True) -> Flask:
    """The gateway's Flask app; its SocketIO server is ``app.extensions['socketio']``.

    ``relay_results=False`` leaves the result subscriber unstarted (in-process tests,
    where no worker runs and a blocking subscriber would stall the unpatched thread).
    """
    settings = settings or Settings.from_env()
    fastws.install()
    app = Flask(__name__, static_folder=None)
    origins = [o.strip() for o in settings.allowed_origins.split(",") if o.strip()] or None
    socketio = SocketIO(
        app, async_mode="gevent", transports=["websocket"], always_connect=False,
        cors_allowed_origins=origins, max_http_buffer_size=max_payload_bytes(settings.max_chunk_ms) + 1024,
        ping_interval=25, ping_timeout=20,
        # Each connection's events run in order in its own reader greenlet instead of a
        # new greenlet per event: ~10 % less gateway CPU per chunk (docs/benchmarks.md).
        # The longest a handler waits is a Redis round trip, bounded by its timeout.
        async_handlers=False)
    client = client or busmod.connect(settings.redis_url or "redis://127.0.0.1:6379/0",
                                      settings.redis_max_connections)
    gateway = Gateway(settings, socketio, client, relay_results)
    gateway.register()
    if settings.trusted_proxies > 0:
        from werkzeug.middleware.proxy_fix import ProxyFix
        n = settings.trusted_proxies
        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=n, x_proto=n, x_host=n)
    app.extensions["cosyvoice"] = gateway
    probes.install(app, gateway)
    debug_mem.start("gateway")

    @app.after_request
    def security_headers(response):
        # The page needs nothing but its own origin (scripts, worklet, wss to itself);
        # nginx sends the same policy in front (deploy/nginx.conf).
        response.headers.setdefault("Content-Security-Policy", CONTENT_SECURITY_POLICY)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "no-referrer")
        response.headers.setdefault("Permissions-Policy", "microphone=(self), camera=(), geolocation=()")
        return response

    @app.get("/healthz")
    def healthz():
        return jsonify(status="ok")

    @app.get("/")
    def index():
        return send_from_directory(STATIC_DIR, "index.html")

    @app.get("/static/<path:name>")
    def static_files(name):
        return send_from_directory(STATIC_DIR, name)

    return app


_app_lock = threading.Lock()
_app: Flask | None = None


def __getattr__(name: str):
    # `cosyvoice.webui:app` for gunicorn: built on first access, from the environment.
    global _app
    if name == "app":
        with _app_lock:
            if _app is None:
                _app = create_app()
        return _app
    raise AttributeError(name)
