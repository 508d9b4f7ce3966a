"""What the gateway holds for a client that sends too much (docs/security.md): a WebSocket
frame over its face's limit is refused with 1009 before its payload is read, and an HTTP
body over the upload limit is answered 413 as soon as the limit passes, chunked or not."""

from __future__ import annotations

import base64
import json
import select
import socket
import struct

import psutil
import pytest
import requests
import websocket

from cosyvoice.client import StreamingClient
from cosyvoice.gateway.wshandler import CLOSE_WAIT_S
from cosyvoice.settings import Settings
from cosyvoice.webui import socketio_message_limit

from .. import launcher
from ..helpers import TEST_ENV, ws_frame
from ..launcher import wait_for

pytestmark = pytest.mark.system

SETTINGS = Settings()
KB = 1024
FACES = {
    # path and query -> (limit, what the face says before its 1009: a JSON text or nothing)
    "/socket.io/?EIO=4&transport=websocket": socketio_message_limit(SETTINGS),
    "/v1/realtime?model=gpt-4o-transcribe&intent=transcription":
        SETTINGS.max_message_kb_realtime * KB,
    "/v1/listen?encoding=linear16&sample_rate=48000": SETTINGS.max_message_kb_listen * KB,
}
IDS = ["socketio", "realtime", "listen"]


def connect(service, path: str) -> websocket.WebSocket:
    ws = websocket.create_connection(service.url.replace("http", "ws", 1) + path, timeout=30)
    return ws


def send_raw(ws: websocket.WebSocket, data: bytes) -> None:
    """Bytes straight onto the connection, framed (or not) by the caller."""
    assert ws.sock is not None
    ws.sock.sendall(data)


def read_until_close(ws: websocket.WebSocket) -> tuple[list[str], int | None, str]:
    """The texts the server sent, then its close code and reason (None: no close frame)."""
    texts: list[str] = []
    while True:
        try:
            frame = ws.recv_frame()
        except (websocket.WebSocketConnectionClosedException, OSError):
            return texts, None, ""
        if frame.opcode == websocket.ABNF.OPCODE_CLOSE:
            data = frame.data
            code = struct.unpack("!H", data[:2])[0] if len(data) >= 2 else None
            return texts, code, data[2:].decode("utf-8", "replace")
        if frame.opcode == websocket.ABNF.OPCODE_TEXT:
            texts.append(frame.data.decode())


def rss_mb(service) -> float:
    return psutil.Process(service.gateway.proc.pid).memory_info().rss / 2**20


@pytest.mark.parametrize("path", list(FACES), ids=IDS)
def test_a_300_mb_frame_is_refused_with_1009_before_its_payload_is_read(service, path):
    limit = FACES[path]
    before = rss_mb(service)
    ws = connect(service, path)
    head = ws_frame(websocket.ABNF.OPCODE_BINARY, length=300 * 2**20)
    send_raw(ws, head)  # the header alone: a server that waits for the payload hangs
    texts, code, reason = read_until_close(ws)
    assert code == 1009, (code, reason, texts)
    assert str(limit) in reason or any(str(limit) in t for t in texts)
    if "listen" in path:  # Deepgram's client reads why from an Error message first
        error = json.loads(texts[-1])
        assert error["type"] == "Error" and error["code"] == "DATA-0001"
    if "realtime" in path:
        error = json.loads(texts[-1])
        assert error["type"] == "error" and error["error"]["code"] == "event_too_large"
    ws.close()
    # and a client that goes on sending: the gateway reads none of it
    ws = connect(service, path)
    send_raw(ws, head)
    sent = 0
    try:
        for _ in range(64):
            send_raw(ws, b"\0" * 2**20)
            sent += 2**20
    except OSError:
        pass  # the gateway closed the connection
    ws.close()
    assert rss_mb(service) - before < 32
    assert requests.get(service.url + "/healthz", timeout=10).ok


@pytest.mark.parametrize("path", list(FACES), ids=IDS)
def test_continuation_frames_count_toward_the_message(service, path):
    limit = FACES[path]
    ws = connect(service, path)
    half = limit // 2
    send_raw(ws, ws_frame(websocket.ABNF.OPCODE_BINARY, b"\0" * half, fin=False))
    head = ws_frame(websocket.ABNF.OPCODE_CONT, length=limit - half + 1)
    send_raw(ws, head)
    _texts, code, _reason = read_until_close(ws)
    assert code == 1009
    ws.close()


