"""The gateway: Socket.IO handlers on namespace ``/ws`` and each connection's state.

It validates chunks and appends them to Redis, and relays results from Redis to the
client; it never decodes audio. The gateway is WebSocket-only, so a connection lives in
exactly one process: each process keeps its connections in memory and subscribes only to
their result channels. Names: ``socket_id`` is a Socket.IO connection (python-socketio's
``sid``), ``session`` a cosyvoice session id.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace

import gevent
import redis
from flask import request
from flask_socketio import SocketIO
from socketio.exceptions import ConnectionRefusedError as Refused

from .. import metrics
from ..settings import Settings
from ..store import bus as busmod
from ..wire import abr, abr_estimator, codecs
from ..wire.errors import (
    BadChunk,
    CosyvoiceError,
    IdleTimeout,
    Internal,
    Overloaded,
    RateLimited,
    SeqGap,
    SessionExpired,
    SessionLost,
    Unavailable,
)
from ..wire.languages import HANS
from ..wire.messages import Result
from ..wire.protocol import CHUNK_MS, NAMESPACE, SUPPORTED_RATES, Chunk, decode_chunk, encode_chunk
from ..wire.registry import ENGINES
from . import load
from .apikeys import ANONYMOUS, Authenticator
from .limits import ConnectRequest, TokenBucket, parse_auth
from .outputs import Output, SocketIOOutput
from .relay import ChunkWriter, ResultRelay

log = logging.getLogger("cosyvoice.gateway")

# How often a gateway process adds the audio it counted per client name to Redis.
USAGE_WRITE_S = 5.0
# How long a connection whose session the store lost waits for a new one (the store
# starting again, the workers registering again) before it is told to start over.
LOST_RETRY_S = 60.0
# The session settings the gateway stores in its hash for the worker (cosyvoice/text/stages.py)
SESSION_OPTIONS = ("language", "script", "format", "prompt", "interim", "endpoint_ms",
                   "speech_events", "diarize", "min_speakers", "max_speakers")


def current_socket_id() -> str:
    """The Socket.IO connection whose handler is running (Flask-SocketIO's ``request.sid``)."""
    # Flask-SocketIO adds ``sid`` to Flask's request object; Flask's types do not know it.
    socket_id: str = request.sid  # type: ignore[attr-defined]
    return socket_id


# ---- rules (pure: no Redis, no socket) ---------------------------------------------------


def ack_for(reply: busmod.AppendResult, seq: int) -> dict:
    """The ack of a chunk from the append script's reply, or the error it deserves."""
    status = reply.status
    if status == busmod.AppendStatus.APPENDED:
        return {"seq": seq}
    if status == busmod.AppendStatus.DUPLICATE:
        return {"seq": seq, "duplicate": True}
    if status == busmod.AppendStatus.GAP:
        raise SeqGap(expected=reply.next_seq, got=seq)
    if status == busmod.AppendStatus.ENDED:
        raise BadChunk("the stream already ended with last=true", seq=seq)
    if status == busmod.AppendStatus.NO_SESSION:
        raise SessionLost("the session store lost this session (a Redis restart without "
                          "persistence?): the audio it held is gone; a new session "
                          "follows", seq=seq)
    raise Internal(f"unknown append status {status}", seq=seq)


def error_ack(err: CosyvoiceError) -> dict:
    """The ack of a refused chunk: its code, and its seq when the error names one."""
    ack: dict[str, str | int] = {"error": err.code}
    if err.seq is not None:
        ack["seq"] = err.seq
    return ack


def session_limits(settings: Settings) -> dict:
    """The limits a client is told in its ``session`` event."""
    return {"max_chunk_ms": settings.max_chunk_ms, "sample_rates": list(SUPPORTED_RATES),
            "grace_s": settings.session_grace_s, "max_session_s": settings.max_session_s,
            "rate_limit_factor": settings.rate_limit_factor,
            "codecs": codec_offer(settings)}


def codec_offer(settings: Settings) -> dict:
    """What each codec the server accepts takes: PCM's rates, Opus's bitrates."""
    offer: dict[str, dict] = {}
    for codec in settings.accepted_codecs:
        if codec == codecs.PCM16:
            offer[codec] = {"sample_rates": list(SUPPORTED_RATES)}
        elif codec == codecs.OPUS:
            offer[codec] = {"sample_rate": codecs.RATE, "frame_ms": codecs.FRAME_MS,
                            "bitrates": list(settings.opus_bitrate_list)}
    return offer


def session_event(conn: "Connection", resumed: bool, limits: dict) -> dict:
    """The ``session`` event that tells a client its session and where to go on."""
    return {"session": conn.session, "resumed": resumed, "next_seq": conn.next_seq,
            "sample_rate": conn.rate, "chunk_ms": CHUNK_MS, "mode": conn.mode,
            "codec": conn.codec, "bitrate": conn.bitrate, "abr": conn.estimator is not None,
            "language": conn.options.get("language", ""),
            "script": conn.options.get("script", HANS),
            "format": conn.options.get("format") == "1",
            "diarize": conn.options.get("diarize") or False, "limits": limits}


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
    codec: str = codecs.PCM16  # as the client asked (each chunk names its own)
    bitrate: int = 0  # codec opus: the rung the client asked for
    # A client that follows switches (auth.abr): its rungs' judge
    estimator: abr_estimator.Estimator | None = None
    # the session's settings its worker reads, as stored in its hash (``language``,
    # ``script``, ``format``)
    options: dict[str, str] = field(default_factory=dict)
    # when the client last sent a chunk or a keepalive (monotonic), and whether it sent
    # its last chunk: the idle timeout's clock
    heard: float = field(default_factory=time.monotonic)
    ended: bool = False
    # who the client is (its key's name, its token's subject): what its audio counts to
    subject: str = ANONYMOUS
    # what it asked for when it connected (a lost session is replaced with the same)
    request: ConnectRequest | None = None
    # audio seconds stored: what a session the store lost took with it ends there
    audio_s: float = 0.0
    lost: bool = False  # the store lost the session: a new one is being opened



class Gateway:
    """Socket.IO handlers bound to one settings object and one Redis client."""

    def __init__(self, settings: Settings, socketio: SocketIO, client: redis.Redis,
                 relay_results: bool = True):
        self.settings = settings
        self.socketio = socketio
        self.bus = busmod.Bus(client, settings.stream_maxlen)
        self.writer = ChunkWriter(self.bus)
        self.relay = ResultRelay(client, self.bus, start=relay_results)
        self.auth = Authenticator(settings)
        # audio seconds per client name not yet added to Redis's usage
        self.usage: dict[str, float] = defaultdict(float)
        # the idle timeout's watcher and the usage writer (not in in-process tests, where
        # nothing runs the hub)
        if relay_results and settings.idle_timeout_s > 0:
            gevent.spawn(self.watch_idle)
        if relay_results:
            gevent.spawn(self.write_usage)
        self.connections: dict[str, Connection] = {}
        # the sessions this process holds for a client now, of every face (Socket.IO,
        # files, Realtime, Deepgram): ``cosyvoice_sessions_active``
        self.held: set[str] = set()
        # where the last final sent ends, by session (Socket.IO's, while held)
        self.final_ends: dict[str, float] = {}
        # Session modes the workers' engine offers (auth ``mode``); the first is the default.
        self.modes = ENGINES[settings.engine].modes
        # and the languages (auth ``language``; the first is the default)
        self.languages = ENGINES[settings.engine].languages
        # the rungs a client that follows switches moves between (fixed by the settings)
        self.rungs = abr.rungs_for(settings.accepted_codecs, settings.opus_bitrate_list)

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
        on("keepalive", namespace=NAMESPACE)(self.on_keepalive)
        on("*", namespace=NAMESPACE)(self.on_unknown_event)
        self.socketio.on_error(NAMESPACE)(self.on_handler_error)

    # ---- helpers ----------------------------------------------------------------------

    def _emit_error(self, err: CosyvoiceError, socket_id: str | None = None) -> None:
        self.socketio.emit("error", err.to_wire(), to=socket_id or current_socket_id(),
                           namespace=NAMESPACE)

    def _bucket(self) -> TokenBucket | None:
        settings = self.settings
        if settings.rate_limit_factor <= 0:
            return None
        return TokenBucket(settings.rate_limit_factor, settings.rate_limit_burst_s)

    # ---- handlers ---------------------------------------------------------------------

    def on_connect(self, auth=None):
        """Open or resume a session. A refusal is a Socket.IO connect error,
        ``{message, data}`` with the wire error (``{code, msg, ...}``) as ``data``.

        Everything the client must see after connecting is emitted by a greenlet that
        runs once the connect packet is out: events sent from inside this handler would
        precede it and be dropped by clients.
        """
        notices: list[CosyvoiceError] = []
        socket_id = current_socket_id()
        try:
            req = parse_auth(auth, self.modes, self.settings.accepted_codecs,
                             self.settings.opus_bitrate_list, self.languages)
            subject = self.auth.check(req.token)
            conn = self._resume(req, socket_id, notices) if req.session else None
            resumed = conn is not None
            if conn is None:
                conn = self.open_session(req, socket_id, subject=subject)
            conn.subject = subject
            conn.request = req
            conn.codec, conn.bitrate = self._codec(req)
            if req.abr and self.settings.abr:
                self._start_abr(conn, req)
        except CosyvoiceError as err:
            log.info("connection refused: %s", err.code, extra={"event": "refuse"})
            raise Refused(err.msg, err.to_wire()) from err
        except redis.RedisError as exc:
            log.warning("cannot open a session: %s", exc)
            metrics.REDIS_ERRORS.inc()
            unavailable = Unavailable("the session store is unreachable")
            raise Refused(unavailable.msg, unavailable.to_wire()) from exc
        self.connections[socket_id] = conn
        gevent.spawn(self._welcome, socket_id, conn, resumed, notices)
        return True

    def _codec(self, req: ConnectRequest) -> tuple[str, int]:
        """The codec and bitrate a connection said it will send: what it asked for (already
        checked against the offer), else PCM where the server takes it."""
        accepted = self.settings.accepted_codecs
        codec = req.codec or (codecs.PCM16 if codecs.PCM16 in accepted else accepted[0])
        if codec != codecs.OPUS:
            return codec, 0
        return codec, req.bitrate or self.settings.opus_bitrate_list[0]

    def _start_abr(self, conn: Connection, req: ConnectRequest) -> None:
        """A client that follows switches starts on the rung it asked for (else the highest),
        or lower where its network hint says the link is slower (the session event names
        the rung), and gets an estimator."""
        rungs = self.rungs
        if len(rungs) < 2:
            return  # one rung: nothing to switch between
        asked = abr.rung_for(req.codec, conn.bitrate or 0, rungs) if req.codec else None
        start = asked or rungs[0]
        hinted, why = abr.start_rung(req.network_hint, rungs)
        if why == "network_hint" and rungs.index(hinted) > rungs.index(start):
            start = hinted  # the hint says the link is slower than the rung asked for
        conn.codec, conn.bitrate = start.codec, start.bitrate if start.codec == codecs.OPUS else 0
        conn.estimator = abr_estimator.Estimator(start, rungs=rungs)

    def _judge(self, conn: Connection, chunk: Chunk, payload_bytes: int, arrival_s: float,
               socket_id: str) -> None:
        """Feed a stored chunk to the connection's estimator; tell the client of a switch."""
        estimator = conn.estimator
        if estimator is None:
            return
        rung = abr.rung_for(chunk.codec, chunk.bitrate or conn.bitrate, estimator.rungs)
        if rung is None:
            return
        decision = estimator.on_chunk(chunk.sent_ms, arrival_s,
                                      payload_bytes + abr.CHUNK_FRAMING_BYTES, rung.name)
        metrics.ABR_RUNG_SECONDS.labels(rung.name).inc(chunk.duration_s)
        metrics.ABR_QUEUE_DELAY.observe(max(0.0, estimator.queue_delay_ms) / 1000)
        if decision is None:
            return
        metrics.ABR_SWITCHES.labels(decision.direction, decision.reason).inc()
        conn.codec, conn.bitrate = decision.rung.codec, decision.rung.bitrate
        log.info("switch %s to %s (%s)", decision.direction, decision.rung.name,
                 decision.reason, extra={"session": conn.session, "event": "abr"})
        self.socketio.emit(f"switch_{decision.direction}",
                           {**decision.rung.to_wire(), "reason": decision.reason},
                           to=socket_id, namespace=NAMESPACE)

    def _welcome(self, socket_id: str, conn: Connection, resumed: bool,
                 notices: list[CosyvoiceError]) -> None:
        to = {"to": socket_id, "namespace": NAMESPACE}
        for notice in notices:
            self.socketio.emit("error", notice.to_wire(), **to)
        self.socketio.emit("session", session_event(conn, resumed,
                                                    session_limits(self.settings)), **to)
        if resumed:
            try:
                self.relay.replay(conn.session)
            except redis.RedisError as exc:
                log.warning("replay of %s failed: %s", conn.session, exc)

    def open_session(self, req: ConnectRequest, conn_id: str, output: Output | None = None,
                     subject: str = ANONYMOUS, client: str | None = None) -> Connection:
        """Open and admit a session for connection ``conn_id`` (``client``: the client's
        address; None: the Flask request's) whose results go to ``output`` (None: the
        Socket.IO connection ``conn_id``). Raises ``RateLimited``, ``Overloaded`` or a
        ``redis.RedisError``; nothing of the session is left then."""
        rate = req.sample_rate or self.settings.default_sample_rate
        mode = req.mode or self.modes[0]
        options = {"language": req.language or self.languages[0], "script": req.script or HANS,
                   "format": "1" if req.format else "0",
                   **({"prompt": req.prompt} if req.prompt else {}),
                   **({} if req.interim else {"interim": "0"}),
                   **({"endpoint_ms": str(req.endpoint_ms)} if req.endpoint_ms else {}),
                   **({"speech_events": "1"} if req.speech_events else {}),
                   **dict(req.diarize)}
        session = secrets.token_hex(12)
        if client is None:
            client = request.remote_addr or ""
        # one client: its key or token subject where the gateway asks for one, else its
        # address (behind COSYVOICE_TRUSTED_PROXIES)
        if subject != ANONYMOUS:
            client = "key:" + subject
        hold_s = self.settings.max_session_s + self.settings.session_grace_s
        limit, why = self._client_limit()
        if not self.bus.claim_client_slot(client, session, limit, hold_s):
            raise RateLimited(f"this client already holds {limit} sessions: {why}",
                              retry_after_ms=self.settings.overload_retry_ms)
        try:
            self.bus.create_session(session, rate, conn=conn_id, client=client, mode=mode,
                                    options=options)
            admission = self.bus.admit(session)
        except redis.RedisError:
            self._discard(session, client)
            raise
        if not admission.admitted:
            self._discard(session, client)
            raise Overloaded("every ASR worker is busy; try again later",
                             retry_after_ms=self._retry_after_ms(admission))
        # No result can come before the client's first chunk, which needs the session
        # event that follows this handler.
        try:
            self.relay.subscribe(session, output or SocketIOOutput(
                self.socketio, conn_id, partials=options.get("interim") != "0",
                on_final=self._final_sent))
        except redis.RedisError:
            self.relay.unsubscribe(session)
            self._discard(session, client)
            raise
        log.info("session opened", extra={"session": session, "event": "connect"})
        self.held.add(session)
        return Connection(session=session, rate=rate, conn_id=conn_id, client=client,
                          bucket=self._bucket(), mode=mode, options=options, subject=subject)

    def _client_limit(self) -> tuple[int, str]:
        """The most sessions one client may hold (0: any number), and which limit it is:
        ``COSYVOICE_MAX_SESSIONS_PER_CLIENT``, or its share of the live workers' capacity
        (``COSYVOICE_CLIENT_SHARE``; at least one session), the smaller."""
        fixed = self.settings.max_sessions_per_client
        share = self.settings.client_share
        if share >= 1:
            return fixed, "COSYVOICE_MAX_SESSIONS_PER_CLIENT"
        _workers, open_sessions, capacity = load.totals(self.bus)
        shared = max(1, int(share * capacity))
        if (fixed and fixed <= shared) or open_sessions >= capacity:
            # a full service refuses everyone alike: admission's overloaded says so
            return fixed, "COSYVOICE_MAX_SESSIONS_PER_CLIENT"
        return shared, (f"its share ({share:.0%}) of the service's capacity of {capacity} "
                        f"(COSYVOICE_CLIENT_SHARE)")

    def _retry_after_ms(self, admission: busmod.Admission) -> int:
        """A refused client's wait: its place behind the open sessions over the capacity,
        at the rate sessions ended lately (cosyvoice/gateway/load.py)."""
        try:
            drain = self.bus.drain_rate()
        except redis.RedisError:
            drain = None
        ahead = (admission.open_sessions or 0) - admission.capacity + 1
        return load.retry_after_ms(drain, ahead, self.settings.overload_retry_ms)

    def _discard(self, session: str, client: str) -> None:
        """Undo a session that is not going ahead (best effort: Redis may be down)."""
        try:
            self.bus.delete_session(session)
            self.bus.release_client_slot(client, session)
        except redis.RedisError as exc:
            log.warning("could not discard session %s: %s", session, exc)

    def _resume(self, req: ConnectRequest, socket_id: str,
                notices: list[CosyvoiceError]) -> Connection | None:
        if req.session is None:
            return None
        conn = self.resume_session(req.session, socket_id, after=req.last_result or "-")
        if conn is None:
            # Past the grace period: say so, then carry on with a fresh session.
            notices.append(SessionExpired("the session expired; a new one was started"))
        return conn

    def resume_session(self, session: str, conn_id: str, output: Output | None = None,
                       after: str = "-", subject: str = ANONYMOUS) -> Connection | None:
        """Connection ``conn_id`` takes the session over (None: it is past its grace
        period); its results after result id ``after`` go to ``output`` (None: the
        Socket.IO connection ``conn_id``) once ``relay.replay`` is called."""
        info = self.bus.resume_session(session, conn_id)
        if not info:
            return None
        conn = Connection(session=session, rate=int(info.get("rate", 16000)),
                          conn_id=conn_id, client=info.get("client", ""),
                          bucket=self._bucket(), next_seq=int(info.get("next_seq", 0)),
                          created=int(info.get("created_ms", 0)) / 1000 or time.time(),
                          mode=info.get("mode", self.modes[0]),
                          options={k: info[k] for k in SESSION_OPTIONS if k in info},
                          subject=subject)
        conn.audio_s = conn.next_seq * CHUNK_MS / 1000  # chunks are 200 ms
        self.bus.hold_client_slot(conn.client, conn.session,
                                  self.settings.max_session_s + self.settings.session_grace_s)
        self.relay.subscribe(conn.session, output or SocketIOOutput(
            self.socketio, conn_id, partials=conn.options.get("interim") != "0",
            on_final=self._final_sent), after=after)
        log.info("session resumed", extra={"session": conn.session, "event": "resume"})
        self.held.add(conn.session)
        return conn

    def release_session(self, conn: Connection, output_id: str) -> bool:
        """The connection is gone but the client may come back: its results stop, the
        session is kept for the grace period. False where it was stopped, or another
        connection took it over meanwhile (raises ``redis.RedisError``)."""
        # Two steps, neither skipped for the other's failure: a session whose connection is
        # not released stays held, and its keys outlive the grace period.
        self.held.discard(conn.session)
        self.final_ends.pop(conn.session, None)
        try:
            self.relay.unsubscribe(conn.session, output_id)
        except Exception:  # noqa: BLE001 - whatever the subscriber raised, release below
            log.exception("result unsubscribe of %s failed", conn.session)
        if conn.stopped:
            return False
        grace = self.settings.session_grace_s
        if not self.bus.release_connection(conn.session, conn.conn_id, grace):
            return False
        self.bus.hold_client_slot(conn.client, conn.session, grace)
        return True

    def on_disconnect(self, reason=None):
        conn = self.connections.pop(current_socket_id(), None)
        if conn is None:
            return
        try:
            self.release_session(conn, current_socket_id())
        except redis.RedisError as exc:
            metrics.REDIS_ERRORS.inc()
            log.warning("disconnect cleanup of %s failed: %s", conn.session, exc)
        log.info("session disconnected", extra={"session": conn.session, "event": "disconnect"})

    @metrics.counts_chunks
    def on_audio_chunk(self, socket_id: str, data=None):
        """python-socketio handler (no Flask request context): the ack, or an error."""
        arrival_s = time.monotonic()
        conn = self.connections.get(socket_id)
        if conn is not None:
            conn.heard = arrival_s
        if conn is not None and conn.lost:  # said once; the new session's event follows
            return error_ack(SessionLost("a new session is being opened"))
        try:
            if conn is None or conn.stopped:
                raise SessionExpired("this connection has no active session")
            chunk = decode_chunk(data, conn.rate, self.settings.max_chunk_ms,
                                 self.settings.accepted_codecs)
            self._check_limits(conn, chunk)
            conn.rate = chunk.sample_rate
            ack = self.store(conn, chunk, data)
            conn.ended = conn.ended or chunk.last
            if "duplicate" not in ack:
                metrics.count_audio(chunk.codec, len(data), chunk.duration_s)
                self._judge(conn, chunk, len(data), arrival_s, socket_id)
            return ack
        except SessionLost as err:
            assert conn is not None
            self._replace_lost(socket_id, conn, err)
            return error_ack(err)
        except CosyvoiceError as err:
            self._emit_error(err, socket_id)
            return error_ack(err)
        except Exception as exc:  # noqa: BLE001 - as on_handler_error for the other events
            log.error("handler failed", exc_info=exc)
            self._emit_error(Internal("internal error"), socket_id)
            return {"error": Internal.code}

    def _final_sent(self, session: str, final: Result) -> None:
        """Where the last final sent to a Socket.IO client ends (what a lost session took
        with it starts there)."""
        if session in self.held:
            self.final_ends[session] = max(self.final_ends.get(session, 0.0),
                                           float(final.get("end", 0.0)))

    def _replace_lost(self, socket_id: str, conn: Connection, err: SessionLost) -> None:
        """The store lost the connection's session (a Redis that restarted without its
        data): say once which audio went with it, and open a new session with the same
        request (``_reopen``); its ``session`` event tells the client to send its audio
        again (a file) or go on (a microphone)."""
        if conn.lost:
            return
        conn.lost = conn.stopped = True
        start = self.final_ends.pop(conn.session, 0.0)
        lost = [round(start, 3), round(max(conn.audio_s, start), 3)]
        self.socketio.emit("error", {**err.to_wire(), "lost": lost}, to=socket_id,
                           namespace=NAMESPACE)
        log.warning("session lost by the store", extra={"session": conn.session,
                                                        "event": "lost"})
        self.release_session(conn, socket_id)  # stopped: only its results stop
        gevent.spawn(self._reopen, socket_id, conn)

    def _reopen(self, socket_id: str, conn: Connection) -> None:
        """A new session for a connection whose session was lost, as soon as one can be
        opened (the store may still be starting, the workers registering again): tried
        every second for ``LOST_RETRY_S`` while the client stays; then it is told
        ``session_expired`` and disconnected (it reconnects into a fresh session)."""
        req = replace(conn.request or ConnectRequest(), session=None, last_result=None)
        deadline = time.monotonic() + LOST_RETRY_S
        while self.connections.get(socket_id) is conn:
            try:
                new = self.open_session(req, socket_id, client=conn.client)
            except (CosyvoiceError, redis.RedisError) as exc:
                if time.monotonic() > deadline:
                    self._emit_error(SessionExpired("no new session could be opened"),
                                     socket_id)
                    self.socketio.server.disconnect(socket_id, namespace=NAMESPACE)
                    return
                log.info("no new session for a lost one yet: %s", exc)
                gevent.sleep(1.0)
                continue
            new.subject, new.request = conn.subject, conn.request
            new.codec, new.bitrate = conn.codec, conn.bitrate
            self.connections[socket_id] = new
            self._welcome(socket_id, new, False, [])
            return

    def _check_limits(self, conn: Connection, chunk: Chunk) -> None:
        duration = chunk.duration_s
        if conn.bucket is not None and not conn.bucket.take(duration):
            raise RateLimited("sending faster than the configured rate; resend later",
                              seq=chunk.seq)
        if time.time() - conn.created > self.settings.max_session_s:
            raise SessionExpired("the session reached its maximum length", seq=chunk.seq)

    def store(self, conn: Connection, chunk: Chunk, pb: bytes) -> dict:
        """Append a validated chunk to the session's stream: its ack, or the error."""
        try:
            reply = self.writer.append(conn.session, chunk, bytes(pb))
        except gevent.Timeout as exc:
            raise Unavailable("timed out storing the chunk", seq=chunk.seq) from exc
        if isinstance(reply, redis.RedisError):
            raise Unavailable("the session store is unreachable", seq=chunk.seq) from reply
        if isinstance(reply, Exception):
            raise Internal("internal error", seq=chunk.seq) from reply
        ack = ack_for(reply, chunk.seq)
        if "duplicate" not in ack:
            conn.audio_s += chunk.duration_s
            self.usage[conn.subject] += chunk.duration_s
            metrics.AUDIO_BY_KEY.labels(conn.subject).inc(chunk.duration_s)
        return ack

    def store_pcm(self, conn: Connection, pcm: bytes, seq: int, rate: int, *,
                  last: bool = False, finalize: bool = False) -> dict:
        """A chunk of PCM that a face of the gateway made (a file's, a Realtime client's
        audio), stored as a client's chunk is: validated, counted, and at the connection's
        rate limit (waiting where a client would be refused). Its ack, or the error."""
        duration = len(pcm) / 2 / rate
        while conn.bucket is not None and not conn.bucket.take(duration):
            gevent.sleep(0.05)
        pb = encode_chunk(pcm, seq, last=last, finalize=finalize, sample_rate=rate,
                          sent_ms=int(time.time() * 1000))
        chunk = decode_chunk(pb, rate, self.settings.max_chunk_ms,
                             self.settings.accepted_codecs)
        ack = self.store(conn, chunk, pb)
        if "duplicate" not in ack:
            metrics.count_audio(chunk.codec, len(pb), chunk.duration_s)
        return ack

    def write_usage(self) -> None:
        """Add the audio seconds counted per client name to the day's usage in Redis,
        every ``USAGE_WRITE_S`` (a greenlet; ``cosyvoice usage`` reads it)."""
        while True:
            gevent.sleep(USAGE_WRITE_S)
            self.flush_usage()

    def flush_usage(self) -> None:
        if not self.usage:
            return
        counted, self.usage = self.usage, defaultdict(float)
        try:
            self.bus.add_usage(time.strftime("%Y-%m-%d", time.gmtime()), counted)
        except redis.RedisError as exc:
            metrics.REDIS_ERRORS.inc()
            log.warning("usage not stored, kept for the next write: %s", exc)
            for name, seconds in counted.items():
                self.usage[name] += seconds

    def on_stop(self, data=None):
        conn = self.connections.get(current_socket_id())
        if conn is None or conn.stopped:
            return {"stopped": False}
        conn.stopped = True
        try:
            self.close_session(conn, current_socket_id())
        except redis.RedisError as exc:
            conn.stopped = False
            metrics.REDIS_ERRORS.inc()
            self._emit_error(Unavailable("could not delete the session"))
            log.warning("stop of %s failed: %s", conn.session, exc)
            return {"stopped": False}
        log.info("session stopped", extra={"session": conn.session, "event": "stop"})
        return {"stopped": True, "session": conn.session}

    def on_keepalive(self, data=None):
        """The client is there though it sends no audio now: the idle timeout starts
        again, and the sweeper sees the session as alive."""
        conn = self.connections.get(current_socket_id())
        if conn is None or conn.stopped:
            return {"ok": False}
        conn.heard = time.monotonic()
        self.touch(conn)
        return {"ok": True}

    def touch(self, conn: Connection) -> None:
        """The session's client is there (a keep-alive of any face): the sweeper counts it
        as activity. A store that fails is logged; the keep-alive only lapses."""
        try:
            self.bus.touch_session(conn.session)
        except redis.RedisError as exc:
            metrics.REDIS_ERRORS.inc()
            log.warning("keepalive of %s not stored: %s", conn.session, exc)

    def watch_idle(self) -> None:
        """End the sessions of connections idle for ``idle_timeout_s`` (a greenlet)."""
        timeout = self.settings.idle_timeout_s
        while True:
            gevent.sleep(min(1.0, timeout / 4))
            now = time.monotonic()
            for socket_id, conn in list(self.connections.items()):
                if not (conn.stopped or conn.ended) and now - conn.heard > timeout:
                    self._end_idle(socket_id, conn, timeout)

    def _end_idle(self, socket_id: str, conn: Connection, timeout: float) -> None:
        self._emit_error(IdleTimeout(f"no audio and no keepalive for {timeout:g} s; the "
                                     f"session ended"), socket_id)
        try:
            self.close_session(conn, socket_id)
        except redis.RedisError as exc:
            metrics.REDIS_ERRORS.inc()
            log.warning("idle session %s not deleted: %s", conn.session, exc)
        log.info("session idle", extra={"session": conn.session, "event": "idle"})
        self.socketio.server.disconnect(socket_id, namespace=NAMESPACE)

    def save_face(self, face: str, cid: str, state: str, ttl_s: float | None = None) -> None:
        """A raw-WebSocket face's connection state (``face``: ``realtime``, ``listen``) for
        a client that comes back to it, kept ``ttl_s`` (None: as long as its sessions may
        live); nothing where sessions have no grace period. A store that fails is logged:
        the connection goes on, only its resume is lost."""
        settings = self.settings
        if settings.session_grace_s <= 0:
            return
        try:
            self.bus.save_face(face, cid, state, ttl_s if ttl_s is not None
                               else settings.max_session_s + settings.session_grace_s)
        except redis.RedisError as exc:
            metrics.REDIS_ERRORS.inc()
            log.warning("%s state of %s not saved: %s", face, cid, exc)

    def close_session(self, conn: Connection, output_id: str) -> None:
        """The session is over for its client: its results stop, its keys and client
        slot go (raises ``redis.RedisError``)."""
        conn.stopped = True
        self.held.discard(conn.session)
        self.final_ends.pop(conn.session, None)
        self.relay.unsubscribe(conn.session, output_id)
        self.bus.delete_session(conn.session)
        self.bus.release_client_slot(conn.client, conn.session)

    def on_unknown_event(self, event, *args):
        self._emit_error(BadChunk(f"unknown event {str(event)[:64]!r}"))
        return {"error": "bad_chunk"}

    def on_handler_error(self, exc):
        log.error("handler failed", exc_info=exc)
        self._emit_error(Internal("internal error"))
