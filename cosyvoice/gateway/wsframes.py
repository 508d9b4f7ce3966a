"""Bounded WebSocket messages: a frame over its face's limit is refused before it is read.

gevent-websocket 0.10.1 reads a frame's whole payload (whatever its header announces, up to
2^63 bytes) before anything of ours sees it, and joins continuation frames without a bound:
one client announcing a 300 MB frame made the gateway read and keep 300 MB. ``install()``
makes every WebSocket the gateway accepts read its messages through ``read_message`` below
instead, which checks each frame's announced length, plus what the message already holds
(continuation frames count toward it), against the limit of the socket's path
(``MESSAGE_LIMITS``, filled by each face from its settings) before it reads the payload.
Over the limit, the client gets close 1009 (Message Too Big) with the limit in the reason,
nothing of the frame is read, and the face sees the connection end (``receive`` answers
None). A face that says more first registers ``ON_TOO_BIG`` in the request's environ (the
Deepgram face sends its ``Error`` message, the Realtime face its ``error`` event).

Control frames stay at RFC 6455's 125 bytes, as gevent-websocket already checks.

A frame's payload must also arrive in time: ``PAYLOAD_TIMEOUT_S`` (from
``COSYVOICE_FRAME_TIMEOUT_S``) plus a second per ``PAYLOAD_MIN_RATE`` bytes it announces.
A client that announces a frame and then stalls is closed 1008 and its connection shut
down, where it would otherwise hold a socket and a greenlet for as long as it liked.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from socket import error as socket_error

import gevent
from geventwebsocket.exceptions import ProtocolError, WebSocketError
from geventwebsocket.websocket import Header, WebSocket

from .wshandler import CLOSE_WAIT_S, close_ws, shut, shut_later

# path -> the most bytes one message may hold there (the longest matching prefix wins)
MESSAGE_LIMITS: dict[str, int] = {}
# the environ entry where a face leaves what it says before a 1009 (called with the limit)
ON_TOO_BIG = "cosyvoice.on_too_big"
CLOSE_TOO_BIG = 1009
# the lingering close after a refusal: at most this much more is read (and dropped)
LINGER_BYTES = 4 * 1024 * 1024
LINGER_S = 2.0
# a path no face names (nothing is served there; its upgrade is answered 404)
DEFAULT_LIMIT = 64 * 1024
# a frame's payload arrives within this many seconds (0: no limit; set by the gateway
# from COSYVOICE_FRAME_TIMEOUT_S) plus one per PAYLOAD_MIN_RATE bytes it announces
PAYLOAD_TIMEOUT_S = 30.0
PAYLOAD_MIN_RATE = 64 * 1024
CLOSE_POLICY = 1008

ORIGINAL_RECEIVE = WebSocket.receive
ORIGINAL_CLOSE = WebSocket.close


class MessageTooBig(WebSocketError):
    """A frame announced more than the message may hold; its payload was not read."""

    def __init__(self, limit: int):
        super().__init__(f"a message is at most {limit} bytes here")
        self.limit = limit


class PayloadStalled(Exception):
    """A frame's payload did not arrive in time (``PAYLOAD_TIMEOUT_S``); not a socket
    error, so the reads it interrupts do not take it for the peer's EOF."""

    def __init__(self, seconds: float):
        super().__init__(f"a frame's payload did not arrive within {seconds:.0f} s")


def limit_for(path: str | None) -> int:
    """The message limit of ``path``: its longest prefix in ``MESSAGE_LIMITS``, 0 for none."""
    best, limit = -1, 0
    for prefix, value in MESSAGE_LIMITS.items():
        if (path or "").startswith(prefix) and len(prefix) > best:
            best, limit = len(prefix), value
    return limit


def _payload(ws: WebSocket, header: Header) -> bytes | bytearray:
    if not header.length:
        return b""
    seconds = PAYLOAD_TIMEOUT_S + header.length / PAYLOAD_MIN_RATE
    try:
        with gevent.Timeout(seconds if PAYLOAD_TIMEOUT_S > 0 else None,
                            PayloadStalled(seconds)):
            payload = ws.raw_read(header.length)
    except socket_error:
        payload = b""
    if len(payload) != header.length:
        raise WebSocketError("Unexpected EOF reading frame payload")
    return header.unmask_payload(payload) if header.mask else payload


def _control(ws: WebSocket, header: Header) -> bool:
    """Handle a ping, pong or close frame; True for a close."""
    payload = _payload(ws, header)
    if header.opcode == ws.OPCODE_PING:
        ws.handle_ping(header, payload)
    elif header.opcode == ws.OPCODE_CLOSE:
        ws.handle_close(header, payload)
        return True
    return False


