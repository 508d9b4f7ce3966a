"""Voices from audio: the worker's recent audio of a session (``AudioWindow``), where a
piece's voice changes, and the speaker encoder on the worker's embedder thread
(``Encoder``, ``Embedder``)."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .clustering import FRAME, MIN_PIECE_S, RATE, _unit

log = logging.getLogger("cosyvoice.speakers")

CHANGE = 0.80  # a piece is cut where its windows before and after are less alike than this
CHANGE_MIN_S = 2.5  # ... if it is at least this long (two windows of the encoder, and more)
CHANGE_CONTEXT = 3  # windows each side of a point compared (a turn in the middle shows)
WINDOW_RATE = 2.0  # the encoder's 1.6 s windows a second (resemblyzer's default is 1.3)
CHANGE_SEARCH_S = 0.6  # the cut is looked for this near the windows' guess
REFINE_S = 0.8  # ... by the voice of this much audio either side of each candidate
REFINE_STEP_S = 0.05  # ... a candidate every 50 ms, then the quietest 90 ms near the best
KEEP_S = 45.0  # audio the worker keeps per session (more than the longest utterance)


class AudioWindow:
    """The session's latest ``KEEP_S`` of audio at 16 kHz, by absolute sample (from the
    session's start, as the engines count it)."""

    def __init__(self, position: int = 0, keep_s: float = KEEP_S):
        self.position = position  # samples received since the session's start
        self._keep = int(keep_s * RATE)
        self._buf = np.zeros(0, dtype=np.float32)
        self._rate = 0
        self._resampler: Any = None

    def feed(self, pcm: bytes, rate: int) -> None:
        samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
        if rate != RATE:
            import soxr
            if rate != self._rate or self._resampler is None:
                self._resampler = soxr.ResampleStream(rate, RATE, 1, dtype="float32")
            samples = self._resampler.resample_chunk(samples)
        self._rate = rate
        self.position += len(samples)
        self._buf = np.concatenate([self._buf, samples])[-self._keep:]

    def span(self, start_s: float, end_s: float) -> tuple[np.ndarray, float]:
        """The audio from ``start_s`` to ``end_s`` (seconds from the session's start) that
        is still kept, and the time its first sample is at."""
        first = self.position - len(self._buf)
        a = max(first, int(round(start_s * RATE)))
        b = min(self.position, int(round(end_s * RATE)))
        if b <= a:
            return np.zeros(0, dtype=np.float32), start_s
        return self._buf[a - first:b - first], a / RATE


# ---- the embedder -----------------------------------------------------------------------

def _quietest(audio: np.ndarray, guess: int, lo: int, hi: int,
              within_s: float = CHANGE_SEARCH_S) -> int:
    """The middle of the quietest 90 ms within ``within_s`` of ``guess`` (and at least
    ``MIN_PIECE_S`` inside ``lo``..``hi``): where a word ends, most likely."""
    a = max(lo + int(MIN_PIECE_S * RATE), guess - int(within_s * RATE))
    b = min(hi - int(MIN_PIECE_S * RATE), guess + int(within_s * RATE))
    if b - a < 3 * FRAME:
        return guess
    n = (b - a) // FRAME
    frames = audio[a:a + n * FRAME].reshape(n, FRAME).astype(np.float64)
    energy = np.convolve(np.mean(frames ** 2, axis=1), np.ones(3), "valid")
    return a + (int(np.argmin(energy)) + 1) * FRAME + FRAME // 2


Refine = Callable[[np.ndarray, int, int, int, np.ndarray, np.ndarray], int]


