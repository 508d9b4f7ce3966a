"""Pure admission rules: the connect-time ``auth`` dict and the per-connection rate limit."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from ..text import speakers
from ..wire.codecs import OPUS, PCM16
from ..wire.errors import (
    CosyvoiceError,
    Unauthorized,
    UnsupportedCodec,
    UnsupportedLanguage,
    UnsupportedMode,
    UnsupportedRate,
)
from ..wire.languages import ENGLISH, SCRIPTS
from ..wire.protocol import SUPPORTED_RATES

# Largest auth dict accepted, serialised as JSON.
MAX_AUTH_BYTES = 4096
# auth.prompt: Whisper reads the end of it (cosyvoice/text/finals.py, PROMPT_MAX_CHARS)
MAX_PROMPT_CHARS = 500
# auth.endpoint_ms: the silence that ends an utterance, in ms (the endpointer judges 32 ms
# frames: under 64 ms counts as 64)
ENDPOINT_MS = (10, 5000)
_SESSION_ID = re.compile(r"^[0-9a-f]{24}$")
_RESULT_ID = re.compile(r"^\d{1,20}-\d{1,20}$")


@dataclass(frozen=True)
class ConnectRequest:
    """What a client asked for when it connected, validated."""

    sample_rate: int | None = None
    token: str | None = None
    session: str | None = None
    last_result: str | None = None
    network_hint: dict | None = None
    mode: str | None = None
    codec: str | None = None
    bitrate: int | None = None
    abr: bool = False  # the client follows switch_down and switch_up
    language: str | None = None  # "auto" or a language code (cosyvoice/wire/languages.py)
    script: str | None = None  # Chinese script: "hans" (Simplified) or "hant"
    format: bool = False  # numbers, dates, times and money as digits
    prompt: str | None = None  # text the session's Whisper decodes follow (names, terms)
    # turn control: partials sent (False: finals only), the silence that ends an utterance
    # (None: the server's), a speech_started event at each start of speech
    interim: bool = True
    endpoint_ms: int | None = None
    speech_events: bool = False
    # speaker labels: the fields stored with the session (cosyvoice/text/speakers/,
    # ``diarize``, ``min_speakers``, ``max_speakers``), empty when not asked
    diarize: tuple[tuple[str, str], ...] = ()


def parse_auth(auth, modes: tuple[str, ...] = (), codecs: tuple[str, ...] = (PCM16,),
               bitrates: tuple[int, ...] = (),
               languages: tuple[str, ...] = (ENGLISH,)) -> ConnectRequest:
    """Validate the Socket.IO ``auth`` payload; raises ``Unauthorized``, ``UnsupportedRate``,
    ``UnsupportedMode`` (a ``mode`` that is not one of ``modes``, the engine's offer),
    ``UnsupportedLanguage`` (a ``language`` not in ``languages``, or a ``script`` that is
    not one of ``SCRIPTS``) or ``UnsupportedCodec`` (a ``codec`` not in ``codecs``, or an
    Opus ``bitrate`` not in ``bitrates``: the server's offer).

    Unknown keys are ignored (newer clients may send more); known keys must have the
    documented types.
    """
    if auth is None:
        return ConnectRequest()
    if not isinstance(auth, dict):
        raise Unauthorized("auth must be an object")
    try:
        size = len(json.dumps(auth))
    except (TypeError, ValueError) as exc:
        raise Unauthorized("auth is not JSON") from exc
    if size > MAX_AUTH_BYTES:
        raise Unauthorized(f"auth is larger than {MAX_AUTH_BYTES} bytes")
    rate = auth.get("sample_rate")
    if rate is not None and (type(rate) is not int or rate not in SUPPORTED_RATES):
        raise UnsupportedRate(f"sample_rate must be one of {SUPPORTED_RATES}")
    token = _optional_str(auth, "token", 2048)
    session = _optional_str(auth, "session", 64)
    if session is not None and not _SESSION_ID.match(session):
        raise Unauthorized("session is not a session id")
    last_result = _optional_str(auth, "last_result", 64)
    if last_result is not None and not _RESULT_ID.match(last_result):
        raise Unauthorized("last_result is not a result id")
    hint = auth.get("network_hint")
    if hint is not None and not isinstance(hint, dict):
        raise Unauthorized("network_hint must be an object")
    mode = _optional_str(auth, "mode", 32)
    if mode is not None and mode not in modes:
        raise UnsupportedMode(f"mode must be one of {list(modes)} on this server")
    codec, bitrate = _codec(auth, codecs, bitrates)
    abr = _flag(auth, "abr")
    language = _optional_str(auth, "language", 16)
    if language is not None and language not in languages:
        shown = list(languages) if len(languages) < 8 else "GET /config"
        raise UnsupportedLanguage(f"language {language!r} is not offered on this server: "
                                  f"see {shown}")
    script = _optional_str(auth, "script", 8)
    if script is not None and script not in SCRIPTS:
        raise UnsupportedLanguage(f"script must be one of {list(SCRIPTS)}")
    prompt = _optional_str(auth, "prompt", MAX_PROMPT_CHARS)
    return ConnectRequest(rate, token, session, last_result, hint, mode, codec, bitrate, abr,
                          language, script, _flag(auth, "format"), prompt, *_turn(auth),
                          _diarize(auth))


def _diarize(auth: dict) -> tuple[tuple[str, str], ...]:
    """``diarize`` and the number of speakers, as the session's stored fields."""
    diarize, problem = speakers.parse_auth(auth)
    if problem:
        raise Unauthorized(problem)
    return tuple(diarize.items())


def _turn(auth: dict) -> tuple[bool, int | None, bool]:
    """``interim``, ``endpoint_ms`` and ``speech_events`` of the auth payload."""
    interim = auth.get("interim", True)
    if not isinstance(interim, bool):
        raise Unauthorized("interim must be true or false")
    endpoint_ms = auth.get("endpoint_ms")
    if endpoint_ms is not None and (type(endpoint_ms) is not int
                                    or not ENDPOINT_MS[0] <= endpoint_ms <= ENDPOINT_MS[1]):
        raise Unauthorized(f"endpoint_ms must be an integer from {ENDPOINT_MS[0]} to "
                           f"{ENDPOINT_MS[1]}")
    return interim, endpoint_ms, _flag(auth, "speech_events")


def _flag(auth: dict, key: str) -> bool:
    value = auth.get(key, False)
    if type(value) is not bool:
        raise Unauthorized(f"{key} must be true or false")
    return value


def _codec(auth: dict, codecs: tuple[str, ...],
           bitrates: tuple[int, ...]) -> tuple[str | None, int | None]:
    """``auth.codec`` and ``auth.bitrate``, checked against the server's offer."""
    codec = _optional_str(auth, "codec", 16)
    if codec is not None and codec not in codecs:
        raise UnsupportedCodec(f"codec must be one of {list(codecs)} on this server")
    bitrate = auth.get("bitrate")
    if bitrate is not None:
        if codec != OPUS:
            raise UnsupportedCodec("bitrate goes with codec opus")
        if type(bitrate) is not int or bitrate not in bitrates:
            raise UnsupportedCodec(f"bitrate must be one of {list(bitrates)} on this server")
    return codec, bitrate


def _optional_str(auth: dict, key: str, max_len: int) -> str | None:
    value = auth.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise Unauthorized(f"{key} must be a non-empty string of at most {max_len} characters")
    return value


class TokenBucket:
    """Audio-seconds budget of one connection: ``rate`` seconds of audio per second of
    wall time, up to ``burst`` seconds banked (resends after a reconnect)."""

    def __init__(self, rate: float, burst: float, now: float | None = None):
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = time.monotonic() if now is None else now

    def take(self, amount: float, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if amount > self.tokens:
            return False
        self.tokens -= amount
        return True


__all__ = ["ConnectRequest", "parse_auth", "TokenBucket", "CosyvoiceError"]


class BodyTooLarge(Exception):
    """A request body passed its limit (announced, or counted as it streamed)."""

    def __init__(self, limit: int):
        super().__init__(f"the request body is larger than {limit} bytes")
        self.limit = limit


class BadBody(Exception):
    """A request body that could not be read (a bad chunk, a connection cut mid-body)."""


def read_body(environ: dict, limit: int, piece: int = 64 * 1024) -> bytes:
    """A request's whole body, counted as it streams (chunked or with a Content-Length):
    ``BodyTooLarge`` as soon as it passes ``limit`` bytes, never a body cut short at the
    limit (Werkzeug's ``get_data`` under ``MAX_CONTENT_LENGTH`` stops at the limit and
    answers the first ``limit`` bytes of a chunked body as if they were all of it);
    ``BadBody`` for a body that cannot be read."""
    announced = environ.get("CONTENT_LENGTH") or ""
    if announced.isdigit() and int(announced) > limit:
        raise BodyTooLarge(limit)  # nothing of it is read
    stream = environ["wsgi.input"]
    parts: list[bytes] = []
    total = 0
    while True:
        try:
            data = stream.read(min(piece, limit + 1 - total))
        except (OSError, ValueError) as exc:  # a chunked body cut short or malformed
            raise BadBody(f"the request body is malformed: {exc}"[:200]) from None
        if not data:
            return b"".join(parts)
        total += len(data)
        if total > limit:
            raise BodyTooLarge(limit)
        parts.append(data)
