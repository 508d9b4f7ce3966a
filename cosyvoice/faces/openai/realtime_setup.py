"""How a Realtime connection is set up (docs/openai.md): its handshake, checked before the
upgrade (``precheck``: a transcription session, and the key where one is needed), and its
session's configuration (``Config``) as ``session.update`` or
``transcription_session.update`` sets it (``updated``), in either of the API's shapes (GA:
``session.audio.input``; beta: ``session``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ...gateway.core import Gateway
from ...gateway.limits import ENDPOINT_MS, MAX_PROMPT_CHARS
from ...gateway.wshandler import Refusal
from ...wire.errors import Unauthorized
from .transcriptions import ApiError

RATE = 24000  # the Realtime API's PCM rate
DEFAULT_SILENCE_MS = 500  # server_vad's default silence_duration_ms
KEY_PROTOCOL = "openai-insecure-api-key."  # a browser's key, as a subprotocol


def _refusal(status: str, message: str, code: str | None) -> Refusal:
    body = json.dumps(ApiError(int(status[:3]), message, code=code).body()).encode()
    return status, [("Content-Type", "application/json")], body


def precheck(gateway: Gateway, environ: dict) -> Refusal | None:
    """Before the upgrade: a transcription session, and the key where one is needed."""
    from urllib.parse import parse_qs

    query = parse_qs(environ.get("QUERY_STRING", ""))
    if query.get("intent", ["transcription"])[0] != "transcription":
        return _refusal("400 Bad Request", "only transcription sessions are served here: "
                        "connect with ?intent=transcription", "invalid_intent")
    try:
        gateway.auth.check(credential(environ))
    except Unauthorized as err:
        return _refusal("401 Unauthorized", err.msg, "invalid_api_key")
    return None


def credential(environ: dict) -> str | None:
    """The key of the handshake: ``Authorization: Bearer``, or a browser's subprotocol."""
    scheme, _, key = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
    if scheme.lower() != "bearer":
        key = next((p.strip()[len(KEY_PROTOCOL):] for p in
                    environ.get("HTTP_SEC_WEBSOCKET_PROTOCOL", "").split(",")
                    if p.strip().startswith(KEY_PROTOCOL)), "")
    return key.strip() or None


