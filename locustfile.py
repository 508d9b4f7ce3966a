"""Locust load test that speaks cosyvoice's real protocol.

Each simulated user opens a Socket.IO connection (WebSocket transport, namespace
``/ws``), streams real speech as 200 ms protobuf chunks in real time, sends ``last`` at
the end, waits for ``end``, then ``stop``s the session and starts another. Connection
loss is handled as a browser would: the client reconnects, resumes with
``auth.session`` and ``auth.last_result`` and resends from ``next_seq``
(``cosyvoice.client.StreamingClient`` does this).

Locust's statistics get real latencies, type ``socketio``:

* ``connect``: connect until the ``session`` event;
* ``ack``: a chunk sent until its ack (the chunk is stored in Redis);
* ``chunk->partial``: a chunk sent until the partial result whose ``seq`` is that chunk
  (partials come only when the hypothesis changes, so not every chunk has one);
* ``last->final``: the ``last`` chunk sent until the final result that covers it (or
  ``end``, when the transcript was already final before ``last``);
* ``reconnect``: a dropped connection until the ``session`` event that resumes it;
* failures: every ``error`` event (``error <code>``), a chunk never acknowledged
  (``ack``), no ``end`` in time (``last->final``), a refused or failed connection.

Headless, with CSV files::

    locust -f locustfile.py --headless --host http://127.0.0.1:5000 \\
        -u 20 -r 2 -t 2m --stop-timeout 30 --csv results/cosyvoice

The gateway must let one address open that many sessions
(``COSYVOICE_MAX_SESSIONS_PER_CLIENT=0``) and the workers must have the capacity,
otherwise the ``overloaded`` and ``rate_limited`` refusals show up as failures — which
is what they are.
"""

from __future__ import annotations

import glob
import os
import random
import time

import gevent
from locust import User, constant, events, task

from cosyvoice.client import StreamingClient, TranscribeError
from cosyvoice.wire.audio import read_audio, split_chunks
from cosyvoice.wire.protocol import NAMESPACE

ROOT = os.path.dirname(os.path.abspath(__file__))
REQUEST_TYPE = "socketio"
# Slack for the last acks in a session's deadline. A chunk still unacknowledged when its
# session ends counts as lost, reported as taking this long.
ACK_TIMEOUT_S = 10.0
# How long the final result may take after `last` is acknowledged (also as reported).
FINAL_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 10.0
GAP_S = 0.5  # silence between the utterances of one session


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    parser.add_argument("--speech", default=os.path.join(ROOT, "tests", "fixtures", "*.wav"),
                        help="glob of 16 kHz WAV files to stream (default: the test fixtures)")
    parser.add_argument("--utterances", type=int, default=3,
                        help="files streamed back to back in one session")
    parser.add_argument("--token", default=os.environ.get("COSYVOICE_TOKEN", ""),
                        help="client token when the service requires one")


class LatencyProbe:
    """Turns one session's client events into Locust request records.

    ``fire(name, ms, length, exception)`` records one request; everything else here is
    bookkeeping on the client's own send times (``StreamingClient.sent_at``).
    """

    def __init__(self, client: StreamingClient, chunks: int, fire):
        self.client = client
        self.last_seq = chunks - 1
        self.fire = fire
        self.unacked: set[int] = set()
        self.final_seen = False
        self.connecting = True
        self.lost_at: float | None = None

    def sent(self, seq: int) -> None:
        self.unacked.add(seq)

    def disconnected(self) -> None:
        if not self.connecting:
            self.lost_at = time.monotonic()

    def on_event(self, event: str, data: dict) -> None:
        now = time.monotonic()
        sent_at = self.client.sent_at
        if event == "session" and self.lost_at is not None:
            lost, self.lost_at = self.lost_at, None
            if data.get("resumed"):
                self.fire("reconnect", (now - lost) * 1000, 0, None)
                # The server has every chunk before next_seq: those whose acks the drop
                # swallowed are stored, not lost, and will not be sent again.
                self.unacked = {seq for seq in self.unacked if seq >= data["next_seq"]}
        elif event == "ack" and "error" not in data:
            seq = data.get("seq")
            if seq in self.unacked:
                self.unacked.discard(seq)
                self.fire("ack", (now - sent_at[seq]) * 1000, 0, None)
        elif event == "text" and data.get("seq") in sent_at:
            seq = data["seq"]
            if data["type"] == "partial":
                self.fire("chunk->partial", (now - sent_at[seq]) * 1000, len(data["text"]), None)
            elif seq == self.last_seq and not self.final_seen:
                self.final_seen = True
                self.fire("last->final", (now - sent_at[seq]) * 1000, len(data["text"]), None)
        elif event == "end" and not self.final_seen and self.last_seq in sent_at:
            self.final_seen = True
            self.fire("last->final", (now - sent_at[self.last_seq]) * 1000, 0, None)
        elif event == "error" and not self.connecting:
            code = data.get("code", "?")
            self.fire(f"error {code}", 0, 0, RuntimeError(f"{code}: {data.get('msg', '')}"))

    def settle(self) -> None:
        """Wait for the acks still on their way, up to the ack timeout of the last chunk
        sent. An ack and the ``end`` event travel apart (the ack from the chunk's handler,
        ``end`` from the worker through the result relay), so the last chunk's ack may
        arrive after ``end``: late, not lost."""
        sent = [self.client.sent_at[seq] for seq in self.unacked if seq in self.client.sent_at]
        deadline = max(sent, default=time.monotonic()) + ACK_TIMEOUT_S
        while self.unacked and time.monotonic() < deadline:
            gevent.sleep(0.05)

    def finish(self) -> None:
        """Count what never came: unacknowledged chunks and a missing final."""
        for seq in sorted(self.unacked):
            self.fire("ack", ACK_TIMEOUT_S * 1000, 0, TimeoutError(f"chunk {seq} never acked"))
        self.unacked.clear()
        if not self.final_seen and self.last_seq in self.client.sent_at:
            self.fire("last->final", FINAL_TIMEOUT_S * 1000, 0,
                      TimeoutError("no final result after last"))