def _message_opcode(ws: WebSocket, opcode: int | None, f_opcode: int) -> int:
    """The opcode of the message a data frame belongs to (a first frame starts one)."""
    if f_opcode == ws.OPCODE_CONTINUATION:
        if not opcode:
            raise ProtocolError("Unexpected frame with opcode=0")
        return opcode
    if opcode:
        raise ProtocolError(f"The opcode in non-fin frame is expected to be zero, "
                            f"got {f_opcode!r}")
    ws.utf8validator.reset()
    ws.utf8validate_last = (True, True, 0, 0)
    return f_opcode


def read_message(ws: WebSocket):
    """gevent-websocket's ``read_message`` with the limit checked before each payload."""
    limit = limit_for(ws.path)  # (gevent-websocket's sockets have __slots__: no cache)
    opcode = None
    message = bytearray()
    while True:
        header = Header.decode_header(ws.stream)
        if header.flags:
            raise ProtocolError
        f_opcode = header.opcode
        if f_opcode in (ws.OPCODE_PING, ws.OPCODE_PONG, ws.OPCODE_CLOSE):
            if _control(ws, header):
                return None
            continue
        if f_opcode not in (ws.OPCODE_TEXT, ws.OPCODE_BINARY, ws.OPCODE_CONTINUATION):
            raise ProtocolError(f"Unexpected opcode={f_opcode!r}")
        if limit and len(message) + header.length > limit:
            raise MessageTooBig(limit)  # before a byte of its payload is read
        opcode = _message_opcode(ws, opcode, f_opcode)
        payload = _payload(ws, header)
        if opcode == ws.OPCODE_TEXT:
            ws.validate_utf8(payload)
        message += payload
        if header.fin:
            break
    if opcode == ws.OPCODE_TEXT:
        ws.validate_utf8(message)
        return ws._decode_bytes(message)
    return message


def receive(ws: WebSocket):
    """gevent-websocket's ``receive``; a message over the limit closes with 1009."""
    if ws.closed:
        return ORIGINAL_RECEIVE(ws)  # its own "already closed" answer
    try:
        return read_message(ws)
    except MessageTooBig as exc:
        refuse(ws, exc.limit)
    except PayloadStalled as exc:
        close_ws(ws, CLOSE_POLICY, str(exc))
        shut(ws.handler.socket)  # it is not reading: no lingering close
    except UnicodeError:
        ws.close(1007)
    except ProtocolError:
        ws.close(1002)
    except socket_error:
        ws.close()
        ws.current_app.on_close("Connection closed")
    return None


def refuse(ws: WebSocket, limit: int) -> None:
    """Tell the face (``ON_TOO_BIG``), then close with 1009 and the limit as the reason."""
    said: Callable[[int], None] | None = (ws.environ or {}).get(ON_TOO_BIG)
    if said is not None:
        try:
            said(limit)
        except Exception:  # noqa: BLE001 - the close below is what matters
            pass
    if not ws.closed:  # the face may have closed it itself, with its own reason
        close_ws(ws, CLOSE_TOO_BIG, f"message too big: at most {limit} bytes")
    try:
        linger(ws.handler.socket)
    except OSError:
        pass  # the peer is gone: nothing more to drop


def linger(sock, budget: int = LINGER_BYTES, seconds: float = LINGER_S) -> None:
    """A lingering close: no more from us (FIN after the close frame), and what the client
    still sends read and dropped, up to ``budget`` bytes or ``seconds``. A client in the
    middle of sending the frame we refused then reads our error and close frame; closing
    at once with its bytes unread would send a reset, and a reset makes its kernel drop
    them unread. Nothing read is kept: memory stays flat whatever the client sends."""
    sock.shutdown(socket.SHUT_WR)
    with gevent.Timeout(seconds, False):
        while budget > 0:
            data = sock.recv(min(64 * 1024, budget))
            if not data:
                return
            budget -= len(data)


def close(ws: WebSocket, code: int = 1000, message: bytes | str = b"") -> None:
    """gevent-websocket's ``close``, then the connection shut down unless the peer ends
    it within ``CLOSE_WAIT_S`` (engine.io closes a client that stopped answering its
    pings so, and the reader blocked on that client's socket returns)."""
    ORIGINAL_CLOSE(ws, code, message)
    shut_later(ws, CLOSE_WAIT_S)


def install() -> None:
    """Make every gevent-websocket socket of this process read bounded messages, and
    not outlive its close. Idempotent."""
    WebSocket.read_message = read_message
    WebSocket.receive = receive
    WebSocket.close = close


def installed() -> bool:
    return WebSocket.receive is receive
