"""A Socket.IO client that streams a WAV file and collects live results.

Used by ``cosyvoice transcribe`` and by the tests; it speaks exactly the protocol a
browser does (WebSocket transport, namespace ``/ws``, protobuf chunks, acks).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import socketio

from .audio import split_chunks
from .protocol import encode_chunk

NAMESPACE = "/ws"


class TranscribeError(Exception):
    """The server sent an error event, or the stream did not end in time."""

    def __init__(self, code: str, msg: str):
        super().__init__(f"{code}: {msg}")
        self.code = code
        self.msg = msg


@dataclass
class Transcript:
    session: str = ""
    partials: list[dict] = field(default_factory=list)
    finals: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    acks: list[dict] = field(default_factory=list)
    ended: bool = False
    # Time (monotonic) each event arrived, for latency measurements.
    events: list[tuple[float, str, dict]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return " ".join(f["text"] for f in self.finals if f["text"]).strip()


class StreamingClient:
    """One connection, one session. Thread-safe callbacks fill ``self.result``."""

    def __init__(self, url: str, sample_rate: int = 16000,
                 on_event: Callable[[str, dict], None] | None = None,
                 headers: dict | None = None):
        self.url = url
        self.sample_rate = sample_rate
        self.on_event = on_event
        self.headers = headers or {}
        self.result = Transcript()
        self.sent_at: dict[int, float] = {}  # seq -> monotonic time it was sent
        self._session_ready = threading.Event()
        self._ended = threading.Event()
        self._errored = threading.Event()
        self._done = threading.Event()  # end or error
        self._inflight = threading.Semaphore(64)
        self.sio = socketio.Client(reconnection=False)
        self._bind()

    def _bind(self) -> None:
        ns = NAMESPACE

        @self.sio.on("session", namespace=ns)
        def on_session(data):
            self.result.session = data["session"]
            self._record("session", data)
            self._session_ready.set()

        @self.sio.on("text", namespace=ns)
        def on_text(data):
            (self.result.finals if data["type"] == "final" else self.result.partials).append(data)
            self._record("text", data)

        @self.sio.on("end", namespace=ns)
        def on_end(data):
            self.result.ended = True
            self._record("end", data)
            self._ended.set()
            self._done.set()

        @self.sio.on("error", namespace=ns)
        def on_error(data):
            self.result.errors.append(data)
            self._record("error", data)
            self._errored.set()
            self._done.set()

    def _record(self, event: str, data: dict) -> None:
        self.result.events.append((time.monotonic(), event, data))
        if self.on_event:
            self.on_event(event, data)

    def connect(self, auth: dict | None = None, timeout: float = 10.0) -> dict:
        auth = {"sample_rate": self.sample_rate, **(auth or {})}
        self.sio.connect(self.url, namespaces=[NAMESPACE], transports=["websocket"],
                         auth=auth, headers=self.headers, wait_timeout=timeout)
        if not self._session_ready.wait(timeout):
            raise TranscribeError("internal", "no session event after connect")
        return self.result.events[-1][2]

    def send(self, pcm: bytes, seq: int, last: bool = False, sample_rate: int = 0,
             wait_ack: bool = False, timeout: float = 10.0) -> dict | None:
        """Send one chunk; with ``wait_ack`` block until the server acks it."""
        payload = encode_chunk(pcm, seq, last=last, sample_rate=sample_rate,
                               sent_ms=int(time.time() * 1000))
        self.sent_at[seq] = time.monotonic()
        if wait_ack:
            return self.sio.call("audio_chunk", payload, namespace=NAMESPACE, timeout=timeout)
        self._inflight.acquire()

        def acked(*args):
            self._inflight.release()
            if args:
                self.result.acks.append(args[0])
                self._record("ack", args[0])

        self.sio.emit("audio_chunk", payload, namespace=NAMESPACE, callback=acked)
        return None

    def stream_pcm(self, pcm: bytes, rate: int, pace: str = "realtime") -> None:
        """Send the whole PCM as 200 ms chunks, the last one with ``last=true``."""
        chunks = split_chunks(pcm, rate)
        start = time.monotonic()
        for seq, piece in enumerate(chunks):
            if pace == "realtime":
                delay = start + seq * 0.2 - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            if self._errored.is_set():
                return
            self.send(piece, seq, last=seq == len(chunks) - 1,
                      sample_rate=rate if seq == 0 else 0)

    def wait_end(self, timeout: float = 30.0) -> bool:
        """Wait for ``end`` (or an error); True when the stream ended."""
        self._done.wait(timeout)
        return self._ended.is_set()

    def stop(self) -> dict | None:
        try:
            return self.sio.call("stop", namespace=NAMESPACE, timeout=5)
        except socketio.exceptions.TimeoutError:
            return None

    def close(self) -> None:
        if self.sio.connected:
            self.sio.disconnect()


def transcribe_pcm(url: str, pcm: bytes, rate: int, pace: str = "realtime",
                   on_event: Callable[[str, dict], None] | None = None,
                   timeout: float = 60.0, stop: bool = True) -> Transcript:
    """Stream ``pcm`` through the service and return every result it sent."""
    client = StreamingClient(url, rate, on_event=on_event)
    try:
        client.connect()
        client.stream_pcm(pcm, rate, pace)
        if not client.wait_end(timeout) and not client.result.errors:
            raise TranscribeError("internal", f"no end event within {timeout:.0f}s")
        if stop:
            client.stop()
    finally:
        client.close()
    return client.result
