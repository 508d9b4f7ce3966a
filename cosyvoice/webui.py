"""The gateway's Flask app: the page, its assets, the probes and the Socket.IO server.

Run it under gunicorn's GeventWebSocketWorker (``cosyvoice.gateway.wshandler.Worker``)
(``gunicorn -c gunicorn.conf.py cosyvoice.webui:app``) or with ``cosyvoice gateway``;
either way gevent has patched the standard library before this module is imported. The
Socket.IO handlers are ``cosyvoice/gateway/core.py``'s; other faces (routes of their own over
the same sessions, with an output of their own: cosyvoice/gateway/outputs.py) are installed from
``FACES``, one line each.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import redis
from flask import Flask, jsonify, send_from_directory
from flask_socketio import SocketIO
from socketio import packet as socketio_packet

from . import debug_mem, openapi
from .faces.socketio import SocketIOFace
from .gateway import fastws, probes, wsframes
from .gateway.core import Gateway, session_limits
from .gateway.limits import MAX_AUTH_BYTES
from .settings import Settings
from .store import bus as busmod
from .wire.languages import WHISPER_LANGUAGES
from .wire.protocol import max_payload_bytes

log = logging.getLogger("cosyvoice.gateway")
STATIC_DIR = Path(__file__).parent / "static"
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; worker-src 'self'; media-src 'self'; object-src 'none'; "
    "base-uri 'self'; form-action 'self'; frame-ancestors 'none'")
# The faces beside Socket.IO, as "module:function": each function is called with the app
# and the gateway (its sessions, admission, limits, relay and metrics) and adds its
# routes: OpenAI's transcription and Realtime APIs (docs/openai.md), Deepgram's live and
# pre-recorded /v1/listen (docs/deepgram.md).
FACES: tuple[str, ...] = ("cosyvoice.faces.openai.transcriptions:install",
                          "cosyvoice.faces.openai.realtime:install",
                          "cosyvoice.faces.deepgram.listen:install")


def install_faces(app: Flask, gateway: Gateway, faces: Sequence[str]) -> None:
    for face in faces:
        module, _, function = face.partition(":")
        getattr(importlib.import_module(module), function)(app, gateway)


class MalformedPacket(ValueError):
    """A Socket.IO packet that does not parse."""


class CheckedPacket(socketio_packet.Packet):
    """python-socketio's packet, whose parse errors are ``MalformedPacket``: told apart from
    a handler's own errors, a client's garbage closes its connection with one log line
    (``guard_packets``) instead of an ERROR with a traceback for every bad packet."""

    def decode(self, encoded_packet):
        try:
            return super().decode(encoded_packet)
        except Exception as exc:  # noqa: BLE001 - whatever the parser tripped on
            raise MalformedPacket(f"{type(exc).__name__}: {exc}"[:200]) from None

    def add_attachment(self, attachment):
        try:
            return super().add_attachment(attachment)
        except Exception as exc:  # noqa: BLE001 - a placeholder that names nothing
            raise MalformedPacket(f"{type(exc).__name__}: {exc}"[:200]) from None


def guard_packets(server) -> None:
    """A malformed packet ends its connection (logged as a warning, once)."""
    eio = server.eio
    dispatch = eio.handlers["message"]

    def message(eio_sid, data):
        try:
            return dispatch(eio_sid, data)
        except ValueError as exc:
            # python-socketio's own word for a binary packet before the namespace's
            # connect; anything else is a handler's error and goes on up
            if not (isinstance(exc, MalformedPacket) or str(exc) == "Unexpected binary packet"):
                raise
            log.warning("malformed Socket.IO packet, connection closed: %s", exc)
            server._binary_packet.pop(eio_sid, None)
            eio.disconnect(eio_sid)
            return None

    eio.on("message", message)


def socketio_message_limit(settings: Settings) -> int:
    """The largest Socket.IO message (engine.io packet) the gateway reads: the largest chunk
    ``COSYVOICE_MAX_CHUNK_MS`` allows in its envelope, or the connect packet's auth, with
    room for the packet's own framing."""
    return max(max_payload_bytes(settings.max_chunk_ms), MAX_AUTH_BYTES) + 1024


