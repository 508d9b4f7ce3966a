"""One long session, for the soak test and ``benchmarks/soak.py long``: speech made by
looping the sentence fixtures with pauses, streamed at a multiple of real time, with the
worker's RSS sampled each audio minute and each final's lag; and the phrase-loop measure.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import psutil

from cosyvoice.client import StreamingClient

from .helpers import fixture_texts, read_pcm

CHUNK_BYTES = 16000 * 2 // 5  # 200 ms of 16 kHz PCM


def looped_speech(minutes: float, seed: int = 2026) -> tuple[bytes, str]:
    """``minutes`` of the sentence fixtures in shuffled cycles with pauses of 0.4-2.5 s
    (one in ten 6 s), as 16 kHz PCM, and the reference text. A cycle never starts with the
    sentence the last one ended on, so the reference repeats no sentence back to back."""
    texts = fixture_texts()
    names = list(texts)
    rng = random.Random(seed)
    parts: list[bytes] = []
    said: list[str] = []
    size, goal = 0, int(minutes * 60 * 16000 * 2)
    last = None
    while size < goal:
        cycle = names[:]
        rng.shuffle(cycle)
        if cycle[0] == last:
            cycle.append(cycle.pop(0))
        for name in cycle:
            pause = 6.0 if rng.random() < 0.1 else rng.uniform(0.4, 2.5)
            pcm = read_pcm(name) + b"\0\0" * int(pause * 16000)
            parts.append(pcm)
            said.append(texts[name])
            size += len(pcm)
            last = name
            if size >= goal:
                break
    return b"".join(parts), " ".join(said)


def longest_repeat(text: str) -> int:
    """The most times a phrase of 2-8 words follows itself directly in ``text``."""
    words = text.lower().split()
    best = 1
    for n in range(2, 9):
        for i in range(len(words) - n):
            k = 1
            while words[i + k * n:i + (k + 1) * n] == words[i:i + n]:
                k += 1
            best = max(best, k)
    return best


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


@dataclass
class LongRun:
    ended: bool = False
    finals: list[dict] = field(default_factory=list)  # each with lag_s
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (audio minute, MB)

    @property
    def text(self) -> str:
        return " ".join(f["text"].strip() for f in self.finals if f["text"].strip())

    def rss_growth_mb(self, after_minute: float) -> float:
        """How far the RSS rose above its sample at ``after_minute`` (or the first after)."""
        later = [mb for t, mb in self.rss_mb if t >= after_minute]
        return max(later) - later[0] if later else 0.0

    def steady_growth_mb(self, after_minute: float) -> float:
        """The rise after ``after_minute`` but its largest step from one sample to the
        next: a leak rises at every step; a buffer grown once (its largest size yet, an
        allocator's new arena) rises at one."""
        later = [mb for t, mb in self.rss_mb if t >= after_minute]
        rises = [max(0.0, b - a) for a, b in itertools.pairwise(later)]
        return sum(rises) - max(rises, default=0.0)


def stream_long(url: str, worker_pid: int, audio: bytes, speed: float,
                end_timeout_s: float = 300) -> LongRun:
    """Send ``audio`` as one session in 200 ms chunks at ``speed`` times real time (the
    gateway's rate limit must allow it), sampling the worker's RSS each audio minute; each
    final carries its lag, from sending the chunk its endpoint fell in to receiving it."""
    chunks = [audio[i:i + CHUNK_BYTES] for i in range(0, len(audio), CHUNK_BYTES)]
    sent_at: dict[int, float] = {}
    run = LongRun()

    def on_event(event: str, data: Mapping[str, Any]) -> None:
        if event == "text" and data.get("type") == "final":
            seq = int(data.get("seq", -1))
            lag = time.monotonic() - sent_at[seq] if seq in sent_at else None
            run.finals.append({**data, "lag_s": lag})

    client = StreamingClient(url, on_event=on_event)
    client.connect()
    run.rss_mb.append((0.0, rss_mb(worker_pid)))
    start = time.monotonic()
    per_minute = int(60 / 0.2)
    for seq, pcm in enumerate(chunks):
        time.sleep(max(0.0, start + seq * 0.2 / speed - time.monotonic()))
        sent_at[seq] = time.monotonic()
        client.send(pcm, seq, last=seq == len(chunks) - 1, sample_rate=16000 if seq == 0 else 0)
        if seq and seq % per_minute == 0:
            run.rss_mb.append((seq / per_minute, rss_mb(worker_pid)))
    run.ended = client.wait_end(end_timeout_s)
    run.rss_mb.append((len(chunks) / per_minute, rss_mb(worker_pid)))
    client.stop()
    client.close()
    return run
