"""Every Prometheus metric cosyvoice exports, and how each server exposes them.

The gateway serves ``/metrics`` on its own port; under gunicorn it adds up every process
of the instance (prometheus_client's multi-process mode, directory chosen by
``gunicorn.conf.py``). An ASR worker pool serves its own ``/metrics`` on
``COSYVOICE_WORKER_METRICS_PORT``, adding up its worker processes the same way: workers
run on other hosts than gateways, so they cannot share a registry with them.

Import this module only after ``metrics_dir.choose`` (in a multi-process server): the
metrics below are created at import, in the mode prometheus_client picks then.
"""

from __future__ import annotations

import functools
import os
import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.multiprocess import MultiProcessCollector

from . import metrics_dir
from .wire.codecs import CODECS
from .wire.errors import ERROR_CODES

# ---- gateway ----------------------------------------------------------------------------

SESSIONS_ACTIVE = Gauge(
    "cosyvoice_sessions_active", "Sessions this gateway instance holds for a client (every face)",
    multiprocess_mode="livesum")
CHUNKS_ACCEPTED = Counter(
    "cosyvoice_chunks_accepted", "Audio chunks acked: stored, or a duplicate of a stored one",
    ["result"])
CHUNKS_REJECTED = Counter(
    "cosyvoice_chunks_rejected", "Audio chunks refused, by wire error code", ["code"])
ACK_SECONDS = Histogram(
    "cosyvoice_chunk_ack_seconds", "From a chunk's arrival to its ack (stored in Redis)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
AUDIO_BYTES = Counter(
    "cosyvoice_audio_bytes", "Bytes of audio_chunk payloads stored, by codec", ["codec"])
AUDIO_SECONDS = Counter(
    "cosyvoice_audio_seconds", "Seconds of audio stored, by codec (bytes over seconds: "
    "what a second of audio costs on the wire)", ["codec"])
ABR_SWITCHES = Counter(
    "cosyvoice_abr_switches", "switch_down and switch_up told to clients, by direction and "
    "reason (congestion, probe, probe_failed)", ["direction", "reason"])
ABR_RUNG_SECONDS = Counter(
    "cosyvoice_abr_rung_seconds", "Seconds of audio stored from clients that follow switches, "
    "by the rung it came on (pcm16, opus32, ...)", ["rung"])
ABR_QUEUE_DELAY = Histogram(
    "cosyvoice_abr_queue_delay_seconds",
    "Estimated queueing delay of each chunk from a client that follows switches: its one-way "
    "delay above the lowest of the last 10 minutes",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0))
SERVICE_SESSIONS = Gauge(
    "cosyvoice_service_sessions", "Open sessions of the whole service (admitted, not ended), "
    "read from Redis at the scrape", multiprocess_mode="mostrecent")
SERVICE_CAPACITY = Gauge(
    "cosyvoice_service_capacity", "Sessions the live ASR workers admit in all, read from "
    "Redis at the scrape", multiprocess_mode="mostrecent")
SERVICE_LOAD = Gauge(
    "cosyvoice_service_load_ratio", "Open sessions over the workers' capacity (1: full, new "
    "sessions are refused): what an autoscaler scales the workers on",
    multiprocess_mode="mostrecent")

# ---- worker -----------------------------------------------------------------------------

DECODE_LAG = Histogram(
    "cosyvoice_decode_lag_seconds",
    "From a chunk entering its audio stream to the results it produced being published",
    buckets=(0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0))
WORKER_SESSIONS = Gauge(
    "cosyvoice_worker_sessions", "Sessions this pool's worker processes are decoding",
    multiprocess_mode="livesum")
WORKER_CAPACITY = Gauge(
    "cosyvoice_worker_capacity", "Sessions this pool's worker processes can decode at once",
    multiprocess_mode="livesum")
DECODE_WAIT = Histogram(
    "cosyvoice_decode_wait_seconds",
    "whisper-live decode scheduler: from a decode's hand-over to the start of its decode "
    "(kind: final, or partial, timed from the session's oldest waiting partial)", ["kind"],
    buckets=(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0,
             3.0, 5.0, 10.0))
AUDIO_BY_KEY = Counter(
    "cosyvoice_audio_seconds_by_key",
    "Audio seconds stored, by the client's key name or token subject (anonymous without "
    "authentication)", ["key"])
DECODE_FINAL = Histogram(
    "cosyvoice_decode_final_seconds",
    "whisper-live decode scheduler: from a final's hand-over to its text (its queue wait "
    "plus its decode)",
    buckets=(0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.75, 1.0, 1.5, 2.0,
             3.0, 5.0, 10.0))
DECODE_BUSY = Gauge(
    "cosyvoice_decode_busy_ratio",
    "whisper-live decode schedulers: fraction of the time decoding, added up over the "
    "pool's processes (at most one per process)", multiprocess_mode="livesum")
SPEAKER_CPU = Counter(
    "cosyvoice_speaker_embed_cpu_seconds",
    "CPU seconds the speaker embedder threads spent on voice vectors (speaker labels)")
SPEAKER_AUDIO = Counter(
    "cosyvoice_speaker_embed_audio_seconds",
    "Seconds of audio the speaker embedder turned into voice vectors (finals' pieces and "
    "partials' guesses)")
SPEAKER_RELABELS = Counter(
    "cosyvoice_speaker_relabels", "relabel messages: a later final moved an earlier one to "
    "another speaker")
OPUS_UNDECODABLE = Counter(
    "cosyvoice_opus_packets_undecodable",
    "Opus packets libopus refused in a worker, each decoded as silence of its length")

