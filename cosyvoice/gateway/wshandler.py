"""The gateway's WebSocket handler: gevent-websocket's, with a check before the upgrade.

gevent-websocket answers every ``GET`` with ``Upgrade: websocket`` with its 101 before the
Flask app runs, so a raw-WebSocket face (OpenAI's ``/v1/realtime``) could refuse a bad key
only after the upgrade, where clients expect an HTTP status (the ``openai`` client raises
its ``AuthenticationError`` on a 401 at the handshake). ``Handler`` first asks the check
registered for the request's path (``PRECHECKS``, filled by the faces when they are
installed): a refusal is answered as an HTTP response and nothing is upgraded. It also
echoes a WebSocket subprotocol the face accepts (``SUBPROTOCOLS``), as browsers require.

gunicorn runs it through ``Worker`` (gunicorn.conf.py), ``cosyvoice gateway`` directly.
Socket.IO's own upgrades (``/socket.io/``) have no check and go on as before.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import gevent
from geventwebsocket.gunicorn.workers import GeventWebSocketWorker
from geventwebsocket.handler import WebSocketHandler

# A refusal: (status line, headers, body).
Refusal = tuple[str, list[tuple[str, str]], bytes]
# path -> check of the request's WSGI environ: None lets the upgrade go on
PRECHECKS: dict[str, Callable[[dict], Refusal | None]] = {}
# path -> the subprotocols the face takes, in order of preference
SUBPROTOCOLS: dict[str, tuple[str, ...]] = {}
# the environ entry where a check leaves what undoes it if the upgrade fails after all
ABANDON = "cosyvoice.abandon"
# and the headers it adds to the upgrade's 101 response
UPGRADE_HEADERS = "cosyvoice.upgrade_headers"
# After our close frame, how long the peer has to close the connection before we do
CLOSE_WAIT_S = 5.0


def close_ws(ws: Any, code: int, reason: str = "") -> None:
    """Close a gevent-websocket socket with ``code`` and ``reason`` (its own ``close``
    sends the reason without the code)."""
    if ws is None or ws.closed:
        return
    payload = struct.pack("!H", code) + reason.encode("utf-8")[:123]
    try:
        ws.send_frame(payload, opcode=ws.OPCODE_CLOSE)
    except Exception:  # noqa: BLE001 - the peer is gone: nothing to tell it
        pass
    finally:
        ws.closed = True
        shut_later(ws, CLOSE_WAIT_S)


def shut_later(ws: Any, seconds: float) -> None:
    """Shut the connection down in ``seconds`` unless it is closed by then: a peer that
    does not answer our close frame (or stalls mid-frame) would otherwise hold the socket
    and its reader, blocked on a read, for as long as it likes (RFC 6455 7.1.1: the server
    closes the TCP connection)."""
    sock = getattr(getattr(ws, "handler", None), "socket", None)
    if sock is not None:
        gevent.spawn_later(seconds, shut, sock)


def watch_idle(timeout: float, quiet_since: Callable[[], float | None],
               closed: Callable[[], bool], on_idle: Callable[[], None]) -> None:
    """A raw WebSocket face's idle timer, run as the connection's greenlet: ``on_idle()``
    once the client has been quiet for more than ``timeout`` seconds since
    ``quiet_since()`` (monotonic; None: not counting now); it ends when ``closed()``.
    ``timeout`` 0: never."""
    if timeout <= 0:
        return
    while not closed():
        gevent.sleep(min(0.5, timeout / 4))
        since = quiet_since()
        if since is not None and time.monotonic() - since > timeout:
            on_idle()
            return


def shut(sock: Any) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # a blocked read returns: the handler ends
    except OSError:
        pass  # closed already


class Handler(WebSocketHandler):
    def upgrade_websocket(self):
        if self._is_upgrade():
            check = PRECHECKS.get(self.environ.get("PATH_INFO", ""))
            refused = check(self.environ) if check is not None else None
            if refused is not None:
                status, headers, body = refused
                self.start_response(status, [*headers, ("Content-Length", str(len(body)))])
                return [body]
        failed = super().upgrade_websocket()
        abandon = self.environ.pop(ABANDON, None)
        if failed is not None and abandon is not None:
            abandon()  # what the check opened for a connection that is not coming
        return failed

    def _is_upgrade(self) -> bool:
        return (self.environ.get("REQUEST_METHOD") == "GET"
                and self.environ.get("HTTP_UPGRADE", "").lower() == "websocket")

    def upgrade_connection(self):
        # gevent-websocket echoes a subprotocol only through the application's
        # ``app_protocol``; the faces name theirs here instead (and a check's headers).
        offered = [p.strip() for p in
                   self.environ.get("HTTP_SEC_WEBSOCKET_PROTOCOL", "").split(",") if p.strip()]
        taken = next((p for p in SUBPROTOCOLS.get(self.environ.get("PATH_INFO", ""), ())
                      if p in offered), None)
        extra = list(self.environ.get(UPGRADE_HEADERS, ()))
        if taken is not None:
            extra.append(("Sec-WebSocket-Protocol", taken))
        if not extra:
            return super().upgrade_connection()
        handler: Any = self  # gevent-websocket's attributes are untyped
        start_response = handler.start_response

        def with_protocol(status, headers, exc_info=None):
            if status.startswith("101"):
                headers = [*headers, *extra]
            return start_response(status, headers, exc_info)

        handler.start_response = with_protocol
        try:
            return super().upgrade_connection()
        finally:
            handler.start_response = start_response


class Worker(GeventWebSocketWorker):
    """gunicorn's gevent WebSocket worker with ``Handler``."""
    wsgi_handler = Handler
