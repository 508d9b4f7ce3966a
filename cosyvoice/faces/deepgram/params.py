"""Deepgram's ``/v1/listen``, what the live and pre-recorded faces share: the query
(``Params``), the errors in Deepgram's shape (``ListenError``), who the client is, and the
shapes of ``Results``, their alternatives and ``Metadata`` (docs/deepgram.md)."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from flask import Response

from ...gateway.core import Gateway
from ...gateway.limits import (
    ENDPOINT_MS,
    MAX_PROMPT_CHARS,
)
from ...gateway.wshandler import (
    Refusal,
)
from ...wire.errors import CosyvoiceError, Overloaded, RateLimited, Unauthorized, Unavailable
from ...wire.live_audio import (
    MAX_CHANNELS,
    RAW_ENCODINGS,
)

log = logging.getLogger(__name__)

PATH = "/v1/listen"
CONTAINERS = ("opus", "ogg-opus", "flac")  # encodings that name a container: PyAV reads it
RATES = (8000, 48000)  # the sample_rate a raw encoding may have (Hz, inclusive)
UTTERANCE_END_MS = (1000, 5000)
# How far past a gap the audio clock goes before UtteranceEnd is said: the VAD calls a
# start of speech a window after it began (the endpointer's window), and its
# speech_started comes that much later.
UTTERANCE_END_SLACK_S = 0.6
# A final this close to the longest utterance was cut by length, not ended by a pause.
LENGTH_CUT_S = 0.25
ENV_KEY = "cosyvoice.listen"  # the environ entry the precheck leaves for the view
try:
    VERSION = importlib.metadata.version("cosyvoice")
except importlib.metadata.PackageNotFoundError:  # run from a checkout
    VERSION = "0"
_PUNCT = re.compile(r"[^\w'\-]+", re.UNICODE)


class ListenError(Exception):
    """A handshake refused: the HTTP status, Deepgram's ``err_code`` and the message."""

    def __init__(self, status: int, code: str, message: str, retry_after_ms: int | None = None):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.retry_after_ms = retry_after_ms

    def refusal(self, request_id: str) -> Refusal:
        reason = {400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
                  413: "Payload Too Large", 429: "Too Many Requests",
                  503: "Service Unavailable"}.get(self.status, "Error")
        body = json.dumps({"err_code": self.code, "err_msg": self.message,
                           "request_id": request_id}).encode()
        headers = [("Content-Type", "application/json"), ("dg-error", header_text(self.message)),
                   ("dg-request-id", request_id)]
        if self.status == 413:  # the rest of the body is not read: this connection ends
            headers.append(("Connection", "close"))
        if self.retry_after_ms is not None:
            headers += [("Retry-After", str(max(1, round(self.retry_after_ms / 1000)))),
                        ("retry-after-ms", str(self.retry_after_ms))]
        return f"{self.status} {reason}", headers, body

    def response(self, request_id: str) -> Response:
        status, headers, body = self.refusal(request_id)
        return Response(body, status=int(status[:3]), headers=headers)


def header_text(message: str, limit: int = 200) -> str:
    """``message`` as an HTTP header value: printable ASCII, anything else escaped (the
    message may echo what the client sent; gevent refuses a header that is not Latin-1,
    and a line break would end the header)."""
    text = "".join(c if " " <= c <= "~" else c.encode("unicode_escape").decode("ascii")
                   for c in message)
    return text[:limit]


def from_cosyvoice(err: CosyvoiceError) -> ListenError:
    if isinstance(err, Unauthorized):
        return ListenError(401, "INVALID_AUTH", err.msg)
    if isinstance(err, Overloaded):
        return ListenError(429, "TOO_MANY_REQUESTS", err.msg, err.retry_after_ms)
    if isinstance(err, RateLimited):
        return ListenError(429, "TOO_MANY_REQUESTS", err.msg, err.retry_after_ms or 1000)
    if isinstance(err, Unavailable):
        return ListenError(503, "SERVICE_UNAVAILABLE", err.msg, 1000)
    return ListenError(400, "Bad Request", err.msg)


# ---- the query ----------------------------------------------------------------------------


def flag(query: dict[str, list[str]], key: str, default: bool = False) -> bool:
    values = query.get(key)
    if not values:
        return default
    value = values[-1].strip().lower()
    if value in ("true", "1"):
        return True
    if value in ("false", "0"):
        return False
    raise ListenError(400, "Bad Request", f"{key} must be true or false")