# ---- both -------------------------------------------------------------------------------

REDIS_ERRORS = Counter(
    "cosyvoice_redis_errors", "Redis operations that failed (unreachable, timeout, error)")
REDIS_REDIRECTIONS = Counter(
    "cosyvoice_redis_cluster_redirections",
    "Redis Cluster: a slot answered from another node (MOVED or ASK: slot_moved), or the "
    "cluster's layout read again (topology)", ["kind"])

GATEWAY_METRICS = (SESSIONS_ACTIVE, CHUNKS_ACCEPTED, CHUNKS_REJECTED, ACK_SECONDS, AUDIO_BYTES,
                   AUDIO_SECONDS, ABR_SWITCHES, ABR_RUNG_SECONDS, ABR_QUEUE_DELAY, REDIS_ERRORS,
                   REDIS_REDIRECTIONS, AUDIO_BY_KEY, SERVICE_SESSIONS, SERVICE_CAPACITY,
                   SERVICE_LOAD)
WORKER_METRICS = (DECODE_LAG, WORKER_SESSIONS, WORKER_CAPACITY, DECODE_WAIT, DECODE_FINAL,
                  DECODE_BUSY, SPEAKER_CPU, SPEAKER_AUDIO, SPEAKER_RELABELS,
                  OPUS_UNDECODABLE, REDIS_ERRORS, REDIS_REDIRECTIONS)

for _code in ERROR_CODES:
    CHUNKS_REJECTED.labels(_code)  # every code is exported from the start, at 0
for _result in ("stored", "duplicate"):
    CHUNKS_ACCEPTED.labels(_result)
for _codec in CODECS:
    AUDIO_BYTES.labels(_codec)
    AUDIO_SECONDS.labels(_codec)


def service_load(sessions: int, capacity: int) -> None:
    """The whole service's sessions and capacity (``GET /load``, a gateway's scrape)."""
    SERVICE_SESSIONS.set(sessions)
    SERVICE_CAPACITY.set(capacity)
    SERVICE_LOAD.set(sessions / capacity if capacity else 1.0)


def count_audio(codec: str, payload_bytes: int, seconds: float) -> None:
    """One stored chunk: its payload's bytes and its audio's length, under its codec."""
    AUDIO_BYTES.labels(codec).inc(payload_bytes)
    AUDIO_SECONDS.labels(codec).inc(seconds)


def counts_chunks(handler):
    """Decorates the ``audio_chunk`` handler: counts its acks by outcome and times them."""

    @functools.wraps(handler)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            ack = handler(*args, **kwargs)
        except Exception:
            CHUNKS_REJECTED.labels("internal").inc()
            raise
        if not isinstance(ack, dict) or "error" in ack:
            code = ack.get("error", "internal") if isinstance(ack, dict) else "internal"
            CHUNKS_REJECTED.labels(str(code)).inc()
        else:
            CHUNKS_ACCEPTED.labels("duplicate" if ack.get("duplicate") else "stored").inc()
            ACK_SECONDS.observe(time.perf_counter() - started)
        return ack

    return wrapper


def observe_decode_lag(entry_id: str, results: list) -> None:
    """Records how long ago the audio entry ``entry_id`` was appended, if it produced
    results. The entry id's millisecond part is Redis's clock, compared with this host's:
    keep hosts in NTP sync, or the lag is off by their difference."""
    if results:
        appended_ms = int(entry_id.split("-", 1)[0])
        DECODE_LAG.observe(max(0.0, time.time() - appended_ms / 1000))


def worker_load(sessions: int, capacity: int) -> None:
    WORKER_SESSIONS.set(sessions)
    WORKER_CAPACITY.set(capacity)


def scheduler_load(load) -> None:
    """A decode scheduler's ``Load`` since the last call (cosyvoice/asr/scheduler.py)."""
    DECODE_BUSY.set(load.busy)
    for kind, waits in (("final", load.final_waits), ("partial", load.partial_waits)):
        for wait in waits:
            DECODE_WAIT.labels(kind).observe(wait)
    for took in load.final_times:
        DECODE_FINAL.observe(took)


class _Only:
    """The families of ``source`` that belong to one server (gateway or worker)."""

    def __init__(self, source, metrics: tuple):
        self.source = source
        self.names = {family.name for m in metrics for family in m.describe()}

    def collect(self):
        return [family for family in self.source.collect() if family.name in self.names]


def exposition() -> tuple[bytes, str]:
    """(body, content type) of a gateway scrape: this process's metrics, or, in
    multi-process mode, those of every process writing to the same directory."""
    path = os.environ.get(metrics_dir.ENV)
    source: MultiProcessCollector | CollectorRegistry = (
        MultiProcessCollector(None, path) if path else REGISTRY)
    return generate_latest(_Only(source, GATEWAY_METRICS)), CONTENT_TYPE_LATEST


class _PoolCollector(MultiProcessCollector):
    """Adds up a worker pool's processes; forgets the live gauges of dead ones first."""

    def collect(self):
        metrics_dir.prune_dead(self._path)
        return super().collect()


def serve_pool(host: str, port: int) -> None:
    """Serves the worker pool's metrics from a thread of the pool's parent process.

    The forked worker processes close their copy of the listening socket, so the port is
    free again as soon as the parent exits, even if a worker process lingers.
    """
    registry = CollectorRegistry()
    registry.register(_Only(_PoolCollector(None, os.environ[metrics_dir.ENV]), WORKER_METRICS))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    os.register_at_fork(after_in_child=server.socket.close)
