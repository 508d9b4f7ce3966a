"""Recogniser engines behind one interface.

A ``Model`` is loaded once per worker process (before it forks, so model pages are
shared); ``model.stream(sample_rate, checkpoint)`` opens a per-session ``Stream`` whose
``feed(pcm, sample_rate)`` and ``flush()`` return ``cosyvoice.messages.Decoded`` items: a
partial or final ``Result``, or one whose decoding another stage finishes (a
``DeferredFinal`` for the worker's finals stage, a ``Scheduled`` decode of whisper-live's
scheduler).

Engines never touch Redis or sockets: the worker publishes what they return.

``Stream.checkpoint`` is the stream's state at its last reset point (after each final):
``model.stream(rate, checkpoint)`` rebuilds a stream that continues exactly as the
original would from the next chunk on. The worker stores it as a
``cosyvoice.messages.Checkpoint``'s ``state``.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..messages import Decoded


class Stream(Protocol):
    @property
    def checkpoint(self) -> dict: ...

    def feed(self, pcm: bytes, sample_rate: int | None = None) -> Sequence[Decoded]: ...

    def flush(self) -> Sequence[Decoded]: ...

    def close(self) -> None: ...


class Model(Protocol):
    name: str

    def preload(self, n: int) -> None: ...

    def stream(self, sample_rate: int, checkpoint: dict | None = None,
               mode: str | None = None) -> Stream: ...

    # Optional: ``after_fork()`` runs in each worker process before it starts decoding.


# Backends of Whisper base finals (COSYVOICE_WHISPER_BACKEND).
WHISPER_BACKENDS = ("torch", "ctranslate2")


@dataclass(frozen=True)
class EngineSpec:
    """One engine and what it declares: where its model comes from, the session modes it
    offers (auth ``mode``; the first is the default), the sessions a worker process
    decodes at once within the latency targets on the reference host (2 cores, measured:
    docs/engines.md, "Capacity"), and whether its finals are decoded by the worker's finals
    stage (the model has ``transcribe``; cosyvoice/finals.py)."""
    name: str
    factory: str  # "module:callable", called with (settings, default_mode)
    modes: tuple[str, ...]
    capacity: int
    # CPU seconds per audio second of one real-time session on the reference host, as
    # cosyvoice/asr/calibrate.py measures it: another host scales ``capacity`` by it.
    reference_cost: float
    finals_stage: bool = False


ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in (
    EngineSpec("whisper-live", "live_engine:LiveModel", ("whisper-live",), capacity=6,
               reference_cost=0.071),
    EngineSpec("pocketsphinx", "pocketsphinx_engine:PocketSphinxModel", ("pocketsphinx",),
               capacity=6, reference_cost=0.094),
    EngineSpec("2pass", "whisper_engine:TwoPassModel", ("2pass", "pocketsphinx", "whisper"),
               capacity=1, reference_cost=0.184, finals_stage=True),
    EngineSpec("whisper", "whisper_engine:TwoPassModel", ("whisper", "2pass", "pocketsphinx"),
               capacity=1, reference_cost=0.184, finals_stage=True),
    EngineSpec("null", "null_engine:NullModel", ("null",), capacity=6, reference_cost=0.001),
)}
# Every session mode some engine offers.
SESSION_MODES = tuple(dict.fromkeys(m for spec in ENGINES.values() for m in spec.modes
                                    if m != "null"))


def capacity_of(settings) -> int:
    """Sessions one worker process decodes at once: ``COSYVOICE_WORKER_CAPACITY``, or the
    engine's own when that is 0."""
    return settings.worker_capacity or ENGINES[settings.engine].capacity


def load_model(engine: str, settings) -> Model:
    """Load the named engine's model with the recogniser settings."""
    spec = ENGINES.get(engine)
    if spec is None:
        raise ValueError(f"unknown engine {engine!r}; choose one of {tuple(ENGINES)}")
    module, _, attr = spec.factory.partition(":")
    factory = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    if spec.finals_stage:
        return factory(settings, default_mode=engine)
    return factory(settings)