def _int(query: dict[str, list[str]], key: str) -> int | None:
    values = query.get(key)
    if not values:
        return None
    try:
        return int(values[-1])
    except ValueError:
        raise ListenError(400, "Bad Request", f"{key} must be an integer") from None


def _language(language: str, offered: tuple[str, ...]) -> str:
    """Deepgram's ``language`` (``en``, ``en-US``, ``multi``) as a session's."""
    if language in ("", "multi"):
        return "auto" if language == "multi" and "auto" in offered else offered[0]
    base = language.split("-")[0].lower()
    if base not in offered:
        raise ListenError(400, "Bad Request",
                          f"language {language[:16]!r} is not offered on this server")
    return base


@dataclass
class Params:
    """A ``/v1/listen`` request's query, validated (docs/deepgram.md has the table)."""
    model: str = ""
    mode: str = ""
    language: str = ""
    encoding: str | None = None
    sample_rate: int | None = None
    channels: int = 1
    split: bool = False  # each channel its own session
    interim: bool = False
    endpointing: int | None = None  # ms; None: the server's
    speech_final: bool = True  # endpointing=false: never
    utterance_end_ms: int | None = None
    vad_events: bool = False
    punctuate: bool = False
    smart_format: bool = False
    diarize: bool = False
    keyterms: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, query: dict[str, list[str]], gateway: Gateway, live: bool = True) -> Params:
        p = cls()
        p.model = (query.get("model") or ["base"])[-1]
        p.mode = p.model if p.model in gateway.modes else gateway.modes[0]
        p.language = _language((query.get("language") or [""])[-1], gateway.languages)
        p._audio(query)
        p._turns(query, live)
        p.vad_events = flag(query, "vad_events")
        p.punctuate = flag(query, "punctuate")
        p.smart_format = flag(query, "smart_format")
        p.diarize = flag(query, "diarize") or bool(query.get("diarize_model"))
        p.keyterms = [k for k in query.get("keyterm", []) + query.get("keywords", []) if k][:100]
        p.tags = query.get("tag", [])[:20]
        return p

    def _audio(self, query: dict[str, list[str]]) -> None:
        p = self
        encoding = next(reversed(query.get("encoding") or []), None)
        if encoding is not None and encoding not in RAW_ENCODINGS + CONTAINERS:
            raise ListenError(400, "Bad Request", f"encoding must be one of "
                              f"{list(RAW_ENCODINGS + CONTAINERS)}, or absent for a container")
        p.encoding = encoding
        p.sample_rate = _int(query, "sample_rate")
        if encoding in RAW_ENCODINGS:
            if p.sample_rate is None:
                raise ListenError(400, "Bad Request", f"sample_rate is required with "
                                  f"encoding={encoding}")
            if not RATES[0] <= p.sample_rate <= RATES[1]:
                raise ListenError(400, "Bad Request", f"sample_rate must be from {RATES[0]} "
                                  f"to {RATES[1]} Hz")
        channels = _int(query, "channels")
        p.channels = 1 if channels is None else channels
        if not 1 <= p.channels <= MAX_CHANNELS:
            raise ListenError(400, "Bad Request", f"channels must be from 1 to {MAX_CHANNELS}")
        p.split = flag(query, "multichannel", default=True)

    def _turns(self, query: dict[str, list[str]], live: bool) -> None:
        p = self
        p.interim = flag(query, "interim_results")
        endpointing = next(reversed(query.get("endpointing") or []), None)
        if endpointing is not None:
            if endpointing.strip().lower() == "false":
                p.speech_final = False
            else:
                ms = _int(query, "endpointing")
                if ms is None or ms < 0:
                    raise ListenError(400, "Bad Request", "endpointing must be milliseconds "
                                      "or false")
                p.endpointing = min(ENDPOINT_MS[1], max(ENDPOINT_MS[0], ms))
        p.utterance_end_ms = _int(query, "utterance_end_ms")
        if p.utterance_end_ms is not None:
            if live and not p.interim:
                raise ListenError(400, "Bad Request",
                                  "utterance_end_ms needs interim_results=true")
            if not UTTERANCE_END_MS[0] <= p.utterance_end_ms <= UTTERANCE_END_MS[1]:
                raise ListenError(400, "Bad Request", f"utterance_end_ms must be from "
                                  f"{UTTERANCE_END_MS[0]} to {UTTERANCE_END_MS[1]}")

    @property
    def sessions(self) -> int:
        return self.channels if self.split else 1

    def session_auth(self, rate: int, file: bool = False) -> dict[str, Any]:
        """The cosyvoice session each channel is (its ``auth``)."""
        auth: dict[str, Any] = {"sample_rate": rate, "mode": self.mode, "language": self.language,
                                "interim": self.interim and not file,
                                "format": self.smart_format}
        if self.endpointing is not None:
            auth["endpoint_ms"] = self.endpointing
        elif not self.speech_final:  # only Finalize, the longest silence or length end them
            auth["endpoint_ms"] = ENDPOINT_MS[1]
        if (self.vad_events or self.utterance_end_ms) and not file:
            auth["speech_events"] = True
        if self.keyterms:  # Whisper reads them as its context
            auth["prompt"] = (", ".join(self.keyterms) + ".")[-MAX_PROMPT_CHARS:]
        if self.diarize:
            auth["diarize"] = "file" if file else "live"
        return auth


