"""Recogniser engines behind one interface.

A ``Model`` is loaded once per worker process (before it forks, so model pages are
shared); ``model.stream(sample_rate, checkpoint)`` opens a per-session ``Stream`` whose
``feed(pcm, sample_rate)`` and ``flush()`` return result dicts::

    {"type": "partial" | "final", "text", "utterance", "start", "end", "words"?}

Engines never touch Redis or sockets: the worker publishes what they return.

``Stream.checkpoint`` is the stream's state at its last reset point (after each final):
``model.stream(rate, checkpoint)`` rebuilds a stream that continues exactly as the
original would from the next chunk on.
"""

from __future__ import annotations

from typing import Protocol


class Stream(Protocol):
    @property
    def checkpoint(self) -> dict: ...

    def feed(self, pcm: bytes, sample_rate: int | None = None) -> list[dict]: ...

    def flush(self) -> list[dict]: ...

    def close(self) -> None: ...


class Model(Protocol):
    name: str

    def preload(self, n: int) -> None: ...

    def stream(self, sample_rate: int, checkpoint: dict | None = None,
               mode: str | None = None) -> Stream: ...

    # Optional: ``after_fork()`` runs in each worker process before it starts decoding.


# Sample rates a session may stream at: every engine's front end resamples them exactly.
SUPPORTED_RATES = (8000, 16000, 48000)
ENGINES = ("pocketsphinx", "2pass", "whisper", "null")
# Engines whose finals come from Whisper (cosyvoice/asr/whisper_engine.py).
WHISPER_ENGINES = ("2pass", "whisper")
# Backends of Whisper finals (COSYVOICE_WHISPER_BACKEND).
WHISPER_BACKENDS = ("torch", "ctranslate2")
# Where a session's finals come from (auth ``mode``).
SESSION_MODES = ("pocketsphinx", "2pass", "whisper")
# The session modes each engine offers; the first is the default.
ENGINE_MODES = {
    "pocketsphinx": ("pocketsphinx",),
    "2pass": ("2pass", "pocketsphinx", "whisper"),
    "whisper": ("whisper", "2pass", "pocketsphinx"),
    "null": ("null",),
}


def load_model(engine: str, settings) -> Model:
    """Load the named engine's model with the recogniser settings."""
    if engine == "pocketsphinx":
        from .pocketsphinx_engine import PocketSphinxModel
        return PocketSphinxModel(settings)
    if engine in WHISPER_ENGINES:
        from .whisper_engine import TwoPassModel
        return TwoPassModel(settings, default_mode=engine)
    if engine == "null":
        from .null_engine import NullModel
        return NullModel()
    raise ValueError(f"unknown engine {engine!r}; choose one of {ENGINES}")
