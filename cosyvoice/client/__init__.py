"""A Socket.IO client that streams audio and collects live results.

Used by ``cosyvoice transcribe``, the benchmarks and the tests; it speaks exactly the
protocol a browser does (WebSocket transport, namespace ``/ws``, protobuf chunks, acks)
and survives what a real network does to it:

* a dropped connection is re-established (Socket.IO reconnection) with
  ``auth.session`` and ``auth.last_result``; the server says which chunk it needs next
  (``next_seq``) and replays the results the client missed;
* ``unavailable`` (Redis down), ``rate_limited`` and ``seq_gap`` rewind to the chunk the
  server needs and resend after a pause;
* ``overloaded`` at connect is retried after the server's hint, a few times.

``window`` holds the send rule (``SendWindow``), ``transcript`` what a session received
(``Transcript``), ``reach`` the errors of a service that cannot be reached or refuses, and
why (``diagnose``); their names are this package's too.
"""

from __future__ import annotations

__all__ = ["MAX_IN_FLIGHT", "RECOVERED", "RETRYABLE", "Refused", "SendWindow",
           "StreamingClient", "TranscribeError", "Transcript", "Unreachable", "check_url",
           "diagnose", "transcribe_pcm"]

import threading
import time
from collections.abc import Mapping
from typing import Any, Callable, cast

import socketio

from ..text.speakers import apply_relabel
from ..wire import codecs
from ..wire.audio import split_chunks
from ..wire.codecs import resample
from ..wire.messages import EndEvent, ErrorEvent, TextEvent
from ..wire.protocol import NAMESPACE, encode_chunk, encode_opus_chunk
from .reach import Refused, TranscribeError, Unreachable, check_url, diagnose
from .transcript import RECOVERED, RETRYABLE, Transcript
from .window import MAX_IN_FLIGHT, SendWindow

# Chunks in flight for a client that follows switches (``abr``), beyond those its path's
# own round trip holds: about a second, so the network's queue stays short and what waits
# is sent at the rung in use when it goes.
ABR_IN_FLIGHT = 5
RETRY_PAUSE_S = 0.5


