"""A lean load generator: many real-time audio streams from one asyncio event loop.

Each stream is one Socket.IO 5 / Engine.IO 4 client speaking raw RFC 6455 WebSocket
frames over an asyncio ``Protocol`` (no client library, no thread, no task per stream):
it connects to namespace ``/ws``, sends one 200 ms protobuf chunk of real speech every
200 ms as a binary event with an ack, answers pings, and timestamps acks and partial
results. Hundreds of streams cost the generator a fraction of one core, which it
reports about itself (CPU time and how late its timers fired), so a run can show that
the load generator was not the bottleneck.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import struct
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field

from cosyvoice.gateway.fastws import xor_mask
from cosyvoice.wire.protocol import chunk_bytes, encode_chunk

NAMESPACE = "/ws"
CHUNK_S = 0.2
_OP_TEXT, _OP_BINARY, _OP_CLOSE, _OP_PING, _OP_PONG = 1, 2, 8, 9, 10
_EVENT_PREFIX = "42" + NAMESPACE + ","
_ACK_PREFIX = "43" + NAMESPACE + ","
_CONNECT_PREFIX = "40" + NAMESPACE + ","
_REFUSED_PREFIX = "44" + NAMESPACE + ","


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


class ChunkSource:
    """Real speech cut into 200 ms chunks, encoded as ``AudioChunkProto`` per send.

    The PCM field of each chunk is serialised once; ``seq`` and ``sent_ms`` are appended
    per send in the same field order betterproto uses, which ``__init__`` checks against
    ``cosyvoice.protocol.encode_chunk``.
    """

    def __init__(self, pcm: bytes, rate: int = 16000):
        size = chunk_bytes(rate)
        pcm = pcm[: len(pcm) // size * size]
        if not pcm:
            raise ValueError("need at least one full chunk of audio")
        self.rate = rate
        self.heads = [encode_chunk(pcm[i:i + size], 0) for i in range(0, len(pcm), size)]
        self._rate_field = b"\x20" + _varint(rate)
        for seq, sent_ms in ((0, 0), (1, 1), (300, 1_700_000_000_000), (2**20, 5)):
            k = seq % len(self.heads)
            for first in (False, True):
                mine = self.chunk(seq, sent_ms, first=first)
                theirs = encode_chunk(pcm[k * size:(k + 1) * size], seq, sent_ms=sent_ms,
                                      sample_rate=rate if first else 0)
                assert mine == theirs, "ChunkSource encodes differently from encode_chunk"

    def chunk(self, seq: int, sent_ms: int, first: bool = False) -> bytes:
        head = self.heads[seq % len(self.heads)]
        parts = [head]
        if seq:
            parts.append(b"\x10" + _varint(seq))
        if first:
            parts.append(self._rate_field)
        if sent_ms:
            parts.append(b"\x28" + _varint(sent_ms))
        return b"".join(parts)


def ws_frame(opcode: int, payload: bytes) -> bytes:
    """One masked client frame (FIN set)."""
    n = len(payload)
    if n < 126:
        header = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
    elif n < 65536:
        header = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
    else:
        header = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
    mask = os.urandom(4)
    return header + mask + bytes(xor_mask(payload, mask, n))


@dataclass
class Measures:
    """What the streams saw while ``recording`` was on."""

    ack_ms: array = field(default_factory=lambda: array("d"))
    partial_ms: array = field(default_factory=lambda: array("d"))
    # from the send of the chunk holding a final's end to the final (benchmarks/engines.py's)
    final_ms: array = field(default_factory=lambda: array("d"))
    sent: int = 0
    acked: int = 0
    errors: Counter = field(default_factory=Counter)
    timer_lag_ms: array = field(default_factory=lambda: array("d"))


class Stream(asyncio.Protocol):
    """One client connection and its session."""

    def __init__(self, gen: "LoadGenerator", index: int):
        self.gen = gen
        self.index = index
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.upgraded = False
        self.connected = asyncio.get_running_loop().create_future()
        self.closed = asyncio.get_running_loop().create_future()
        self.seq = 0
        self.next_ack = 0
        self.pending: dict[int, tuple[float, bool]] = {}  # ack id -> (sent at, recorded)
        self.sent_at: dict[int, float] = {}  # seq -> sent at, for partials (recorded only)
        self.chunk_at: dict[int, float] = {}  # seq -> sent at, for finals (recorded only)
        self.stop_ack: int | None = None
        self.stopped = asyncio.get_running_loop().create_future()
        self.sending = False
        self.timer: asyncio.TimerHandle | None = None

    # ---- transport ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)  # a stream connection's
        self.transport = transport
        key = base64.b64encode(os.urandom(16)).decode()
        host = self.gen.host
        transport.write(
            (f"GET /socket.io/?EIO=4&transport=websocket HTTP/1.1\r\nHost: {host}\r\n"
             f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
             f"Sec-WebSocket-Version: 13\r\nOrigin: http://{host}\r\n\r\n").encode())

    def connection_lost(self, exc: Exception | None) -> None:
        self.sending = False
        if self.timer:
            self.timer.cancel()
        for fut in (self.connected, self.stopped):
            if not fut.done():
                fut.set_result(False)
        if not self.closed.done():
            self.closed.set_result(True)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if not self.upgraded:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            if not buf.startswith(b"HTTP/1.1 101"):
                self.gen.measures.errors["handshake"] += 1
                self._connection().close()
                return
            del buf[:end + 4]
            self.upgraded = True
        pos = 0
        n = len(buf)
        while n - pos >= 2:
            b0, b1 = buf[pos], buf[pos + 1]
            length = b1 & 0x7F
            start = pos + 2
            if length == 126:
                if n - start < 2:
                    break
                length = int.from_bytes(buf[start:start + 2], "big")
                start += 2
            elif length == 127:
                if n - start < 8:
                    break
                length = int.from_bytes(buf[start:start + 8], "big")
                start += 8
            if n - start < length:
                break
            self._frame(b0 & 0x0F, bytes(buf[start:start + length]))
            pos = start + length
        if pos:
            del buf[:pos]

    def _connection(self) -> asyncio.Transport:
        """The transport: every callback but ``connection_made`` comes after it is set."""
        transport = self.transport
        assert transport is not None
        return transport

    def _frame(self, opcode: int, payload: bytes) -> None:
        if opcode == _OP_TEXT:
            self._packet(payload.decode())
        elif opcode == _OP_PING:
            self._connection().write(ws_frame(_OP_PONG, payload))
        elif opcode == _OP_CLOSE:
            self._connection().close()

    def _send_text(self, text: str) -> None:
        self._connection().write(ws_frame(_OP_TEXT, text.encode()))

    # ---- Engine.IO / Socket.IO ----------------------------------------------------------

    def _packet(self, text: str) -> None:
        kind = text[0]
        if kind == "4":
            self._sio(text[1:])
        elif kind == "2":
            self._send_text("3" + text[1:])
        elif kind == "0":
            self._send_text(_CONNECT_PREFIX + json.dumps(self.gen.auth))

    def _sio(self, text: str) -> None:
        now = time.monotonic()
        if text.startswith(_ACK_PREFIX[1:]):
            self._on_ack(text[len(_ACK_PREFIX) - 1:], now)
        elif text.startswith(_EVENT_PREFIX[1:]):
            self._on_event(text[len(_EVENT_PREFIX) - 1:], now)
        elif text.startswith(_CONNECT_PREFIX[1:]):
            if not self.connected.done():
                self.connected.set_result(True)
        elif text.startswith(_REFUSED_PREFIX[1:]):
            self._on_refused(text[len(_REFUSED_PREFIX) - 1:])

    def _on_ack(self, body: str, now: float) -> None:
        """``<id>[args]``: a chunk's ack, or the ack of ``stop``."""
        digits = 0
        while body[digits].isdigit():
            digits += 1
        ack_id = int(body[:digits])
        if ack_id == self.stop_ack:
            self.stopped.set_result(True)
            return
        sent = self.pending.pop(ack_id, None)
        if '"error"' in body:
            self.gen.measures.errors["ack " + json.loads(body[digits:])[0]["error"]] += 1
        elif sent is not None and sent[1]:
            m = self.gen.measures
            m.acked += 1
            m.ack_ms.append((now - sent[0]) * 1000)

    def _on_event(self, body: str, now: float) -> None:
        name, data = json.loads(body)[:2]
        if name == "text":
            sent = self.sent_at.pop(data.get("seq"), None)
            if sent is not None and data.get("type") == "partial":
                self.gen.measures.partial_ms.append((now - sent) * 1000)
            elif data.get("type") == "final" and "end" in data:
                end_chunk = max(0, math.ceil(data["end"] / CHUNK_S) - 1)
                at = self.chunk_at.get(end_chunk)
                if at is not None:
                    self.gen.measures.final_ms.append((now - at) * 1000)
                for k in [k for k in self.chunk_at if k <= end_chunk]:
                    del self.chunk_at[k]
        elif name == "error":
            self.gen.measures.errors[data.get("code", "?")] += 1

    def _on_refused(self, body: str) -> None:
        """A connect error, ``{message, data: wire error}``."""
        info = json.loads(body)
        code = (info.get("data") or {}).get("code", "refused")
        self.gen.measures.errors["connect " + code] += 1
        if not self.connected.done():
            self.connected.set_result(False)

    # ---- sending ------------------------------------------------------------------------

    def start(self, first_at: float) -> None:
        self.sending = True
        self.timer = self.gen.loop.call_at(first_at, self._tick, first_at)

    def _tick(self, due: float) -> None:
        transport = self._connection()
        if not self.sending or transport.is_closing():
            return
        gen = self.gen
        now = time.monotonic()
        recording = gen.recording
        if recording:
            gen.measures.timer_lag_ms.append((now - due) * 1000)
        seq = self.seq
        self.seq += 1
        ack_id = self.next_ack
        self.next_ack += 1
        payload = gen.source.chunk(seq, int(time.time() * 1000), first=seq == 0)
        event = (f'451-{NAMESPACE},{ack_id}["audio_chunk",'
                 '{"_placeholder":true,"num":0}]').encode()
        transport.write(ws_frame(_OP_TEXT, event) + ws_frame(_OP_BINARY, payload))
        self.pending[ack_id] = (now, recording)
        if recording:
            gen.measures.sent += 1
            self.sent_at[seq] = now
            self.chunk_at[seq] = now
        self.timer = gen.loop.call_at(due + CHUNK_S, self._tick, due + CHUNK_S)

    def halt(self) -> None:
        self.sending = False
        if self.timer:
            self.timer.cancel()

    def unacked_recorded(self) -> int:
        return sum(1 for _t, recorded in self.pending.values() if recorded)

    def send_stop(self) -> None:
        if self.transport and not self.transport.is_closing():
            self.stop_ack = self.next_ack
            self.next_ack += 1
            self._send_text(f"42{NAMESPACE},{self.stop_ack}[\"stop\"]")


