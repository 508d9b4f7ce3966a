"""Every tunable of cosyvoice in one place, read once from ``COSYVOICE_*`` variables.

Each field's comment says why its default is what it is. CLI flags use the same names
(``--redis-url`` overrides ``COSYVOICE_REDIS_URL``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit

from .logs import is_level
from .wire.codecs import CODECS
from .wire.protocol import SUPPORTED_RATES
from .wire.registry import ENGINES, WHISPER_BACKENDS

ENV_PREFIX = "COSYVOICE_"


class SettingsError(ValueError):
    """A setting that cannot be used; the message names its COSYVOICE_* variable."""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class Settings:
    # Redis URL; empty means `cosyvoice serve` starts an embedded redis-server. With
    # redis_cluster, one or more comma-separated seed nodes of the cluster.
    redis_url: str = ""
    # Connect to a Redis Cluster (redis-py's RedisCluster) instead of one Redis.
    redis_cluster: bool = False
    # CA certificates (PEM) that verify the Redis servers' TLS certificates, for
    # rediss:// URLs; empty: the system's CAs.
    redis_ca_file: str = ""
    # Gateway bind address and port.
    host: str = "127.0.0.1"
    port: int = 5000
    # Gateway processes per gunicorn instance (gunicorn.conf.py). The gateway is
    # WebSocket-only, so each connection lives in one process and any number works.
    gateway_processes: int = 1
    # Seconds gunicorn lets a gateway process stay silent before it replaces it.
    gateway_timeout_s: int = 30
    # Seconds a stopping gateway process gets to finish its requests; live streams do
    # not end by themselves, their clients resume on another process after the close.
    gateway_graceful_timeout_s: int = 10
    # ASR worker processes `serve` starts; 0 means one per core (decoding is CPU-bound).
    workers: int = 0
    # Sessions one worker process decodes at once; 0 takes the engine's own, measured on
    # a 2-core host (docs/engines.md, "Capacity": whisper-live 6, PocketSphinx 6, 2-pass 1).
    # `cosyvoice worker --calibrate` measures this host and prints the value to set here.
    # Admission control refuses sessions beyond it instead of letting latency grow.
    worker_capacity: int = 0
    # Port on which `cosyvoice worker` serves its pool's Prometheus metrics (on
    # COSYVOICE_HOST); 0 turns it off, so several pools on one host never collide.
    worker_metrics_port: int = 0
    # Recogniser engine: "whisper-live" (Whisper tiny.en partials and finals,
    # cosyvoice/asr/live_engine.py: a third of PocketSphinx's word errors, docs/engines.md);
    # "pocketsphinx" (the low-cost engine); "2pass" (Whisper base finals after a first pass,
    # see twopass_partials; a session may also ask for "pocketsphinx" or "whisper" finals
    # only); "whisper" (the
    # same models, sessions default to Whisper finals without partials); or "null"
    # (transport benchmarks only).
    engine: str = "whisper-live"
    # whisper-live: the open utterance is decoded again for a partial once this much new
    # audio has arrived and as long has passed (docs/engines.md, "Partial interval").
    live_partial_interval_s: float = 1.0
    # whisper-live with the decode scheduler: under load every session's partials are
    # spaced out (cosyvoice/asr/cadence.py), down to one per this many seconds of speech
    # (docs/engines.md, "Partials under load"); set it to live_partial_interval_s for a
    # fixed cadence.
    live_partial_floor_s: float = 1.5
    # ... until partials and finals keep the decode scheduler busy this fraction of the time
    live_partial_busy: float = 0.8
    # whisper-live: beam width of finals (1 is greedy); partials are always greedy. Beam 5
    # costs little more than greedy on short utterances and fixes words (docs/engines.md).
    live_beam_size: int = 5
    # whisper-live: the shortest encoder window (s) a partial is decoded in (each gets
    # max(this, utterance + 2 s)); tiny.en starts repeating itself in shorter windows
    # (docs/engines.md, "Partial window").
    live_partial_window_s: float = 7.5
    # whisper-live: an utterance longer than this ends at the first chunk that ends in a
    # pause, so no utterance outgrows Whisper's 30 s window (hard cut: max_utterance_s).
    live_pause_cut_s: float = 12.0
    # whisper-live: the CTranslate2 Whisper directory that decodes every language but
    # English (small, medium, large-v3, distil, ... for the day the weights are here);
    # empty: the packaged Whisper base (docs/languages.md).
    multilingual_model: str = ""
    # whisper-live, auto sessions in English: a tiny.en final whose average log-probability
    # is under this is checked with the multilingual model's language detection (English
    # speech gave -0.04 to -0.33 on the fixtures, Mandarin -0.86 to -1.39; docs/languages.md).
    language_recheck_logprob: float = -0.5
    # Whisper backend for finals: "torch" (openai-whisper on the memory-mapped checkpoint)
    # or "ctranslate2" (faster-whisper, int8).
    whisper_backend: str = "torch"
    # Threads each worker process gives Whisper: decoding runs one session at a time per
    # process, and the processes already use every core.
    whisper_threads: int = 1
    # whisper-live: the most partial re-decodes the worker process's decode scheduler runs
    # as one batch (cosyvoice/asr/scheduler.py; finals first, partials coalesced). 0: no
    # scheduler, each session decodes in the worker's loop, one after the other (the
    # unbatched baseline of benchmarks/batching.py; docs/engines.md, "Decode scheduler").
    decode_batch: int = 4
    # whisper-live with the decode scheduler and no COSYVOICE_WORKER_CAPACITY: the capacity
    # a worker process advertises follows its scheduler (cosyvoice/asr/admission.py,
    # docs/engines.md "Admission"): it admits no new session while the P95 of its finals'
    # waits in the decode queue (hand-over to the start of the decode) is over
    # final_wait_target_ms or that of its sessions' waits for a partial decode over
    # partial_wait_target_ms, or that of its finals' times from hand-over to text (the wait
    # plus the decode: a multilingual model's final decodes longer) over final_target_ms
    # (0: not judged), and otherwise fills up to the sessions that keep the scheduler busy
    # decode_busy_target of the time.
    final_wait_target_ms: int = 300
    final_target_ms: int = 400
    # speaker labels (cosyvoice/text/speakers/, docs/speakers.md): a piece of speech joins the
    # nearest speaker met so far at this cosine similarity or more, else starts a new one
    speaker_join: float = 0.78
    # where voice vectors are computed: "thread" (a thread of each worker process, while
    # the final's text decodes) or "inline" (in the worker's loop; measured slower)
    speaker_embedder: str = "thread"
    partial_wait_target_ms: int = 400
    decode_busy_target: float = 0.6
    # 2pass engine: where the partials (and endpoints) of the "2pass" and "whisper" modes
    # come from: "whisper-live" (Whisper tiny.en: 0.65x the CPU of PocketSphinx's, measured
    # in docs/engines.md, "2-pass partials") or "pocketsphinx"; the finals are Whisper base
    # either way.
    twopass_partials: str = "whisper-live"
    # torch backend on the CPU: bf16 arithmetic inside fp32 matrix products where the CPU
    # has bf16 instructions (weights stay fp32 and shared); 32 % less CPU per final.
    whisper_cpu_bf16: bool = True
    # torch backend: the shortest encoder window (seconds) a final is decoded in; each
    # final gets the smallest window that holds it plus 1 s, at least this. 0 decodes
    # every final in Whisper's full 30 s window. 10 s: the measured floor with a margin
    # (docs/benchmarks.md, "Encoder window").
    whisper_window_floor_s: int = 10
    # torch backend on a CPU with bf16 instructions: the text decoder reads int8 weights
    # (one scale per row; output projection included), kept in a mapped file beside the
    # checkpoint (cosyvoice/asr/int8_decoder.py; docs/benchmarks.md, "int8 decoder").
    whisper_int8_decoder: bool = True
    # Niceness of each worker process's finals process (cosyvoice/text/finals.py): Whisper
    # finals are decoded beside the partials, at this lower CPU priority, so a busy
    # machine gives the partials the CPU first. 0 decodes them at the loop's priority.
    finals_nice: int = 5
    # Where the neural engines decode: "cpu", "cuda", or "auto" (CUDA where a GPU is
    # visible: CTranslate2's device count, torch's for the torch backend). Whisper-live,
    # both 2-pass backends and `--calibrate` follow it (docs/engines.md, "Devices").
    device: str = "auto"
    # CTranslate2 compute type (whisper-live, the ctranslate2 2-pass backend): "auto" is
    # int8 on the CPU and int8_float16 on CUDA; any type CTranslate2 offers on the device.
    compute_type: str = "auto"
    # An official openai-whisper checkpoint to use instead of the bundled model data.
    whisper_checkpoint: str = ""
    # Where converted model files are cached; empty means ~/.cache/cosyvoice/models
    # (or COSYVOICE_MODEL_DIR, which this setting is).
    model_dir: str = ""
    # Seconds a disconnected session's keys live, so a client can resume.
    session_grace_s: float = 30.0
    # Lease on a session: a dead worker's sessions are taken over after this.
    lease_ttl_ms: int = 5000
    # How often an owner renews its leases and heartbeat (well under the TTL).
    lease_renew_ms: int = 1000
    # How often a worker looks for announcements whose owner died (placement's orphan check).
    claim_interval_ms: int = 1000
    # Approximate cap of the audio and result streams: 1000 chunks = 200 s of audio.
    stream_maxlen: int = 1000
    # Result streams live this long after their last write, for replay after reconnect.
    result_ttl_s: int = 600
    # Largest chunk accepted, in milliseconds of audio (chunks are 200 ms).
    max_chunk_ms: int = 1000
    # Sample rate of a session whose client names none.
    default_sample_rate: int = 16000
    # Codecs the gateway accepts in a chunk, comma-separated: pcm16 (raw samples), opus
    # (20 ms packets of 16 kHz speech, a seventh of PCM's bytes: docs/protocol.md).
    codecs: str = "pcm16,opus"
    # Opus bitrates (bit/s) a client may ask for in `auth.bitrate`, best first: the rungs
    # whose accuracy cost was measured (docs/benchmarks.md, "Opus").
    opus_bitrates: str = "32000,24000,16000,12000"
    # Adaptive bitrate: a client that says it follows (`auth.abr`) starts on the rung its
    # network hint allows and is told to switch rungs (PCM, Opus at each bitrate) as its
    # link's queueing delay says (cosyvoice/wire/abr.py, docs/protocol.md). Clients that do not
    # say `auth.abr` are never switched; false judges nothing for any client.
    abr: bool = True
    # Connections one gateway process may open to Redis (redis-py stops at 100).
    redis_max_connections: int = 512
    # Longest utterance before a forced final, so long speech cannot stall a decoder.
    max_utterance_s: float = 20.0
    # Endpointer: window (s) and the fraction of it that flips speech/non-speech.
    endpoint_window_s: float = 0.3
    endpoint_ratio: float = 0.9
    # Audio decoded from before the endpointer's detected start, so onsets survive.
    endpoint_preroll_s: float = 0.25
    # Origins allowed to open a Socket.IO connection; empty means the page's own origin.
    allowed_origins: str = ""
    # Secret that signs client tokens; empty turns token auth off.
    auth_secret: str = ""
    # Lifetime of a client token issued by `cosyvoice token`.
    token_ttl_s: int = 3600
    # A file of named API keys, one "NAME SHA256" line each (`cosyvoice key new NAME`
    # adds one); empty: no keys. With keys or a secret, every client must bring one
    # (cosyvoice/gateway/apikeys.py, docs/protocol.md "Keys and usage").
    api_keys_file: str = ""
    # Sustained audio a connection may send per second of wall time (0 turns the limit
    # off, e.g. for trusted file transcription); twice real time leaves room to catch up.
    rate_limit_factor: float = 2.0
    # Audio seconds a connection may send at once on top of the rate: resends after a
    # reconnect within the grace period.
    rate_limit_burst_s: float = 30.0
    # Longest session, in seconds of audio and of wall time; a day of dictation at most.
    max_session_s: float = 14400.0
    # Concurrent sessions one client address may hold (0 = unlimited).
    max_sessions_per_client: int = 20
    # The largest share of the live workers' capacity one client (its API key or token
    # subject, else its address) may hold at once, at least one session; 1 turns it off.
    # Half: no one client takes every worker (docs/security.md, "Fair share").
    client_share: float = 0.5
    # Proxies in front of the gateway whose X-Forwarded-For is trusted (nginx: 1).
    trusted_proxies: int = 0
    # Sessions whose audio stream saw no new entry for this long are deleted by the sweeper.
    sweep_idle_s: float = 300.0
    # A connected client that sends neither audio nor `keepalive` for this long (and has
    # not sent its last chunk) gets `idle_timeout`: its session ends and it is
    # disconnected (docs/protocol.md, "Keep-alive"). 0: never.
    idle_timeout_s: float = 60.0
    # A Deepgram /v1/listen connection that sends neither audio nor KeepAlive for this long
    # is closed (1011 NET-0001), as Deepgram's are after 10 s (docs/deepgram.md). 0: never.
    listen_idle_timeout_s: float = 10.0
    # An OpenAI /v1/realtime connection that sends no event for this long gets an `error`
    # (`idle_timeout`) and is closed 1000; its session waits for a resume (docs/openai.md).
    # 0: never.
    realtime_idle_timeout_s: float = 60.0
    # The most seconds one WebSocket frame's payload (on every face) may take to arrive
    # once its header is read, plus a second per 64 KiB it announces: a client that
    # announces a frame and then stalls is closed 1008 (docs/security.md). 0: no limit.
    frame_timeout_s: float = 30.0
    # How long a client told `overloaded` should wait before it tries again.
    overload_retry_ms: int = 2000
    # The largest upload POST /v1/audio/transcriptions takes (OpenAI's limit: 25 MB);
    # larger ones are answered 413 (docs/openai.md).
    max_upload_mb: int = 25
    # The largest WebSocket message (one frame, or a frame and its continuations) each raw
    # WebSocket face reads, in KiB: a frame whose header announces more is refused with
    # close 1009 before its payload is read (cosyvoice/gateway/wsframes.py, docs/security.md). An
    # OpenAI Realtime event (a 100 ms append is 6.4 KB of base64) ...
    max_message_kb_realtime: int = 1024
    # ... and a Deepgram /v1/listen frame (250 ms of 48 kHz stereo float audio is 96 KB).
    # Socket.IO's follows COSYVOICE_MAX_CHUNK_MS (the largest chunk, its envelope and the
    # auth) and HTTP bodies COSYVOICE_MAX_UPLOAD_MB.
    max_message_kb_listen: int = 1024
    # Logging level of every process.
    log_level: str = "INFO"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "Settings":
        """Settings from ``COSYVOICE_*`` variables, then non-None ``overrides`` on top."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                # the annotation's text (``from __future__ import annotations``)
                values[f.name] = _parse(f.name, str(f.type), raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values).validate()

    def validate(self) -> "Settings":
        """These settings, or SettingsError naming the first one no process can run with."""
        for name, (ok, expected) in _RULES.items():
            value = getattr(self, name)
            if not ok(value):
                raise SettingsError(f"{ENV_PREFIX}{name.upper()}={value!r}: "
                                    f"expected {expected}")
        if self.redis_cluster and not self.redis_url:
            raise SettingsError(f"{ENV_PREFIX}REDIS_CLUSTER=true needs {ENV_PREFIX}REDIS_URL: "
                                "the cluster's seed nodes (the embedded Redis is one node)")
        if not self.redis_cluster and "," in self.redis_url:
            raise SettingsError(f"{ENV_PREFIX}REDIS_URL={self.redis_url!r}: several nodes "
                                f"are seeds of a cluster; set {ENV_PREFIX}REDIS_CLUSTER=true")
        if self.lease_renew_ms >= self.lease_ttl_ms:
            raise SettingsError(f"{ENV_PREFIX}LEASE_RENEW_MS={self.lease_renew_ms} must be "
                                f"less than {ENV_PREFIX}LEASE_TTL_MS={self.lease_ttl_ms}")
        return self

    def as_env(self) -> dict[str, str]:
        """These settings as environment variables, for child processes."""
        return {ENV_PREFIX + k.upper(): _format(v) for k, v in dataclasses.asdict(self).items()}

    @property
    def accepted_codecs(self) -> tuple[str, ...]:
        return tuple(c.strip() for c in self.codecs.split(",") if c.strip())

    @property
    def opus_bitrate_list(self) -> tuple[int, ...]:
        return tuple(int(b) for b in self.opus_bitrates.split(",") if b.strip())

    def replace(self, **changes) -> "Settings":
        return dataclasses.replace(self, **changes)