def create_app(settings: Settings | None = None, client: redis.Redis | None = None,
               relay_results: bool = True, faces: Sequence[str] = FACES) -> Flask:
    """The gateway's Flask app; its SocketIO server is ``app.extensions['socketio']``.

    ``relay_results=False`` leaves the result subscriber unstarted (in-process tests,
    where no worker runs and a blocking subscriber would stall the unpatched thread).
    ``faces`` are installed beside Socket.IO (``FACES``).
    """
    settings = settings or Settings.from_env()
    fastws.install()
    wsframes.install()
    # Socket.IO's messages: the largest chunk in its envelope, or the connect packet's auth
    wsframes.MESSAGE_LIMITS["/socket.io/"] = socketio_message_limit(settings)
    wsframes.MESSAGE_LIMITS[""] = wsframes.DEFAULT_LIMIT  # any other path
    wsframes.PAYLOAD_TIMEOUT_S = settings.frame_timeout_s
    app = Flask(__name__, static_folder=None)
    origins = [o.strip() for o in settings.allowed_origins.split(",") if o.strip()] or None
    socketio = SocketIO(
        app, async_mode="gevent", transports=["websocket"], always_connect=False,
        cors_allowed_origins=origins,
        max_http_buffer_size=socketio_message_limit(settings),
        ping_interval=25, ping_timeout=20,
        # Each connection's events run in order in its own reader greenlet instead of a
        # new greenlet per event: ~10 % less gateway CPU per chunk (docs/benchmarks.md).
        # The longest a handler waits is a Redis round trip, bounded by its timeout.
        async_handlers=False, serializer=CheckedPacket)
    guard_packets(socketio.server)
    client = client or busmod.connect(settings.redis_url or "redis://127.0.0.1:6379/0",
                                      settings.redis_max_connections,
                                      cluster=settings.redis_cluster,
                                      ca_file=settings.redis_ca_file)
    gateway = Gateway(settings, socketio, client, relay_results)
    SocketIOFace(gateway).register()
    if settings.trusted_proxies > 0:
        from werkzeug.middleware.proxy_fix import ProxyFix
        n = settings.trusted_proxies
        # Flask's documented way to add WSGI middleware; mypy sees a method replaced.
        app.wsgi_app = ProxyFix(  # type: ignore[method-assign]
            app.wsgi_app, x_for=n, x_proto=n, x_host=n)
    app.extensions["cosyvoice"] = gateway
    probes.install(app, gateway)
    openapi.install(app, gateway)
    install_faces(app, gateway, faces)
    install_page(app, settings, gateway)
    debug_mem.start("gateway")
    return app


def install_page(app: Flask, settings: Settings, gateway: Gateway) -> None:
    """The browser page, its assets and configuration, and the headers every response
    carries."""

    @app.after_request
    def security_headers(response):
        # The page needs nothing but its own origin (scripts, worklet, wss to itself);
        # nginx sends the same policy in front (deploy/nginx.conf).
        response.headers.setdefault("Content-Security-Policy", CONTENT_SECURITY_POLICY)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "no-referrer")
        response.headers.setdefault("Permissions-Policy",
                                    "microphone=(self), camera=(), geolocation=()")
        return response

    @app.get("/healthz")
    def healthz():
        return jsonify(status="ok")

    @app.get("/config")
    def config():
        # what the page offers before a session: the session modes and languages (the
        # first of each is the default) and the limits its session event will repeat
        return jsonify(engine=settings.engine, modes=list(gateway.modes),
                       languages=[{"code": code, "name": WHISPER_LANGUAGES.get(code, "detect")}
                                  for code in gateway.languages],
                       limits=session_limits(settings))

    @app.get("/")
    def index():
        return send_from_directory(STATIC_DIR, "index.html")

    @app.get("/static/<path:name>")
    def static_files(name):
        return send_from_directory(STATIC_DIR, name)


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