def voice_changes(audio: np.ndarray, windows: np.ndarray, slices: Sequence[slice],
                  lo: int = 0, hi: int | None = None, index: Sequence[int] | None = None,
                  refine: Refine | None = None) -> list[tuple[int, int, np.ndarray]]:
    """A piece of speech (``audio[lo:hi]``) cut where its voice changes, as (start, end,
    vector) sample ranges: ``windows`` are the encoder's vectors of its 1.6 s windows
    (``slices`` of ``audio``); where the ``CHANGE_CONTEXT`` windows before some point and
    those after it are less alike than ``CHANGE``, the piece is cut there and each side is
    looked at again. The windows place a change only to within their step (half a
    second): ``refine(audio, guess, lo, hi, before, after)`` finds the cut near ``guess``
    (the encoder's, by the voices either side; without it, the quietest moment nearby).
    Each part's vector is the mean of its windows (those wholly inside it where there are
    any)."""
    hi = len(audio) if hi is None else hi
    index = list(range(len(windows))) if index is None else list(index)

    def mean(ids: Sequence[int]) -> np.ndarray:
        return _unit(windows[list(ids)].mean(axis=0))

    whole = [(lo, hi, mean(index))]
    if hi - lo < CHANGE_MIN_S * RATE or len(index) < 2:
        return whole
    k = CHANGE_CONTEXT or len(index)
    sims = [float(mean(index[max(0, j - k):j]) @ mean(index[j:j + k]))
            for j in range(1, len(index))]
    j = int(np.argmin(sims)) + 1
    if sims[j - 1] >= CHANGE:
        return whole
    guess = (slices[index[j]].start + min(slices[index[j - 1]].stop, hi)) // 2
    cut = (refine(audio, guess, lo, hi, mean(index[:j]), mean(index[j:])) if refine
           else _quietest(audio, guess, lo, hi))
    if cut - lo < MIN_PIECE_S * RATE or hi - cut < MIN_PIECE_S * RATE:
        return whole

    def side(a: int, b: int) -> list[int]:
        inside = [i for i in index if a <= slices[i].start and slices[i].stop <= b]
        return inside or [i for i in index
                          if a <= (slices[i].start + slices[i].stop) // 2 < b]
    left, right = side(lo, cut), side(cut, hi)
    if not left or not right:
        return whole
    return (voice_changes(audio, windows, slices, lo, cut, left, refine)
            + voice_changes(audio, windows, slices, cut, hi, right, refine))


class Encoder:
    """The GE2E speaker encoder (``resemblyzer``), loaded once per process, one thread."""

    def __init__(self) -> None:
        import warnings

        import torch
        with warnings.catch_warnings():
            # resemblyzer 0.1.4 imports binary_dilation from scipy's deprecated path
            warnings.simplefilter("ignore", DeprecationWarning)
            from resemblyzer import VoiceEncoder
            from resemblyzer import audio as rz_audio
        torch.set_num_threads(1)
        self._model = VoiceEncoder("cpu", verbose=False)
        self._audio = rz_audio
        # the first pass compiles librosa's mel filters and warms torch: not a final's cost
        noise = np.random.default_rng(0).normal(0, 0.05, 2 * RATE).astype(np.float32)
        self.windows(noise)

    def embed(self, samples: np.ndarray) -> np.ndarray:
        wav = self._audio.normalize_volume(samples, -30, increase_only=True)
        return np.asarray(self._model.embed_utterance(wav), dtype=np.float32)

    def windows(self, samples: np.ndarray) -> tuple[np.ndarray, list[slice]]:
        """The vectors of the encoder's 1.6 s windows over ``samples`` (``WINDOW_RATE``;
        their mean is ``embed``'s) and where each window is."""
        wav = self._audio.normalize_volume(samples, -30, increase_only=True)
        _, windows, slices = self._model.embed_utterance(wav, return_partials=True,
                                                         rate=WINDOW_RATE)
        return np.asarray(windows, dtype=np.float32), list(slices)

    def pieces(self, samples: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
        """A piece of speech cut where its voice changes (``voice_changes``), each part
        with its vector."""
        windows, slices = self.windows(samples)
        mel: list[np.ndarray] = []  # computed once, if a change is found

        def refine(audio: np.ndarray, guess: int, lo: int, hi: int, before: np.ndarray,
                   after: np.ndarray) -> int:
            if not mel:
                wav = self._audio.normalize_volume(audio, -30, increase_only=True)
                mel.append(self._audio.wav_to_mel_spectrogram(wav))
            return self._refine(mel[0], audio, guess, lo, hi, before, after)
        return voice_changes(samples, windows, slices, refine=refine)

    def _refine(self, mel: np.ndarray, audio: np.ndarray, guess: int, lo: int, hi: int,
                before: np.ndarray, after: np.ndarray) -> int:
        """The cut near ``guess`` where the ``REFINE_S`` before it sounds most like
        ``before`` and the ``REFINE_S`` after it most like ``after`` (candidates every
        ``REFINE_STEP_S``), moved to the quietest 90 ms within 60 ms of it."""
        import torch

        hop = RATE // 100  # the mel frames' 10 ms
        span = int(REFINE_S * 100)
        first = max(lo + int(MIN_PIECE_S * RATE), guess - int(CHANGE_SEARCH_S * RATE), span * hop)
        last = min(hi - int(MIN_PIECE_S * RATE), guess + int(CHANGE_SEARCH_S * RATE),
                   (len(mel) - span) * hop)
        step = int(REFINE_STEP_S * RATE)
        candidates = list(range(first, last + 1, step))
        if not candidates:
            return _quietest(audio, guess, lo, hi)
        frames = [c // hop for c in candidates]
        batch = np.array([mel[f - span:f] for f in frames] + [mel[f:f + span] for f in frames])
        with torch.no_grad():
            vectors = self._model(torch.from_numpy(batch)).numpy()
        n = len(candidates)
        score = vectors[:n] @ before + vectors[n:] @ after
        best = candidates[int(np.argmax(score))]
        return _quietest(audio, best, lo, hi, within_s=0.06)


class EmbedJob:
    """Pieces of audio to embed (a ``messages.Deferred``): once ``done``, ``result`` has
    ``_voices``, ``[(start, end, vector)]`` per piece, for the speaker rule. ``cut``:
    each piece is also cut where its voice changes (a final's; not a partial's guess)."""

    def __init__(self, spans: list[tuple[float, float, np.ndarray]], cut: bool = False):
        self.spans = spans
        self.cut = cut
        self.stale = False  # a guess overtaken (by a newer one or its final): skipped
        self.done = False
        self.failed = False
        self.dropped = False
        self.result: dict[str, Any] = {}
        self.after: dict[str, Any] = {}
        self.voices: list[tuple[float, float, np.ndarray]] = []


class Embedder:
    """The process's speaker embedder: jobs in the order given, on a thread of its own
    (``inline=False``, the default: the final's text and its vectors are computed at
    once, the worker's loop goes on) or in the caller's thread (``inline``: the worker's
    loop waits for each; what ``benchmarks/speakers.py --embedder inline`` compares).
    Its busy time is sampled for admission (``sample``)."""

    def __init__(self, encoder_factory: Any = Encoder, inline: bool = False):
        self._factory = encoder_factory
        self._encoder: Any = None
        # finals first (their sessions wait for them), then partials' guesses, each in the
        # order given
        self._jobs: queue.PriorityQueue[tuple[int, int, EmbedJob | None]] = \
            queue.PriorityQueue()
        self._order = itertools.count()
        self._busy = 0.0
        self._since = time.monotonic()
        self._lock = threading.Lock()
        self.inline = inline
        if not inline:
            threading.Thread(target=self._run, name="speaker-embedder", daemon=True).start()

    def submit(self, job: EmbedJob) -> EmbedJob:
        if self.inline:
            self._do(job)
        else:
            self._jobs.put((0 if job.cut else 1, next(self._order), job))
        return job

    def sample(self) -> float:
        """The fraction of the time since the last call spent embedding."""
        with self._lock:
            now = time.monotonic()
            busy, self._busy = self._busy, 0.0
            span, self._since = now - self._since, now
        return busy / span if span > 0 else 0.0

    def stop(self) -> None:
        self._jobs.put((-1, next(self._order), None))

    def _run(self) -> None:
        while True:
            *_, job = self._jobs.get()
            if job is None:
                return
            if job.stale:
                job.done = True  # no vector: the partial shows the last speaker
                continue
            self._do(job)

    def _do(self, job: EmbedJob) -> None:
        from ... import metrics  # only in worker processes (after metrics_dir.choose)
        if self._encoder is None:
            try:
                self._encoder = self._factory()  # loading is not embedding: not counted
            except Exception:  # noqa: BLE001 - a failed load ends only its session
                log.exception("the speaker encoder did not load")
                job.failed = job.done = True
                return
        began, cpu = time.monotonic(), time.thread_time()
        try:
            job.voices = [v for s, e, a in job.spans
                          for v in _embedded(self._encoder, s, a, job.cut)]
            job.result = {"_voices": job.voices}
        except Exception:  # noqa: BLE001 - a failed embedding ends only its session
            log.exception("speaker embedding failed")
            job.failed = True
        with self._lock:
            self._busy += time.monotonic() - began
        metrics.SPEAKER_CPU.inc(time.thread_time() - cpu)
        metrics.SPEAKER_AUDIO.inc(sum(len(a) for *_, a in job.spans) / RATE)
        job.done = True


def _embedded(encoder: Any, start: float, audio: np.ndarray,
              cut: bool) -> list[tuple[float, float, np.ndarray]]:
    """(start, end, vector) of a piece of audio that starts at ``start`` seconds: cut
    where its voice changes, or whole."""
    if not cut:
        return [(start, round(start + len(audio) / RATE, 3), encoder.embed(audio))]
    return [(round(start + a / RATE, 3), round(start + b / RATE, 3), v)
            for a, b, v in encoder.pieces(audio)]


class Both:
    """A final whose text a deferred stage decodes and whose pieces the embedder embeds
    (a ``messages.Deferred``): done when both are; its result is both results."""

    def __init__(self, text: Any, voices: EmbedJob):
        self.text, self.voices = text, voices

    @property
    def done(self) -> bool:
        return bool(self.text.done and self.voices.done)

    @property
    def failed(self) -> bool:
        return bool(self.text.failed or self.voices.failed)

    @property
    def dropped(self) -> bool:
        return bool(self.text.dropped)

    @property
    def result(self) -> dict[str, Any]:
        return {**self.text.result, **self.voices.result}

    @property
    def after(self) -> dict[str, Any]:
        return self.text.after