def _parse(name: str, type_name: str, raw: str) -> bool | int | float | str:
    try:
        if type_name == "bool":
            low = raw.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError(raw)
        if type_name == "int":
            return int(raw)
        if type_name == "float":
            return float(raw)
    except ValueError as exc:
        raise SettingsError(f"{ENV_PREFIX}{name.upper()}={raw!r}: expected {_KINDS[type_name]}"
                            ) from exc
    return raw


_KINDS = {"bool": "true or false", "int": "a whole number", "float": "a number"}


def _redis_url(urls: str) -> bool:
    return all(_one_redis_url(url) for url in urls.split(",")) if urls else True


def _one_redis_url(url: str) -> bool:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError on a bad port)
    except ValueError:
        return False
    if parts.scheme == "unix":
        return bool(parts.path)
    return parts.scheme in ("redis", "rediss") and bool(parts.hostname)


def _opus_bitrate(text: str) -> bool:
    try:
        return 6000 <= int(text) <= 128000
    except ValueError:
        return False


def _at_least(low: float) -> tuple[Callable, str]:
    return (lambda v: v >= low), f"a number of at least {low:g}"


def _more_than(low: float) -> tuple[Callable, str]:
    return (lambda v: v > low), f"a number greater than {low:g}"


def _one_of(*choices) -> tuple[Callable, str]:
    return (lambda v: v in choices), "one of " + ", ".join(repr(c) for c in choices)


