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
from dataclasses import dataclass, field
from pathlib import Path

import gevent
import redis
from flask import Flask, jsonify, request, send_from_directory
from flask_socketio import SocketIO
from gevent.event import AsyncResult
from gevent.lock import Semaphore
from gevent.queue import Queue

from . import bus as busmod
from .errors import (BadChunk, CosyvoiceError, Internal, SeqGap, SessionExpired,
                     Unavailable)
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


@dataclass
class Connection:
    """One client connection's state; lives in the process that holds the socket."""

    session: str
    rate: int
    stopped: bool = False


class ChunkWriter:
    """Appends chunks to Redis from one greenlet, in arrival order, batched per round trip.

    Handlers of one connection may run concurrently, but each puts its chunk on this
    queue before it first yields, so chunks reach Redis in the order they arrived; the
    append script then checks each seq atomically.
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


class ResultRelay:
    """One Redis subscriber per gateway process, routing results to connections."""

    def __init__(self, client: redis.Redis, socketio: SocketIO, start: bool = True):
        self.socketio = socketio
        self.pubsub = client.pubsub(ignore_subscribe_messages=True)
        self.routes: dict[str, str] = {}  # session id -> socket sid
        self._lock = Semaphore()
        self._greenlet = gevent.spawn(self._run) if start else None

    def subscribe(self, session: str, socket_sid: str) -> None:
        self.routes[session] = socket_sid
        with self._lock:
            self.pubsub.subscribe(busmod.text_key(session))

    def unsubscribe(self, session: str) -> None:
        self.routes.pop(session, None)
        with self._lock:
            self.pubsub.unsubscribe(busmod.text_key(session))

    def _run(self) -> None:
        backoff = 0.1
        while True:
            try:
                if not self.pubsub.subscribed:
                    gevent.sleep(0.05)
                    continue
                msg = self.pubsub.get_message(timeout=1.0)
                backoff = 0.1
            except redis.RedisError as exc:
                log.warning("result subscriber lost redis, retrying in %.1fs: %s", backoff, exc)
                metrics.REDIS_ERRORS.inc()
                gevent.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            if msg and msg["type"] == "message":
                self._deliver(msg["channel"].decode(), msg["data"].decode())

    def _deliver(self, channel: str, data: str) -> None:
        session = busmod.sid_from_channel(channel)
        socket_sid = self.routes.get(session)
        if socket_sid is None:
            return
        result_id, _, payload = data.partition(" ")
        result = json.loads(payload)
        kind = result.get("type")
        if kind == "end":
            self.socketio.emit("end", {"session": session}, to=socket_sid, namespace=NAMESPACE)
            return
        if kind == "error":
            self.socketio.emit("error", {"code": result["code"], "msg": result["msg"]},
                               to=socket_sid, namespace=NAMESPACE)
            return
        result["id"] = result_id
        self.socketio.emit("text", result, to=socket_sid, namespace=NAMESPACE)


class Gateway:
    """Socket.IO handlers bound to one settings object and one Redis client."""

    def __init__(self, settings: Settings, socketio: SocketIO, client: redis.Redis,
                 relay_results: bool = True):
        self.settings = settings
        self.socketio = socketio
        self.bus = busmod.Bus(client, settings.stream_maxlen)
        self.writer = ChunkWriter(self.bus)
        self.relay = ResultRelay(client, socketio, start=relay_results)
        self.connections: dict[str, Connection] = {}

    def register(self) -> None:
        on = self.socketio.on
        on("connect", namespace=NAMESPACE)(self.on_connect)
        on("disconnect", namespace=NAMESPACE)(self.on_disconnect)
        on("audio_chunk", namespace=NAMESPACE)(self.on_audio_chunk)
        on("stop", namespace=NAMESPACE)(self.on_stop)
        self.socketio.on_error(NAMESPACE)(self.on_handler_error)

    # ---- helpers ----------------------------------------------------------------------

    def _emit_error(self, err: CosyvoiceError) -> None:
        self.socketio.emit("error", err.to_wire(), to=request.sid, namespace=NAMESPACE)

    def _limits(self) -> dict:
        s = self.settings
        return {"max_chunk_ms": s.max_chunk_ms, "sample_rates": list(SUPPORTED_RATES),
                "grace_s": s.session_grace_s}

    def pick_rate(self, auth: dict) -> int:
        rate = auth.get("sample_rate")
        if type(rate) is int and rate in SUPPORTED_RATES:
            return rate
        return self.settings.default_sample_rate

    # ---- handlers ---------------------------------------------------------------------

    def on_connect(self, auth=None):
        auth = auth if isinstance(auth, dict) else {}
        rate = self.pick_rate(auth)
        session = secrets.token_hex(12)
        try:
            self.relay.subscribe(session, request.sid)
            self.bus.create_session(session, rate)
        except redis.RedisError as exc:
            log.warning("cannot create session: %s", exc)
            self.relay.unsubscribe(session)
            self._emit_error(Unavailable("the session store is unreachable"))
            metrics.REDIS_ERRORS.inc()
            return False
        self.connections[request.sid] = Connection(session=session, rate=rate)
        log.info("session %s opened", session, extra={"session": session, "event": "connect"})
        self.socketio.emit("session", {
            "session": session, "resumed": False, "next_seq": 0, "sample_rate": rate,
            "chunk_ms": CHUNK_MS, "limits": self._limits()}, to=request.sid, namespace=NAMESPACE)
        return True

    def on_disconnect(self, reason=None):
        conn = self.connections.pop(request.sid, None)
        if conn is None:
            return
        try:
            self.relay.unsubscribe(conn.session)
            if not conn.stopped:
                self.bus.expire_session(conn.session, self.settings.session_grace_s)
        except redis.RedisError as exc:
            metrics.REDIS_ERRORS.inc()
            log.warning("disconnect cleanup of %s failed: %s", conn.session, exc)
        log.info("session %s disconnected", conn.session,
                 extra={"session": conn.session, "event": "disconnect"})

    @metrics.counts_chunks
    def on_audio_chunk(self, data=None):
        conn = self.connections.get(request.sid)
        try:
            if conn is None or conn.stopped:
                raise SessionExpired("this connection has no active session")
            chunk = decode_chunk(data, conn.rate, self.settings.max_chunk_ms)
            conn.rate = chunk.sample_rate
            return self._store(conn, chunk, data)
        except CosyvoiceError as err:
            self._emit_error(err)
            ack = {"error": err.code}
            if err.seq is not None:
                ack["seq"] = err.seq
            return ack

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
            self.relay.unsubscribe(conn.session)
            self.bus.delete_session(conn.session)
        except redis.RedisError as exc:
            conn.stopped = False
            metrics.REDIS_ERRORS.inc()
            self._emit_error(Unavailable("could not delete the session"))
            log.warning("stop of %s failed: %s", conn.session, exc)
            return {"stopped": False}
        log.info("session %s stopped", conn.session, extra={"session": conn.session, "event": "stop"})
        return {"stopped": True, "session": conn.session}

    def on_handler_error(self, exc):
        log.exception("handler failed", exc_info=exc)
        self._emit_error(Internal("internal error"))


def create_app(settings: Settings | None = None, client: redis.Redis | None = None,
               relay_results: bool = True) -> Flask:
    """The gateway's Flask app; its SocketIO server is ``app.extensions['socketio']``.

    ``relay_results=False`` leaves the result subscriber unstarted (in-process tests,
    where no worker runs and a blocking subscriber would stall the unpatched thread).
    """
    settings = settings or Settings.from_env()
    app = Flask(__name__, static_folder=None)
    origins = [o.strip() for o in settings.allowed_origins.split(",") if o.strip()] or None
    socketio = SocketIO(
        app, async_mode="gevent", transports=["websocket"], always_connect=True,
        cors_allowed_origins=origins, max_http_buffer_size=max_payload_bytes(settings.max_chunk_ms) + 1024,
        ping_interval=25, ping_timeout=20)
    client = client or busmod.connect(settings.redis_url or "redis://127.0.0.1:6379/0",
                                      settings.redis_max_connections)
    gateway = Gateway(settings, socketio, client, relay_results)
    gateway.register()
    app.extensions["cosyvoice"] = gateway
    probes.install(app, gateway)
    debug_mem.start("gateway")

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