class ProbedClient(StreamingClient):
    """The service's own streaming client, telling a probe about every chunk it sends."""

    def __init__(self, url: str, probe_factory, **kwargs):
        super().__init__(url, **kwargs)
        self.probe = probe_factory(self)
        self.on_event = self.probe.on_event

    def send(self, pcm: bytes, seq: int, last: bool = False, sample_rate: int = 0,
             wait_ack: bool = False, timeout: float = 10.0,
             finalize: bool = False) -> dict | None:
        self.probe.sent(seq)
        return super().send(pcm, seq, last=last, sample_rate=sample_rate, wait_ack=wait_ack,
                            timeout=timeout, finalize=finalize)

    def _bind(self) -> None:
        super()._bind()
        handlers = self.sio.handlers[NAMESPACE]
        lost = handlers["disconnect"]

        def disconnect(*args):
            self.probe.disconnected()
            return lost(*args)

        handlers["disconnect"] = disconnect


class SpeechUser(User):
    """One microphone: a stream of real-time sessions, one after another."""

    wait_time = constant(0.5)

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        files = sorted(glob.glob(opts.speech if opts else
                                 os.path.join(ROOT, "tests", "fixtures", "*.wav")))
        # read at 16 kHz: every chunk is then exactly 200 ms (6400 bytes).
        self.audio = [read_audio(f)[0] for f in files]
        if not self.audio:
            raise RuntimeError("no speech files matched --speech")
        self.utterances = max(1, opts.utterances if opts else 3)
        self.token = (opts.token if opts else "") or None
        if not self.host:
            raise RuntimeError("no service to test: give --host https://… (or http://)")
        self.url: str = self.host

    def _fire(self, name: str, ms: float, length: int, exception) -> None:
        self.environment.events.request.fire(
            request_type=REQUEST_TYPE, name=name, response_time=ms, response_length=length,
            exception=exception, context={})

    def _session_audio(self) -> bytes:
        picks = random.sample(self.audio, min(self.utterances, len(self.audio)))
        silence = b"\x00\x00" * int(16000 * GAP_S)
        return silence.join(picks)

    @task
    def stream_session(self) -> None:
        pcm = self._session_audio()
        chunks = len(split_chunks(pcm, 16000))
        client = ProbedClient(self.url, lambda c: LatencyProbe(c, chunks, self._fire),
                              sample_rate=16000, token=self.token)
        probe = client.probe
        started = time.monotonic()
        try:
            client.connect(timeout=CONNECT_TIMEOUT_S)
        except TranscribeError as exc:
            self._fire("connect", (time.monotonic() - started) * 1000, 0, exc)
            client.close()
            return
        probe.connecting = False
        self._fire("connect", (time.monotonic() - started) * 1000, 0, None)
        finished = False
        try:
            deadline = chunks * 0.2 + ACK_TIMEOUT_S + FINAL_TIMEOUT_S
            with gevent.Timeout(deadline, TimeoutError(f"session longer than {deadline:.0f}s")):
                client.stream_pcm(pcm, 16000, pace="realtime")
                client.wait_end(FINAL_TIMEOUT_S)
            finished = True
        except (TranscribeError, TimeoutError) as exc:
            self._fire("session", (time.monotonic() - started) * 1000, 0, exc)
            finished = True
        finally:
            # A user that Locust stops mid-session loses nothing: only a session that
            # ran its course counts what never arrived.
            if finished:
                probe.settle()
                probe.finish()
                client.stop()
            client.close()