# What each setting may be; values outside these stop a process before it starts.
_RULES: dict[str, tuple[Callable, str]] = {
    "redis_ca_file": ((lambda v: v == "" or os.path.isfile(v)), "a readable PEM file, or empty"),
    "redis_url": (_redis_url, "redis://host:port[/db], rediss://... or unix:///path "
                              "(empty: embedded Redis; a cluster's seeds separated by commas)"),
    "port": ((lambda v: 1 <= v <= 65535), "a port from 1 to 65535"),
    "worker_metrics_port": ((lambda v: 0 <= v <= 65535), "a port from 1 to 65535, or 0"),
    "gateway_processes": _at_least(1),
    "gateway_timeout_s": _at_least(1),
    "gateway_graceful_timeout_s": _at_least(0),
    "workers": _at_least(0),
    "worker_capacity": _at_least(0),
    "engine": _one_of(*ENGINES),
    "live_partial_interval_s": _more_than(0),
    "live_partial_floor_s": _more_than(0),
    "live_partial_busy": ((lambda v: 0 < v <= 1), "a fraction above 0, at most 1"),
    "live_beam_size": _at_least(1),
    "live_partial_window_s": ((lambda v: 5 <= v <= 30), "seconds from 5 to 30"),
    "live_pause_cut_s": _more_than(0),
    "multilingual_model": ((lambda v: v == "" or os.path.isfile(os.path.join(v, "model.bin"))),
                           "a CTranslate2 Whisper directory (with model.bin), or empty"),
    "language_recheck_logprob": ((lambda v: v <= 0), "a log-probability, at most 0"),
    "whisper_backend": _one_of(*WHISPER_BACKENDS),
    "whisper_threads": _at_least(1),
    "device": _one_of("auto", "cpu", "cuda"),
    "compute_type": _one_of("auto", "int8", "int8_float32", "int8_float16", "int8_bfloat16",
                            "int16", "float16", "bfloat16", "float32"),
    "decode_batch": _at_least(0),
    "final_wait_target_ms": _at_least(1),
    "final_target_ms": _at_least(0),
    "speaker_join": ((lambda v: 0 < v < 1), "a similarity above 0, under 1"),
    "speaker_embedder": _one_of("thread", "inline"),
    "partial_wait_target_ms": _at_least(1),
    "decode_busy_target": ((lambda v: 0 < v <= 1), "a fraction above 0, at most 1"),
    "twopass_partials": _one_of("pocketsphinx", "whisper-live"),
    "finals_nice": ((lambda v: 0 <= v <= 19), "a niceness from 0 to 19"),
    "whisper_window_floor_s": ((lambda v: v == 0 or 1 <= v <= 30), "0, or seconds from 1 to 30"),
    "session_grace_s": _at_least(0),
    "lease_ttl_ms": _at_least(100),
    "lease_renew_ms": _at_least(10),
    "claim_interval_ms": _at_least(10),
    "stream_maxlen": _at_least(10),
    "result_ttl_s": _at_least(1),
    "max_chunk_ms": _at_least(200),
    "default_sample_rate": _one_of(*SUPPORTED_RATES),
    "codecs": (lambda v: bool(v.strip()) and all(c.strip() in CODECS for c in v.split(",")),
               "codecs from " + ", ".join(CODECS) + ", comma-separated"),
    "opus_bitrates": (lambda v: bool(v.strip()) and all(_opus_bitrate(b) for b in v.split(",")),
                      "bitrates in bit/s from 6000 to 128000, comma-separated"),
    "redis_max_connections": _at_least(1),
    "max_utterance_s": _more_than(0),
    "endpoint_window_s": _more_than(0),
    "endpoint_ratio": ((lambda v: 0 < v <= 1), "a fraction above 0, at most 1"),
    "endpoint_preroll_s": _at_least(0),
    "token_ttl_s": _at_least(1),
    "rate_limit_factor": _at_least(0),
    "rate_limit_burst_s": _at_least(0),
    "max_session_s": _more_than(0),
    "max_sessions_per_client": _at_least(0),
    "client_share": ((lambda v: 0 < v <= 1), "a fraction above 0, at most 1"),
    "trusted_proxies": _at_least(0),
    "sweep_idle_s": _more_than(0),
    "overload_retry_ms": _at_least(0),
    "idle_timeout_s": _at_least(0),
    "listen_idle_timeout_s": _at_least(0),
    "realtime_idle_timeout_s": _at_least(0),
    "frame_timeout_s": _at_least(0),
    "max_upload_mb": _at_least(1),
    "max_message_kb_realtime": _at_least(16),
    "max_message_kb_listen": _at_least(16),
    "log_level": (is_level, "DEBUG, INFO, WARNING, ERROR or CRITICAL"),
}


def _format(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
