"""What a worker process on this host can hold: ``cosyvoice worker --calibrate``.

Each engine's capacity (``EngineSpec.capacity``) was measured through the whole service on
a 2-core reference host (benchmarks/engines.py, docs/engines.md): the largest number of
real-time sessions per worker process that kept final P95 < 800 ms and partial P95 <
1.5 s. What limits it is the CPU a session costs, so another host scales it by how fast it
decodes the same audio: this module decodes ``calibration.wav`` (two sentences with a
pause, shipped in the package) as a real-time session would (the partials' clock follows
the audio), measures the CPU seconds per audio second, and scales the reference capacity
by the reference cost over this host's:

    capacity here = floor(reference capacity × reference cost / cost here), at least 1

A slower host admits fewer sessions instead of falling behind; set the result as
``COSYVOICE_WORKER_CAPACITY``.
"""

from __future__ import annotations

import importlib.resources
import math
import time
import wave
from dataclasses import dataclass

from ..settings import Settings
from ..wire.messages import Decoded
from . import ENGINES, load_model

CHUNK_S = 0.2
PASSES = 3


@dataclass(frozen=True)
class Calibration:
    engine: str
    cost: float  # CPU seconds per second of audio, one real-time session
    reference_cost: float
    reference_capacity: int

    @property
    def capacity(self) -> int:
        return max(1, math.floor(self.reference_capacity * self.reference_cost / self.cost))


def calibration_audio() -> bytes:
    path = importlib.resources.files(__package__) / "calibration.wav"
    with importlib.resources.as_file(path) as p, wave.open(str(p), "rb") as w:
        return w.readframes(w.getnframes())


class AudioClock:
    """The partials' clock for a session replayed at full speed: audio seconds fed."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def session_cost(model, pcm: bytes, passes: int = PASSES) -> float:
    """CPU seconds per audio second of ``model`` decoding ``pcm`` as real-time sessions,
    deferred (2-pass) finals included."""
    clock = AudioClock()
    if hasattr(model, "clock"):
        model.clock = clock
    size = int(16000 * CHUNK_S) * 2
    cpu = 0.0
    for _ in range(passes):
        clock.now = 0.0
        stream = model.stream(16000)
        start = time.process_time()
        results: list[Decoded] = []
        for i in range(0, len(pcm), size):
            clock.now += CHUNK_S
            results += stream.feed(pcm[i:i + size])
        results += stream.flush()
        cpu += time.process_time() - start
        stream.close()
    return cpu / (passes * len(pcm) / 32000)


def load_here(settings: Settings):
    """The engine's model, ready to decode in this process (as a worker process's is)."""
    model = load_model(settings.engine, settings)
    model.after_fork()
    return model


def calibrate(settings: Settings) -> Calibration:
    spec = ENGINES[settings.engine]
    model = load_here(settings)
    pcm = calibration_audio()
    session_cost(model, pcm, passes=1)  # warm up: first decodes allocate
    cost = max(session_cost(model, pcm), 1e-6)
    return Calibration(settings.engine, cost, spec.reference_cost, spec.capacity)
