"""Recogniser engines behind one interface.

A ``Model`` is loaded once per worker process (before it forks, so model pages are
shared); ``model.stream(sample_rate, checkpoint)`` opens a per-session ``Stream`` whose
``feed(pcm, sample_rate)`` and ``flush()`` return ``cosyvoice.messages.Decoded`` items: a
partial or final ``Result``, or a ``Scheduled`` one whose decoding the engine's deferred
stage finishes (the 2-pass finals process, whisper-live's decode scheduler).
The engines and what each declares are listed in ``cosyvoice/wire/registry.py``.

Engines never touch Redis or sockets: the worker publishes what they return.

``Stream.checkpoint`` is the stream's state at its last reset point (after each final):
``model.stream(rate, checkpoint)`` rebuilds a stream that continues exactly as the
original would from the next chunk on. The worker stores it as a
``cosyvoice.messages.Checkpoint``'s ``state``.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Protocol

from ..settings import Settings
from ..text.stages import DeferredStage
from ..wire.messages import Decoded
from ..wire.registry import ENGINES, SESSION_MODES, WHISPER_BACKENDS, EngineSpec
from .endpointer import Turn

__all__ = ["ENGINES", "SESSION_MODES", "WHISPER_BACKENDS", "EngineSpec", "Model", "Stream",
           "Turn", "capacity_of", "load_model"]


class Stream(Protocol):
    @property
    def checkpoint(self) -> dict: ...

    def feed(self, pcm: bytes, sample_rate: int | None = None) -> Sequence[Decoded]: ...

    def flush(self) -> Sequence[Decoded]: ...

    def finalize(self) -> Sequence[Decoded]:
        """The utterance in progress ends here (a client's ``finalize``): its final now,
        and the stream goes on."""
        ...

    def close(self) -> None: ...


class Model(Protocol):
    name: str

    def preload(self, n: int) -> None:
        """Before the fork: load what the worker processes share (``n`` of them)."""
        ...

    def after_fork(self) -> None:
        """In each worker process, before it decodes: load what cannot cross a fork."""
        ...

    def start_stage(self, process: bool = True) -> DeferredStage | None:
        """Start the engine's deferred stage in this worker process (``EngineSpec.stage``;
        None where it has none, or runs its decodes inline): its streams hand it their
        decodes from now on and return them as ``Scheduled``. ``process=False`` keeps a
        finals stage in a thread of this process (tests that hold finals back)."""
        ...

    def stream(self, sample_rate: int, checkpoint: dict | None = None,
               mode: str | None = None, language: str | None = None,
               prompt: str = "", turn: Turn | None = None) -> Stream:
        """A session's stream: from its ``checkpoint``, else new, in the session ``mode``
        and ``language`` (one of ``EngineSpec.languages``; None: the engine's default),
        its Whisper decodes after the text ``prompt`` until its own finals take over (an
        engine without a prompt ignores it), its endpointing as ``turn`` asks (the
        whisper-live front end: whisper-live and 2-pass; PocketSphinx ignores it)."""
        ...


def capacity_of(settings: Settings) -> int:
    """Sessions one worker process decodes at once: ``COSYVOICE_WORKER_CAPACITY``, or the
    engine's own when that is 0."""
    return settings.worker_capacity or ENGINES[settings.engine].capacity


def load_model(engine: str, settings: Settings) -> Model:
    """Load the named engine's model with the recogniser settings."""
    spec = ENGINES.get(engine)
    if spec is None:
        raise ValueError(f"unknown engine {engine!r}; choose one of {tuple(ENGINES)}")
    module, _, attr = spec.factory.partition(":")
    factory = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    if spec.stage == "finals":
        return factory(settings, default_mode=engine)
    return factory(settings)
