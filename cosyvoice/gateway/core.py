"""The gateway's sessions: what every face opens, feeds, resumes and closes, and each
connection's state.

It validates chunks and appends them to Redis, and relays results from Redis to the
client; it never decodes audio. The gateway is WebSocket-only, so a connection lives in
exactly one process: each process keeps its connections in memory and subscribes only to
their result channels. The Socket.IO namespace's handlers are a face like the others
(``cosyvoice/faces/socketio.py``). Names: ``conn_id`` is the connection a session's
results go to (a Socket.IO connection's ``sid``, a face's own id), ``session`` a
cosyvoice session id.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import defaultdict
from dataclasses import dataclass, field

import gevent
import redis
from flask import request
from flask_socketio import SocketIO

from .. import metrics
from ..settings import Settings
from ..store import bus as busmod
from ..wire import abr_estimator, codecs
from ..wire.errors import (
    BadChunk,
    Internal,
    Overloaded,
    RateLimited,
    SeqGap,
    SessionLost,
    Unavailable,
)
from ..wire.languages import HANS
from ..wire.messages import Result
from ..wire.protocol import CHUNK_MS, SUPPORTED_RATES, Chunk, decode_chunk, encode_chunk
from ..wire.registry import ENGINES
from . import load
from .apikeys import ANONYMOUS, Authenticator
from .limits import ConnectRequest, TokenBucket
from .outputs import Output, SocketIOOutput
from .relay import ChunkWriter, ResultRelay

log = logging.getLogger("cosyvoice.gateway")

# How often a gateway process adds the audio it counted per client name to Redis.
USAGE_WRITE_S = 5.0
# The session settings the gateway stores in its hash for the worker (cosyvoice/text/stages.py)
SESSION_OPTIONS = ("language", "script", "format", "prompt", "interim", "endpoint_ms",
                   "speech_events", "diarize", "min_speakers", "max_speakers")


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
    """The sessions of one gateway process, bound to one settings object and one Redis
    client: opened, admitted, fed, resumed, released and closed for every face."""

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
        # the usage writer (not in in-process tests, where nothing runs the hub)
        self.background = relay_results
        if relay_results:
            gevent.spawn(self.write_usage)
        # the sessions this process holds for a client now, of every face (Socket.IO,
        # files, Realtime, Deepgram): ``cosyvoice_sessions_active``
        self.held: set[str] = set()
        # where the last final sent ends, by session (Socket.IO's, while held)
        self.final_ends: dict[str, float] = {}
        # Session modes the workers' engine offers (auth ``mode``); the first is the default.
        self.modes = ENGINES[settings.engine].modes
        # and the languages (auth ``language``; the first is the default)
        self.languages = ENGINES[settings.engine].languages

    def _bucket(self) -> TokenBucket | None:
        settings = self.settings
        if settings.rate_limit_factor <= 0:
            return None
        return TokenBucket(settings.rate_limit_factor, settings.rate_limit_burst_s)

    # ---- sessions -------------------------------------------------------------------

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

    def _final_sent(self, session: str, final: Result) -> None:
        """Where the last final sent to a Socket.IO client ends (what a lost session took
        with it starts there)."""
        if session in self.held:
            self.final_ends[session] = max(self.final_ends.get(session, 0.0),
                                           float(final.get("end", 0.0)))

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

    def touch(self, conn: Connection) -> None:
        """The session's client is there (a keep-alive of any face): the sweeper counts it
        as activity. A store that fails is logged; the keep-alive only lapses."""
        try:
            self.bus.touch_session(conn.session)
        except redis.RedisError as exc:
            metrics.REDIS_ERRORS.inc()
            log.warning("keepalive of %s not stored: %s", conn.session, exc)

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