def credential(environ: dict) -> str | None:
    """The key of the handshake: ``Authorization: Token|Bearer KEY`` (any case), or a
    browser's ``Sec-WebSocket-Protocol: token, KEY`` (or ``bearer, JWT``)."""
    scheme, _, key = environ.get("HTTP_AUTHORIZATION", "").strip().partition(" ")
    if scheme.lower() in ("token", "bearer") and key.strip():
        return key.strip()
    offered = [p.strip() for p in environ.get("HTTP_SEC_WEBSOCKET_PROTOCOL", "").split(",")]
    for i, p in enumerate(offered[:-1]):
        if p.lower() in ("token", "bearer"):
            return offered[i + 1] or None
    return None


def client_address(environ: dict, trusted_proxies: int) -> str:
    """The client's address as Flask would see it behind ``trusted_proxies`` proxies."""
    forwarded = [a.strip() for a in environ.get("HTTP_X_FORWARDED_FOR", "").split(",")
                 if a.strip()]
    if trusted_proxies > 0 and len(forwarded) >= trusted_proxies:
        return forwarded[-trusted_proxies]
    return environ.get("REMOTE_ADDR", "")


def received(query: dict[str, list[str]]) -> float | None:
    """A resuming client's ``received``: where the last final it got ends (seconds)."""
    values = query.get("received")
    if not values:
        return None
    try:
        value = float(values[-1])
    except ValueError:
        raise ListenError(400, "Bad Request", "received must be seconds of audio") from None
    if not value >= 0:
        raise ListenError(400, "Bad Request", "received must be seconds of audio")
    return value


def model(mode: str) -> tuple[str, dict[str, str]]:
    """The ``model_uuid`` and ``model_info`` Deepgram's messages name a session mode by."""
    name = f"cosyvoice-{mode}"
    return (str(uuid.uuid5(uuid.NAMESPACE_URL, "cosyvoice:" + name)),
            {"name": name, "version": VERSION, "arch": "cosyvoice"})


def metadata(request_id: str, sha256: str, duration: float, params: Params) -> dict[str, Any]:
    """A stream's or a recording's ``Metadata``: its id, the audio's hash and seconds, its
    channels and the model."""
    model_uuid, info = model(params.mode)
    return {"transaction_key": "deprecated", "request_id": request_id, "sha256": sha256,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()),
            "duration": round(duration, 3), "channels": params.channels,
            "models": [model_uuid], "model_info": {model_uuid: info}}


def plain(word: str) -> str:
    """Deepgram's ``word``: lower case, no punctuation around it."""
    return _PUNCT.sub("", word).strip("'-").lower()


def speaker_number(label: str | None) -> int | None:
    """``S1`` → 0: Deepgram numbers speakers from 0."""
    if not label or not label[1:].isdigit():
        return None
    return int(label[1:]) - 1


def alternative(result: dict, params: Params) -> dict[str, Any]:
    """A result's text as Deepgram's one ``alternative``: transcript, confidence, words."""
    words = []
    for w in result.get("words") or []:
        word = {"word": plain(w["word"]), "start": round(w["start"], 3),
                "end": round(w["end"], 3), "confidence": round(float(w.get("conf", 0.0)), 4)}
        if params.punctuate or params.smart_format:
            word["punctuated_word"] = w["word"].strip()
        number = speaker_number(w.get("speaker") or result.get("speaker"))
        if params.diarize and number is not None:
            word["speaker"] = number
        if word["word"]:
            words.append(word)
    text = result.get("text", "").strip()
    if not (params.punctuate or params.smart_format):
        text = " ".join(w["word"] for w in words) if words else \
            " ".join(plain(t) for t in text.split() if plain(t))
    confidence = sum(w["confidence"] for w in words) / len(words) if words else 0.0
    return {"transcript": text, "confidence": round(confidence, 4), "words": words}