class StreamingClient:
    """One session over one (re)connecting Socket.IO client."""

    def __init__(self, url: str, sample_rate: int = 16000,
                 on_event: Callable[[str, Mapping[str, Any]], None] | None = None,
                 headers: dict | None = None, reconnect: bool = True, token: str | None = None,
                 ssl_verify: bool = True, mode: str | None = None, codec: str | None = None,
                 bitrate: int = 0, abr: bool = False, language: str | None = None,
                 script: str | None = None, format: bool = False, prompt: str | None = None,
                 interim: bool = True, endpoint_ms: int | None = None,
                 speech_events: bool = False, diarize: bool | str = False,
                 speakers: int | None = None, min_speakers: int | None = None,
                 max_speakers: int | None = None):
        self.url = url
        self.mode = mode
        # the session's language ("auto" or a code), Chinese script, formatting and prompt,
        # turn control, speaker labels (True/"live", or "file": with each piece's vector)
        self.options: dict[str, str | bool | int] = {
            k: v for k, v in (("language", language), ("script", script), ("format", format),
                              ("prompt", prompt), ("endpoint_ms", endpoint_ms),
                              ("speech_events", speech_events), ("diarize", diarize),
                              ("speakers", speakers), ("min_speakers", min_speakers),
                              ("max_speakers", max_speakers))
            if v}
        if not interim:  # turn control: finals only
            self.options["interim"] = False
        # codecs.OPUS: the audio goes as Opus packets at ``bitrate`` (0: the server's first).
        # None: PCM, or with ``abr`` the rung the server starts the session on.
        self.asked_codec = codec
        self.codec = codec or codecs.PCM16
        self.bitrate = bitrate
        # ``abr``: follow the server's switch_down and switch_up (auth.abr)
        self.abr = abr
        self.sample_rate = sample_rate
        self.on_event = on_event
        self.headers = headers or {}
        self.token = token
        self.result = Transcript()
        self.sent_at: dict[int, float] = {}  # seq -> monotonic time it was last sent
        self.session_info: dict = {}
        self._last_result: str | None = None
        self._final_utterances: set[int] = set()
        self._lock = threading.Condition()  # re-entrant: on_event may call back in
        self._ready = threading.Event()  # connected with a session
        self._done = threading.Event()  # end, or a fatal error
        self._refused = threading.Event()  # the last connection attempt was refused
        self._connect_failure = ""  # why the last attempt failed below the protocol
        self._connect_started: float | None = None  # when connect() began its attempt
        self._ssl_verify = ssl_verify
        # Every handler runs on one of python-engineio's threads: ``result``, ``sent_at``,
        # ``window`` (the send rule) and the private state change only under ``_lock``.
        self.window = self._new_window()
        self._sio_args = {"reconnection": reconnect, "reconnection_attempts": 5,
                          "reconnection_delay": 1, "reconnection_delay_max": 2,
                          "ssl_verify": ssl_verify}
        self._new_sio()

    def _new_sio(self) -> None:
        self.sio = socketio.Client(**self._sio_args)
        self._bind()

    # ---- events -------------------------------------------------------------------------

    def _auth(self) -> dict:
        auth: dict[str, int | str | bool] = {"sample_rate": self.sample_rate, **self.options}
        if self.token:
            auth["token"] = self.token
        if self.mode:
            auth["mode"] = self.mode
        if self.asked_codec and self.asked_codec != codecs.PCM16:
            auth["codec"] = self.asked_codec
            if self.bitrate:
                auth["bitrate"] = self.bitrate
        elif self.asked_codec and self.abr:
            auth["codec"] = self.asked_codec
        if self.abr:
            auth["abr"] = True
        if self.result.session:
            auth["session"] = self.result.session
            if self._last_result:
                auth["last_result"] = self._last_result
        return auth

    def _bind(self) -> None:
        handlers = {"session": self._on_session, "text": self._on_text, "end": self._on_end,
                    "error": self._on_error, "connect_error": self._on_connect_error,
                    "disconnect": self._on_disconnect,
                    "speech_started": self._on_speech_started,
                    "finalized": self._on_finalized,
                    "relabel": self._on_relabel,
                    "load": self._on_load,
                    "switch_down": lambda data: self._on_switch("switch_down", data),
                    "switch_up": lambda data: self._on_switch("switch_up", data)}
        for event, handler in handlers.items():
            self.sio.on(event, handler, namespace=NAMESPACE)

    # python-engineio's threads run these: each changes state under ``self._lock`` only.

    def _on_session(self, data: dict) -> None:
        with self._lock:
            if self.result.session and data["resumed"]:
                self.result.resumes += 1
            elif self.result.session:
                # The old session expired: start the audio again in the new one.
                self._restart()
            self.result.session = data["session"]
            self.session_info = data
            if self.abr and data.get("abr") and data.get("codec") in codecs.CODECS:
                # the rung the server starts (or resumes) the session on
                self.codec, self.bitrate = data["codec"], data.get("bitrate") or 0
            self.window.start(data["next_seq"])
            if self._connect_started is not None:
                self.window.handshake_s = time.monotonic() - self._connect_started
                self._connect_started = None
            # a short window only where the server switches this session
            self.window.limit = ABR_IN_FLIGHT if self.abr and data.get("abr") else MAX_IN_FLIGHT
            self._lock.notify_all()
            self._record("session", data)
        self._ready.set()

    def _on_text(self, data: TextEvent) -> None:
        with self._lock:
            self._last_result = data.get("id", self._last_result)
            if data["type"] == "final":
                if data["utterance"] in self._final_utterances:
                    return
                self._final_utterances.add(data["utterance"])
                self.result.finals.append(data)
            else:
                self.result.partials.append(data)
            self._record("text", data)

    def _on_end(self, data: EndEvent) -> None:
        with self._lock:
            self._last_result = data.get("id", self._last_result)
            self.result.ended = True
            self._record("end", data)
            self._lock.notify_all()
        self._done.set()

    def _on_speech_started(self, data: dict) -> None:
        with self._lock:
            self.result.speech_started.append(data)
            self._record("speech_started", data)

    def _on_load(self, data: dict) -> None:
        with self._lock:
            self.result.loads.append(data)
            self._record("load", data)

    def _on_finalized(self, data: dict) -> None:
        with self._lock:
            self.result.finalized.append(data)
            self._record("finalized", data)

    def _on_relabel(self, data: dict) -> None:
        """A later final moved an earlier one to another speaker: so do the finals here."""
        with self._lock:
            self._last_result = data.get("id", self._last_result)
            self.result.relabels.append(data)
            apply_relabel(cast(list[dict], self.result.finals), int(data["utterance"]),
                          str(data["speaker"]), data.get("spans"))
            self._record("relabel", data)

    def _on_switch(self, event: str, data: dict) -> None:
        """The server's adaptive bitrate: the chunks sent from now on go at this rung."""
        with self._lock:
            if self.abr and data.get("codec") in codecs.CODECS:
                self.codec, self.bitrate = data["codec"], data.get("bitrate") or 0
            self.result.switches.append((event, data))
            self._record(event, data)

    def _on_error(self, data: ErrorEvent) -> None:
        code = data.get("code")
        with self._lock:
            self.result.errors.append(data)
            self._record("error", data)
            if code == "seq_gap" and "expected" in data:
                self.window.rewind(data["expected"], time.monotonic())
            elif code in RETRYABLE and "seq" in data:
                self.window.rewind(data["seq"], time.monotonic(), RETRY_PAUSE_S)
            elif code not in RETRYABLE | RECOVERED and code != "session_expired":
                self._done.set()
            self._lock.notify_all()

    def _on_connect_error(self, data=None) -> None:
        # a refusal carries the wire error as its data: {message, data: {code, msg}};
        # anything else is a connection that failed below the protocol
        wire = data.get("data") if isinstance(data, dict) else None
        with self._lock:
            if not (isinstance(wire, dict) and "code" in wire):
                message = data.get("message", data) if isinstance(data, dict) else data
                self._connect_failure = str(message or "connection failed")
                return
            self.result.refusals.append(wire)
            self._record("refused", wire)
        self._refused.set()

    def _on_disconnect(self, reason=None) -> None:
        self._ready.clear()

    def _new_window(self) -> SendWindow:
        return SendWindow(limit=ABR_IN_FLIGHT if self.abr else MAX_IN_FLIGHT)

    def _restart(self) -> None:
        self.window = self._new_window()
        self._last_result = None
        self._final_utterances.clear()
        self.result.partials.clear()
        self.result.finals.clear()

    def _record(self, event: str, data: Mapping[str, Any]) -> None:
        self.result.events.append((time.monotonic(), event, data))
        if self.on_event:
            self.on_event(event, data)

    # ---- connection ---------------------------------------------------------------------

    def connect(self, timeout: float = 10.0, overload_retries: int = 5) -> dict:
        """Connect and wait for the ``session`` event; retries ``overloaded`` as hinted."""
        for attempt in range(overload_retries + 1):
            self._refused.clear()
            self._connect_failure = ""
            self._connect_started = time.monotonic()
            try:
                self.sio.connect(self.url, namespaces=[NAMESPACE], transports=["websocket"],
                                 auth=self._auth, headers=self.headers, wait_timeout=timeout)
            except socketio.exceptions.ConnectionError as exc:
                if not self._refused.is_set():
                    raise Unreachable(self._why_unreachable(exc)) from None
            if not self._refused.is_set() and self._ready.wait(timeout):
                return self.session_info
            refusal = self.result.refusals[-1] if self._refused.is_set() else {}
            self.close()
            if not refusal:
                raise Unreachable(f"{self.url} opened no session within {timeout:g} s")
            if refusal.get("code") != "overloaded":
                raise Refused(refusal.get("code", "internal"), refusal.get("msg", ""))
            if attempt == overload_retries:
                break
            after_ms = refusal.get("retry_after_ms", 2000)
            with self._lock:
                self._record("retry", {"code": "overloaded", "after_ms": after_ms})
            time.sleep(after_ms / 1000)
            self._new_sio()
        raise Refused("overloaded", f"the service stayed overloaded after "
                                    f"{overload_retries + 1} attempts")

    def _why_unreachable(self, exc: Exception) -> str:
        reason = diagnose(self.url, self._ssl_verify)
        if reason:
            return reason
        detail = self._connect_failure or str(exc)
        return f"{self.url} answered but no Socket.IO session opened on {NAMESPACE} ({detail})"

    def send(self, pcm: bytes, seq: int, last: bool = False, sample_rate: int = 0,
             wait_ack: bool = False, timeout: float = 10.0,
             finalize: bool = False) -> dict | None:
        """Send one chunk; with ``wait_ack`` block until the server acks it. ``finalize``:
        the utterance in progress ends after it (``pcm`` may be empty then)."""
        payload = encode_chunk(pcm, seq, last=last, sample_rate=sample_rate,
                               sent_ms=int(time.time() * 1000), finalize=finalize)
        return self.send_payload(payload, seq, wait_ack, timeout)

    def send_opus(self, packets: list[bytes], seq: int, last: bool = False,
                  wait_ack: bool = False, timeout: float = 10.0,
                  bitrate: int | None = None) -> dict | None:
        """Send one chunk of Opus packets (encoded at ``bitrate``), as ``send``."""
        payload = encode_opus_chunk(packets, seq, bitrate=bitrate or self._opus_bitrate(),
                                    last=last, sent_ms=int(time.time() * 1000))
        return self.send_payload(payload, seq, wait_ack, timeout)

    def _opus_bitrate(self) -> int:
        """The bitrate to encode at: the one asked for, else the server's best."""
        offer = self.session_info.get("limits", {}).get("codecs", {}).get(codecs.OPUS, {})
        return self.bitrate or self.session_info.get("bitrate") or (
            offer.get("bitrates") or [codecs.DEFAULT_BITRATE])[0]

    def send_payload(self, payload: bytes, seq: int, wait_ack: bool = False,
                     timeout: float = 10.0) -> dict | None:
        """Send one serialised chunk (``seq`` is its sequence number)."""
        with self._lock:
            self.sent_at[seq] = time.monotonic()
        if wait_ack:
            return self.sio.call("audio_chunk", payload, namespace=NAMESPACE, timeout=timeout)

        def acked(*args):
            if not args:
                return
            with self._lock:
                if "error" not in args[0]:
                    sent = self.sent_at.get(args[0]["seq"])
                    self.window.ack(args[0]["seq"],
                                    time.monotonic() - sent if sent is not None else None)
                    self._lock.notify_all()
                self.result.acks.append(args[0])
                self._record("ack", args[0])

        self.sio.emit("audio_chunk", payload, namespace=NAMESPACE, callback=acked)
        return None

    def stream_pcm(self, pcm: bytes, rate: int, pace: str = "realtime",
                   reconnect_timeout: float = 20.0) -> None:
        """Send all of ``pcm`` as 200 ms chunks (the last with ``last=true``), resending
        whatever the server asks for again, until the last chunk is acknowledged.

        With codec opus, or with ``abr``, the recording is resampled to 16 kHz if it is
        not; each chunk goes at the rung in use when it is sent
        (``codecs.Encodings``), and a
        resent chunk as it was encoded."""
        if (self.codec == codecs.OPUS or self.abr) and rate != codecs.RATE:
            pcm, rate = resample(pcm, rate, codecs.RATE), codecs.RATE
        self.connect_wait(reconnect_timeout)
        chunks = codecs.Encodings(split_chunks(pcm, rate))
        total = len(chunks.pcm)
        start = time.monotonic()
        while not self._done.is_set():
            self.connect_wait(reconnect_timeout)
            with self._lock:
                if self.window.done(total):
                    return
                wait = self.window.wait(total, time.monotonic(), start,
                                         realtime=pace == "realtime")
                if wait > 0:
                    self._lock.wait(min(wait, 0.2))
                    continue
                seq = self.window.take()
                codec = self.codec
                bitrate = self._opus_bitrate() if codec == codecs.OPUS else 0
            try:
                last = seq == total - 1
                if codec == codecs.OPUS:
                    self.send_opus(chunks.opus(seq, bitrate), seq, last=last, bitrate=bitrate)
                else:
                    # the rate goes with the first chunk, and with any chunk after it changes
                    announce = seq == 0 or rate != self.session_info.get("sample_rate")
                    self.send(chunks.pcm[seq], seq, last=last,
                              sample_rate=rate if announce else 0)
            except socketio.exceptions.BadNamespaceError:
                with self._lock:
                    self.window.rewind(seq, time.monotonic())
                self._ready.clear()

    def connect_wait(self, timeout: float) -> None:
        """Wait for the session (raises ``Unreachable`` when it does not come)."""
        if not self._ready.wait(timeout):
            raise Unreachable("the connection was lost and not restored")

    def wait_end(self, timeout: float = 30.0) -> bool:
        """Wait for ``end`` (or a fatal error); True when the stream ended."""
        self._done.wait(timeout)
        return self.result.ended

    def keepalive(self, timeout: float = 10.0) -> dict | None:
        """Tell the server the client is there while it sends no audio (the session's idle
        timeout starts again)."""
        return self.sio.call("keepalive", namespace=NAMESPACE, timeout=timeout)

    def stop(self) -> dict | None:
        try:
            return self.sio.call("stop", namespace=NAMESPACE, timeout=5)
        except (socketio.exceptions.TimeoutError, socketio.exceptions.BadNamespaceError):
            return None

    def close(self) -> None:
        self.sio.disconnect()


def transcribe_pcm(url: str, pcm: bytes, rate: int, pace: str = "realtime",
                   on_event: Callable[[str, Mapping[str, Any]], None] | None = None,
                   timeout: float = 60.0, stop: bool = True, **client_args) -> Transcript:
    """Stream ``pcm`` through the service and return every result it sent."""
    client = StreamingClient(url, rate, on_event=on_event, **client_args)
    try:
        client.connect()
        client.stream_pcm(pcm, rate, pace)
        if not client.wait_end(timeout) and not client.result.fatal_errors:
            raise TranscribeError("internal", f"no end of the stream within {timeout:g} s")
        if stop:
            client.stop()
    finally:
        client.close()
    return client.result