class LoadGenerator:
    """Opens, drives and closes a set of streams against one server."""

    def __init__(self, host: str, port: int, source: ChunkSource, auth: dict | None = None):
        self.host = f"{host}:{port}"
        self.addr = (host, port)
        self.source = source
        self.auth = auth or {"sample_rate": source.rate}
        self.streams: list[Stream] = []
        self.measures = Measures()
        self.recording = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop ``open`` ran in, which runs every stream."""
        if self._loop is None:
            raise RuntimeError("no streams opened yet")
        return self._loop

    async def open(self, n: int, per_second: float = 200.0, timeout: float = 30.0) -> int:
        """Open ``n`` connections, at most ``per_second`` a second; returns how many
        connected to the namespace."""
        self._loop = asyncio.get_running_loop()
        tasks = []
        for i in range(n):
            tasks.append(asyncio.ensure_future(self._open_one(i, timeout)))
            await asyncio.sleep(1 / per_second)
        results = await asyncio.gather(*tasks)
        return sum(results)

    async def _open_one(self, index: int, timeout: float) -> bool:
        try:
            _t, stream = await asyncio.wait_for(
                self.loop.create_connection(lambda: Stream(self, index), *self.addr), timeout)
            ok = await asyncio.wait_for(stream.connected, timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            self.measures.errors["connect " + type(exc).__name__] += 1
            return False
        if ok:
            self.streams.append(stream)
        return ok

    def start(self) -> None:
        """Start every stream, their 200 ms phases spread evenly over one period."""
        t0 = self.loop.time() + 0.05
        n = max(1, len(self.streams))
        for i, stream in enumerate(self.streams):
            stream.start(t0 + CHUNK_S * i / n)

    def record(self, on: bool) -> None:
        """Chunks sent from now on count (``on``), or no longer count."""
        if on:
            self.measures = Measures()
        self.recording = on

    async def halt(self, drain_s: float = 5.0) -> int:
        """Stop sending, wait up to ``drain_s`` for outstanding acks; returns how many
        recorded chunks were never acknowledged."""
        for s in self.streams:
            s.halt()
        deadline = self.loop.time() + drain_s
        while self.loop.time() < deadline and any(s.unacked_recorded() for s in self.streams):
            await asyncio.sleep(0.05)
        return sum(s.unacked_recorded() for s in self.streams)

    async def close(self, stop: bool = True, timeout: float = 10.0) -> None:
        """Send ``stop`` on every stream (the service deletes the session), then close."""
        if stop:
            for s in self.streams:
                s.send_stop()
            waits = [s.stopped for s in self.streams if s.stop_ack is not None]
            if waits:
                await asyncio.wait(waits, timeout=timeout)
        for s in self.streams:
            if s.transport:
                s.transport.close()
        if self.streams:
            await asyncio.wait([s.closed for s in self.streams], timeout=timeout)
        self.streams = []