def test_a_realtime_event_of_exactly_the_limit_is_read(service):
    path = "/v1/realtime?model=gpt-4o-transcribe&intent=transcription"
    limit = FACES[path]
    ws = connect(service, path)
    assert json.loads(ws.recv())["type"] in ("session.created", "transcription_session.created")
    audio = base64.b64encode(b"\0" * ((limit - 100) // 4 * 3)).decode()
    event = json.dumps({"type": "input_audio_buffer.append", "audio": audio})
    event = event[:-1] + " " * (limit - len(event)) + "}"
    assert len(event.encode()) == limit
    ws.send(event)
    ws.send(json.dumps({"type": "input_audio_buffer.clear", "event_id": "after"}))
    seen: list[dict] = []
    while not any(e.get("type") == "input_audio_buffer.cleared" for e in seen):
        seen.append(json.loads(ws.recv()))
    assert not [e for e in seen if e.get("type") == "error"], seen
    ws.close()


def test_a_listen_frame_of_exactly_the_limit_is_read(service):
    path = "/v1/listen?encoding=linear16&sample_rate=48000"
    limit = FACES[path]
    ws = connect(service, path)
    ws.send_binary(b"\0" * limit)  # 10.9 s of 48 kHz silence
    ws.send(json.dumps({"type": "CloseStream"}))
    texts, code, _reason = read_until_close(ws)
    assert code == 1000, texts
    assert json.loads(texts[-1])["type"] == "Metadata"
    ws.close()


def test_the_largest_chunk_socketio_allows_is_read(service):
    client = StreamingClient(service.url, sample_rate=48000)
    try:
        client.connect()
        pcm = b"\0" * (48000 * 2 * SETTINGS.max_chunk_ms // 1000)
        ack = client.send(pcm, 0, last=True, wait_ack=True)
        wait_for(lambda: client.result.ended, timeout=60)
    finally:
        client.close()
    assert ack is not None and ack["seq"] == 0 and "error" not in ack, ack
    assert not client.result.errors


# ---- slow and silent clients -----------------------------------------------------------

FRAME_TIMEOUT_S = 1.0
REALTIME_IDLE_S = 2.0


@pytest.fixture(scope="module")
def impatient(service, redis_server, artifacts):
    """A second gateway beside ``service`` (its workers decode for both) with short
    frame and idle timeouts."""
    gw = launcher.start_gateway(redis_server.url, logs=artifacts, name="impatient", env={
        **TEST_ENV, "COSYVOICE_FRAME_TIMEOUT_S": str(FRAME_TIMEOUT_S),
        "COSYVOICE_REALTIME_IDLE_TIMEOUT_S": str(REALTIME_IDLE_S)})
    yield gw
    launcher.stop(gw.proc)


def cut_off(ws: websocket.WebSocket, timeout: float) -> bool:
    """True once the gateway ends the TCP connection (we never answer its close)."""
    assert ws.sock is not None
    ws.sock.settimeout(launcher.scaled(timeout))
    try:
        while ws.sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError:
        pass  # reset: ended too
    return True


@pytest.mark.parametrize("path", list(FACES), ids=IDS)
def test_a_frame_whose_payload_stalls_is_closed_1008_and_cut_off(impatient, path):
    """A client announces a frame, sends a little of it and stalls: the gateway closes
    with 1008 once the frame's time is up and ends the connection, instead of holding the
    socket and its reader for as long as the client likes."""
    ws = connect(impatient, path)
    send_raw(ws, ws_frame(websocket.ABNF.OPCODE_BINARY, length=1000) + b"\0" * 10)
    _texts, code, reason = read_until_close(ws)
    assert code == 1008, (code, reason)
    assert "did not arrive" in reason
    assert cut_off(ws, 10)
    ws.close()


def test_a_silent_realtime_client_gets_idle_timeout_and_is_cut_off(impatient):
    """No event for the idle timeout: an ``error`` ``idle_timeout`` and close 1000; a
    client that does not answer the close is cut off a few seconds later."""
    ws = connect(impatient, "/v1/realtime?intent=transcription")
    texts, code, _reason = read_until_close(ws)
    events = [json.loads(t) for t in texts]
    assert code == 1000, events
    assert [e["error"]["code"] for e in events if e["type"] == "error"] == ["idle_timeout"]
    assert cut_off(ws, 10 + CLOSE_WAIT_S)
    ws.close()


# ---- HTTP bodies --------------------------------------------------------------------------

UPLOAD = SETTINGS.max_upload_mb * 2**20
ROUTES = {"openai": ("/v1/audio/transcriptions",
                     "multipart/form-data; boundary=xyz"),
          "deepgram": ("/v1/listen", "audio/wav")}


def _request(service, route: str, content_type: str, headers: str) -> socket.socket:
    host, port = service.url.split("://", 1)[1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST {route} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\n"
                 f"{headers}\r\n".encode())
    return sock


def _status(sock: socket.socket) -> int:
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(4096)
        if not more:
            break
        data += more
    return int(data.split(b" ", 2)[1])


@pytest.mark.parametrize("face", list(ROUTES))
def test_a_body_announced_over_the_limit_is_refused_at_once(service, face):
    route, content_type = ROUTES[face]
    sock = _request(service, route, content_type, f"Content-Length: {200 * 2**20}\r\n")
    assert _status(sock) == 413  # nothing of the body was sent
    sock.close()


@pytest.mark.parametrize("face", list(ROUTES))
def test_a_chunked_body_is_refused_with_413_as_soon_as_it_passes_the_limit(service, face):
    route, content_type = ROUTES[face]
    sock = _request(service, route, content_type, "Transfer-Encoding: chunked\r\n")
    piece = b"\0" * 2**20
    chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"
    sent, answered_at = 0, None
    try:
        while sent < 200 * 2**20:
            sock.sendall(chunk)
            sent += len(piece)
            if select.select([sock], [], [], 0)[0]:
                answered_at = sent
                break
    except OSError:
        answered_at = sent  # the gateway answered and closed while we sent
    if answered_at is None:
        answered_at = sent
    assert _status(sock) == 413
    sock.close()
    # answered within a few MB past the limit (what the sockets' buffers hold), never the
    # whole 200 MB
    assert answered_at < UPLOAD + 16 * 2**20, (answered_at, UPLOAD)


@pytest.mark.parametrize("face", list(ROUTES))
@pytest.mark.parametrize("chunk", [b"zz\r\nabc\r\n", b"5\r\nabcdefgh\r\n0\r\n\r\n"],
                         ids=["non-hex size", "longer than its size"])
def test_a_malformed_chunked_body_is_a_400_not_a_500(service, face, chunk):
    # found by benchmarks/abuse.py: the body reader's error escaped the view as a 500
    route, content_type = ROUTES[face]
    sock = _request(service, route, content_type, "Transfer-Encoding: chunked\r\n")
    sock.sendall(chunk)
    assert _status(sock) == 400
    sock.close()
