"""The ``null`` engine: no recognition at all, for transport benchmarks only.

Every chunk yields an empty partial result covering it and ``flush`` an empty final,
so latency through gateway, Redis and worker can be measured without decoding cost.
"""

from __future__ import annotations

from ..settings import Settings
from ..wire.messages import Result
from ..wire.protocol import SAMPLE_WIDTH
from .endpointer import Turn


class NullStream:
    def __init__(self, sample_rate: int, checkpoint: dict | None):
        cp = checkpoint or {"seconds": 0.0, "utterance": 0, "rate": sample_rate}
        self.checkpoint = dict(cp)
        self._rate = cp["rate"]
        self._seconds = cp["seconds"]

    def feed(self, pcm: bytes, sample_rate: int | None = None) -> list[Result]:
        self._rate = sample_rate or self._rate
        start = self._seconds
        self._seconds += len(pcm) / (SAMPLE_WIDTH * self._rate)
        return [{"type": "partial", "text": "", "utterance": self.checkpoint["utterance"],
                 "start": round(start, 3), "end": round(self._seconds, 3)}]

    def flush(self) -> list[Result]:
        return [{"type": "final", "text": "", "utterance": self.checkpoint["utterance"],
                 "start": 0.0, "end": round(self._seconds, 3), "words": []}]

    def finalize(self) -> list[Result]:
        return []

    def close(self) -> None:
        pass


class NullModel:
    name = "null"

    def __init__(self, settings: Settings | None = None):
        self.settings = settings

    def preload(self, n: int) -> None:
        pass

    def after_fork(self) -> None:
        pass

    def start_stage(self, process: bool = True) -> None:
        return None  # every result is decoded at once

    def stream(self, sample_rate: int, checkpoint: dict | None = None,
               mode: str | None = None, language: str | None = None,
               prompt: str = "", turn: Turn | None = None) -> NullStream:
        return NullStream(sample_rate, checkpoint)