def _include(value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise EventError("include must be a list of strings", param="session.include")
    return value


class EventError(Exception):
    """A client event that cannot be done: an ``error`` event, the connection goes on."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None):
        super().__init__(message)
        self.message, self.code, self.param = message, code, param


@dataclass
class Config:
    """A Realtime transcription session's configuration, as ``session.update`` set it."""
    model: str = "whisper-1"
    language: str | None = None
    prompt: str = ""
    vad: dict[str, Any] | None = field(default_factory=lambda: {
        "type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
        "silence_duration_ms": DEFAULT_SILENCE_MS})
    include: list[str] = field(default_factory=list)

    def session_auth(self) -> dict[str, Any]:
        """The cosyvoice session this configuration asks for (its ``auth``)."""
        auth: dict[str, Any] = {"sample_rate": RATE}
        if self.language:
            auth["language"] = self.language
        if self.prompt:
            auth["prompt"] = self.prompt[-MAX_PROMPT_CHARS:]
        if self.vad is None:  # commits end the turns: the endpointer's longest silence
            auth.update(endpoint_ms=ENDPOINT_MS[1], interim=False)
        else:
            silence = int(self.vad.get("silence_duration_ms") or DEFAULT_SILENCE_MS)
            low, high = ENDPOINT_MS
            auth.update(endpoint_ms=min(high, max(low, silence)), speech_events=True,
                        interim=False)
        return auth

    def ga(self, session_id: str) -> dict[str, Any]:
        return {"type": "transcription", "id": session_id,
                "object": "realtime.transcription_session",
                "audio": {"input": {
                    "format": {"type": "audio/pcm", "rate": RATE},
                    "transcription": {"model": self.model, "language": self.language,
                                      "prompt": self.prompt},
                    "turn_detection": self.vad, "noise_reduction": None}},
                "include": self.include}

    def beta(self, session_id: str) -> dict[str, Any]:
        return {"id": session_id, "object": "realtime.transcription_session",
                "input_audio_format": "pcm16",
                "input_audio_transcription": {"model": self.model, "language": self.language,
                                              "prompt": self.prompt},
                "turn_detection": self.vad, "input_audio_noise_reduction": None,
                "include": self.include}


def updated(config: Config, session: dict, beta: bool, languages: tuple[str, ...]) -> Config:
    """``config`` as the update's ``session`` changes it (a copy; raises ``EventError``)."""
    config = Config(**vars(config))
    if beta:
        _update_beta(config, session, languages)
    else:
        _update_ga(config, session, languages)
    if "include" in session:
        config.include = _include(session["include"])
    return config


def _update_ga(config: Config, session: dict, languages: tuple[str, ...]) -> None:
    if session.get("type", "transcription") != "transcription":
        raise EventError("only transcription sessions are served here",
                         param="session.type")
    audio = session.get("audio", {})
    audio_in = audio.get("input", {}) if isinstance(audio, dict) else None
    if not isinstance(audio_in, dict):
        raise EventError("session.audio.input must be an object",
                         param="session.audio.input")
    if "format" in audio_in:
        fmt = audio_in["format"]
        if (not isinstance(fmt, dict) or fmt.get("type") != "audio/pcm"
                or fmt.get("rate", RATE) != RATE):
            raise EventError("the input format is audio/pcm at 24000 Hz",
                             param="session.audio.input.format")
    _update_turns(config, audio_in, "session.audio.input.", "transcription", languages)

def _update_beta(config: Config, session: dict, languages: tuple[str, ...]) -> None:
    if session.get("input_audio_format", "pcm16") != "pcm16":
        raise EventError("the input format is pcm16 (24000 Hz)",
                         param="session.input_audio_format")
    _update_turns(config, session, "session.", "input_audio_transcription", languages)

def _update_turns(config: Config, section: dict, path: str, transcription: str,
                  languages: tuple[str, ...]) -> None:
    """The transcription and turn detection of either shape: where the GA shape has
    them (``session.audio.input``) or the beta one (``session``)."""
    if transcription in section:
        _transcription(config, section[transcription], path + transcription, languages)
    if "turn_detection" in section:
        config.vad = _turn_detection(section["turn_detection"], path + "turn_detection")

def _transcription(config: Config, t: Any, param: str, languages: tuple[str, ...]) -> None:
    if t is None:
        return
    if not isinstance(t, dict):
        raise EventError("transcription must be an object", param=param)
    if isinstance(t.get("model"), str):
        config.model = t["model"]
    language = t.get("language") or None
    if language is not None and language not in languages:
        raise EventError(f"language {str(language)[:16]!r} is not offered on this server",
                         "unsupported_language", param + ".language")
    config.language = language
    prompt = t.get("prompt") or ""
    if not isinstance(prompt, str):
        raise EventError("prompt must be a string", param=param + ".prompt")
    config.prompt = prompt

def _turn_detection(td: Any, param: str) -> dict[str, Any] | None:
    if td is None:
        return None
    if not isinstance(td, dict) or td.get("type", "server_vad") not in ("server_vad",
                                                                       "semantic_vad"):
        raise EventError("turn_detection is server_vad, semantic_vad or null", param=param)
    silence = td.get("silence_duration_ms", DEFAULT_SILENCE_MS)
    if type(silence) is not int or not 0 <= silence <= 10000:
        raise EventError("silence_duration_ms must be an integer of milliseconds",
                         param=param + ".silence_duration_ms")
    return {"type": td.get("type", "server_vad"),
            "threshold": td.get("threshold", 0.5),
            "prefix_padding_ms": td.get("prefix_padding_ms", 300),
            "silence_duration_ms": silence}
