"""Speaker labels: who said each final, live and for whole files.

A session that asks (``auth.diarize``) gets ``speaker`` (``S1``, ``S2``, … in the order
they first speak) on every final and on each of its words, and on its partials the label
the open utterance will likely get. The unit is the utterance the endpointer cuts:

- **Pieces.** A final's audio (the worker keeps the session's recent audio at 16 kHz,
  ``AudioWindow``) is cut at its inner pauses (``PAUSE_S`` of quiet, pieces at least
  ``MIN_PIECE_S`` long) so one final rarely holds two speakers; each piece gets one
  embedding, a 256-dimension d-vector from the GE2E speaker encoder in ``resemblyzer``
  (weights in its wheel), computed on the worker's embedder thread (``Embedder``) while the
  final's text is decoded.
- **Online clustering** (``Clusters``, pure, in the session's checkpoint so a worker that
  takes the session over gives the same labels): a piece joins the speaker whose mean
  vector is nearest if the cosine similarity is at least ``JOIN`` (0.78), otherwise it
  starts a new speaker (never more than ``max_speakers``; below ``min_speakers`` a
  piece joins only above ``JOIN_FEW``). Pieces under ``MIN_NEW_S`` never start a
  speaker (too short for a reliable vector) and do not move the means. Once a final is
  placed, the one before it is placed again against the updated means; if its speaker
  changes, a ``relabel`` message follows (never silently).
- **Whole files** (``recluster``): with ``auth.diarize: "file"`` each final also carries
  its pieces' vectors (``voices``), and the client that has them all (``cosyvoice
  transcribe``, the file API) clusters every piece at once at the end, average-linkage
  agglomerative clustering on cosine distance cut at ``FILE_JOIN`` (or at the number of
  speakers the caller gave), which is better than online: a voice's first pieces are
  judged with its later ones.

The thresholds were chosen on synthetic voices (festival's slt, kal and ked, and the
Mandarin fixtures' voice): same-speaker utterance pairs 0.76-0.95, different speakers
0.31-0.79 (docs/speakers.md has the runs). Real recordings may want other values:
``COSYVOICE_SPEAKER_JOIN`` sets ``JOIN``.
"""

from __future__ import annotations

import base64
import itertools
import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger("cosyvoice.speakers")

RATE = 16000  # what the speaker encoder takes
JOIN = 0.78  # online: a piece joins the nearest speaker at this cosine similarity or more
JOIN_FEW = 0.86  # ... while fewer speakers than the caller's min_speakers are known
FILE_JOIN = 0.75  # whole files: clusters merge down to this average similarity
MIN_NEW_S = 1.0  # a piece shorter than this never starts a speaker nor moves a mean
MIN_PIECE_S = 1.0  # pauses cut a final into pieces no shorter than this
PAUSE_S = 0.3  # the quiet that may separate two speakers inside one final
GUESS_S = 1.6  # an open utterance's label is guessed once it has this much audio
KEEP_S = 45.0  # audio the worker keeps per session (more than the longest utterance)
MAX_SPEAKERS = 16  # what auth accepts for speakers/min_speakers/max_speakers
COST = 0.02  # CPU seconds per audio second (benchmarks/speakers.py), a stage's cost
FRAME = RATE * 30 // 1000  # 30 ms frames for the pause finder
QUIET_DB = 35.0  # a frame this far under the final's loudest is quiet


def label(index: int) -> str:
    return f"S{index + 1}"


def label_index(name: str) -> int:
    return int(name[1:]) - 1


# ---- the session's settings -------------------------------------------------------------

@dataclass(frozen=True)
class Options:
    """What a session asked: ``mode`` ``live`` or ``file`` (vectors on each final for the
    client to cluster at the end), and bounds on the number of speakers."""
    mode: str = "live"
    min_speakers: int = 1
    max_speakers: int = MAX_SPEAKERS

    @classmethod
    def from_session(cls, session: Mapping[str, str]) -> Options | None:
        """The options stored with a session (its hash: ``diarize``, ``min_speakers``,
        ``max_speakers``), or None where it did not ask for speaker labels."""
        mode = session.get("diarize", "")
        if mode not in ("live", "file"):
            return None
        return cls(mode, int(session.get("min_speakers") or 1),
                   int(session.get("max_speakers") or MAX_SPEAKERS))


def parse_auth(auth: Mapping[str, Any]) -> tuple[dict[str, str], str | None]:
    """``auth.diarize`` (true, ``"live"`` or ``"file"``; false or absent: none) and
    ``speakers`` (an exact number) or ``min_speakers``/``max_speakers`` as the session's
    stored fields, or the reason they are refused."""
    diarize = auth.get("diarize", False)
    if diarize in (False, None, "", "off"):
        return {}, None
    if diarize is True or diarize == "live":
        mode = "live"
    elif diarize == "file":
        mode = "file"
    else:
        return {}, "diarize must be true, false, \"live\" or \"file\""
    bounds: dict[str, int] = {}
    for name in ("speakers", "min_speakers", "max_speakers"):
        value = auth.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) \
                or not 1 <= value <= MAX_SPEAKERS:
            return {}, f"{name} must be a whole number from 1 to {MAX_SPEAKERS}"
        bounds[name] = value
    low = bounds.get("speakers", bounds.get("min_speakers", 1))
    high = bounds.get("speakers", bounds.get("max_speakers", MAX_SPEAKERS))
    if low > high:
        return {}, "min_speakers is more than max_speakers"
    return {"diarize": mode, "min_speakers": str(low), "max_speakers": str(high)}, None


# ---- vectors ----------------------------------------------------------------------------

def encode_vector(v: np.ndarray) -> str:
    """A vector as the base64 of its float32 bytes (exact: a checkpoint round-trips)."""
    return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")


def decode_vector(s: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(s), dtype="<f4").astype(np.float32)


def encode_voice(v: np.ndarray) -> str:
    """A piece's vector as sent to a client: float16, 512 bytes before base64."""
    return base64.b64encode(np.asarray(v, dtype="<f2").tobytes()).decode("ascii")


def decode_voice(s: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(s), dtype="<f2").astype(np.float32)


def _unit(v: np.ndarray) -> np.ndarray:
    n = float(np.linalg.norm(v))
    return v / n if n > 0 else v


# ---- pieces -----------------------------------------------------------------------------

def pieces(audio: np.ndarray, min_piece_s: float = MIN_PIECE_S,
           pause_s: float = PAUSE_S) -> list[tuple[int, int]]:
    """Where to cut a final's audio (float, 16 kHz): (start, end) sample ranges split at
    the middle of each run of at least ``pause_s`` quiet frames, no piece shorter than
    ``min_piece_s``. A final without such a pause is one piece."""
    n = len(audio) // FRAME
    whole = [(0, len(audio))]
    if n == 0 or len(audio) < 2 * min_piece_s * RATE:
        return whole
    frames = audio[:n * FRAME].reshape(n, FRAME).astype(np.float64)
    db = 10 * np.log10(np.mean(frames ** 2, axis=1) + 1e-12)
    quiet = db < db.max() - QUIET_DB
    need = max(1, int(round(pause_s * RATE / FRAME)))
    cuts: list[int] = []
    run = 0
    for i, q in enumerate(np.append(quiet, False)):
        if q:
            run += 1
            continue
        if run >= need and i - run > 0 and i < n:
            cuts.append((i - run // 2) * FRAME)
        run = 0
    bounds = [0]
    for c in cuts:
        if c - bounds[-1] >= min_piece_s * RATE and len(audio) - c >= min_piece_s * RATE:
            bounds.append(c)
    bounds.append(len(audio))
    return list(itertools.pairwise(bounds))


# ---- online clustering ------------------------------------------------------------------

@dataclass
class Placed:
    """The last final's pieces as placed: what ``relabel`` may move."""
    utterance: int
    vector: np.ndarray  # the final's mean vector (its pieces', weighted by length)
    speaker: int
    weight: float  # its weight in that speaker's mean (0: too short to count)


@dataclass
class Clusters:
    """The speakers a session has met: each one's sum of (unit) vectors and weight."""
    sums: list[np.ndarray] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    last: Placed | None = None
    join: float = JOIN

    def known(self) -> list[int]:
        """The speakers who still hold speech (a relabel may empty one)."""
        return [i for i, w in enumerate(self.weights) if w > 0]

    def nearest(self, vector: np.ndarray) -> tuple[int, float]:
        """The speaker nearest a vector and their similarity ((-1, -1.0): none yet)."""
        known = self.known()
        if not known:
            return -1, -1.0
        means = np.array([_unit(self.sums[i]) for i in known], dtype=np.float32)
        sims = means @ _unit(vector)
        best = int(np.argmax(sims))
        return known[best], float(sims[best])

    def _new(self) -> int:
        """A new speaker's index: the first emptied one, else the next."""
        empty = [i for i, w in enumerate(self.weights) if w <= 0]
        return empty[0] if empty else len(self.sums)

    def choose(self, vector: np.ndarray, seconds: float, options: Options) -> int:
        """Who said a piece: the nearest known speaker, or a new one (index)."""
        best, sim = self.nearest(vector)
        count = len(self.known())
        join = JOIN_FEW if count < options.min_speakers else self.join
        if best >= 0 and (sim >= join or seconds < MIN_NEW_S
                          or count >= options.max_speakers):
            return best
        return self._new()

    def add(self, speaker: int, vector: np.ndarray, weight: float) -> None:
        if speaker == len(self.sums):
            self.sums.append(np.zeros_like(vector, dtype=np.float32))
            self.weights.append(0.0)
        self.sums[speaker] = self.sums[speaker] + weight * _unit(vector)
        self.weights[speaker] += weight

    def remove(self, speaker: int, vector: np.ndarray, weight: float) -> None:
        self.weights[speaker] -= weight
        if self.weights[speaker] <= 1e-6:
            self.weights[speaker] = 0.0
            self.sums[speaker] = np.zeros_like(self.sums[speaker])
        else:
            self.sums[speaker] = self.sums[speaker] - weight * _unit(vector)

    def place(self, utterance: int, voices: Sequence[tuple[float, float, np.ndarray]],
              options: Options) -> tuple[list[int], tuple[int, int] | None]:
        """Place a final's pieces ((start, end, vector) each): the speaker index of each,
        and ``(utterance, speaker)`` where the final before it now belongs to another
        speaker (a relabel), else None."""
        out: list[int] = []
        for start, end, vector in voices:
            seconds = end - start
            who = self.choose(vector, seconds, options)
            # a short piece moves no mean, unless it is a new speaker's first
            new = who >= len(self.weights) or self.weights[who] <= 0
            weight = min(seconds, 4.0) if seconds >= MIN_NEW_S or new else 0.0
            self.add(who, vector, max(weight, 1e-3) if new else weight)
            out.append(who)
        relabel = self._recheck()
        lengths = [max(e - s, 1e-3) for s, e, _ in voices]
        mean = _unit(np.sum([min(n, 4.0) * _unit(v) for n, (_, _, v)
                             in zip(lengths, voices, strict=True)], axis=0))
        total = sum(lengths)
        self.last = (Placed(utterance, mean, out[0], min(total, 4.0) if total >= MIN_NEW_S
                            else 0.0) if len(set(out)) == 1 else None)
        return out, relabel

    def _recheck(self) -> tuple[int, int] | None:
        """Place the previous final again against the means as they are now."""
        last = self.last
        if last is None or last.weight <= 0 or len(self.known()) < 2:
            return None
        self.remove(last.speaker, last.vector, last.weight)
        best, sim = self.nearest(last.vector)
        if best < 0 or best == last.speaker or sim < self.join:
            self.add(last.speaker, last.vector, last.weight)
            return None
        self.add(best, last.vector, last.weight)
        return last.utterance, best

    def to_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"sums": [encode_vector(s) for s in self.sums],
                                 "weights": self.weights}
        if self.last is not None:
            state["last"] = [self.last.utterance, encode_vector(self.last.vector),
                             self.last.speaker, self.last.weight]
        return state

    @classmethod
    def from_state(cls, state: Mapping[str, Any] | None, join: float = JOIN) -> Clusters:
        if not state:
            return cls(join=join)
        last = state.get("last")
        return cls([decode_vector(s) for s in state["sums"]],
                   [float(w) for w in state["weights"]],
                   Placed(int(last[0]), decode_vector(last[1]), int(last[2]), float(last[3]))
                   if last else None, join)


def majority(labels: Sequence[int], weights: Sequence[float]) -> int:
    """The label with the most weight (the first of equals)."""
    totals: dict[int, float] = {}
    for who, w in zip(labels, weights, strict=True):
        totals[who] = totals.get(who, 0.0) + w
    return max(totals, key=lambda k: (totals[k], -labels.index(k)))


def label_words(result: dict[str, Any], spans: Sequence[tuple[float, float, str]]) -> None:
    """Set ``speaker`` on a final and its words: each word is its piece's (the piece
    holding the word's middle, else the nearest), the final the speaker of most time."""
    def at(t: float) -> str:
        for start, end, who in spans:
            if start <= t <= end:
                return who
        return min(spans, key=lambda s: min(abs(t - s[0]), abs(t - s[1])))[2]
    for word in result.get("words") or []:
        word["speaker"] = at((word["start"] + word["end"]) / 2)
    names = [who for _, _, who in spans]
    order = list(dict.fromkeys(names))
    index = majority([order.index(n) for n in names], [e - s for s, e, _ in spans])
    result["speaker"] = order[index]


# ---- whole files ------------------------------------------------------------------------

def recluster(finals: Sequence[Mapping[str, Any]], min_speakers: int = 1,
              max_speakers: int = MAX_SPEAKERS, join: float = FILE_JOIN) -> list[dict[str, Any]]:
    """Finals (as a client received them, each with ``voices``: ``[start, end, vector]``
    per piece) labelled again by clustering all their pieces at once: ``speaker`` on each
    final and word, ``S1`` the first to speak. Finals without voices keep their label."""
    from scipy.cluster.hierarchy import fcluster, linkage

    spans = [(i, float(s), float(e), decode_voice(v))
             for i, f in enumerate(finals) for s, e, v in f.get("voices") or []]
    out = [dict(f, words=[dict(w) for w in f.get("words") or []]) for f in finals]
    if not spans:
        return out
    vectors = np.array([_unit(v) for *_, v in spans])
    if len(spans) == 1:
        groups = np.array([1])
    else:
        tree = linkage(vectors, "average", metric="cosine")
        groups = fcluster(tree, 1 - join, "distance")
        found = len(set(groups))
        if found > max_speakers or found < min_speakers:
            wanted = min(max(found, min_speakers), max_speakers, len(spans))
            groups = fcluster(tree, wanted, "maxclust")
    names: dict[int, str] = {}
    by_final: dict[int, list[tuple[float, float, str]]] = {}
    for (i, s, e, _), g in zip(spans, groups, strict=True):
        name = names.setdefault(int(g), label(len(names)))
        by_final.setdefault(i, []).append((s, e, name))
    for i, spans_i in by_final.items():
        label_words(out[i], spans_i)
        out[i].pop("voices", None)
    return out


def apply_relabel(finals: Sequence[dict[str, Any]], utterance: int, speaker: str) -> None:
    """A ``relabel`` message, applied to the finals a client holds: the final of that
    utterance and its words belong to ``speaker``."""
    for final in finals:
        if final.get("utterance") == utterance:
            final["speaker"] = speaker
            for word in final.get("words") or []:
                word["speaker"] = speaker


# ---- the session's audio ----------------------------------------------------------------

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

    def embed(self, samples: np.ndarray) -> np.ndarray:
        wav = self._audio.normalize_volume(samples, -30, increase_only=True)
        return np.asarray(self._model.embed_utterance(wav), dtype=np.float32)


class EmbedJob:
    """Pieces of audio to embed (a ``messages.Deferred``): once ``done``, ``result`` has
    ``_voices``, ``[(start, end, vector)]`` per piece, for the speaker rule."""

    def __init__(self, spans: list[tuple[float, float, np.ndarray]]):
        self.spans = spans
        self.done = False
        self.failed = False
        self.dropped = False
        self.result: dict[str, Any] = {}
        self.after: dict[str, Any] = {}
        self.voices: list[tuple[float, float, np.ndarray]] = []


class Embedder:
    """The process's embedder thread: jobs in the order given, its busy time sampled for
    admission (``sample``)."""

    def __init__(self, encoder_factory: Any = Encoder):
        self._factory = encoder_factory
        self._jobs: queue.Queue[EmbedJob | None] = queue.Queue()
        self._busy = 0.0
        self._since = time.monotonic()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="speaker-embedder",
                                        daemon=True)
        self._thread.start()

    def submit(self, job: EmbedJob) -> EmbedJob:
        self._jobs.put(job)
        return job

    def sample(self) -> float:
        """The fraction of the time since the last call spent embedding."""
        with self._lock:
            now = time.monotonic()
            busy, self._busy = self._busy, 0.0
            span, self._since = now - self._since, now
        return busy / span if span > 0 else 0.0

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        encoder = None
        while True:
            job = self._jobs.get()
            if job is None:
                return
            began = time.monotonic()
            try:
                if encoder is None:
                    encoder = self._factory()
                job.voices = [(s, e, encoder.embed(a)) for s, e, a in job.spans]
                job.result = {"_voices": job.voices}
            except Exception:  # noqa: BLE001 - a failed embedding ends only its session
                log.exception("speaker embedding failed")
                job.failed = True
            with self._lock:
                self._busy += time.monotonic() - began
            job.done = True


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


def best_mapping(truth: Sequence[str], found: Sequence[str]) -> dict[str, str]:
    """The mapping of found labels to true speakers that makes the most items right (for
    tests and benchmarks: labels are arbitrary names)."""
    names_t = sorted(set(truth))
    names_f = sorted(set(found))
    best: dict[str, str] = {}
    score = -1
    perms = itertools.permutations
    if len(names_f) <= len(names_t):
        options = (dict(zip(names_f, p, strict=True)) for p in perms(names_t, len(names_f)))
    else:
        options = (dict(zip(p, names_t, strict=True)) for p in perms(names_f, len(names_t)))
    for mapping in options:
        right = sum(mapping.get(f) == t for t, f in zip(truth, found, strict=True))
        if right > score:
            best, score = mapping, right
    return best


# ---- a session's speakers, in the worker ------------------------------------------------

class SessionSpeakers:
    """What the worker keeps for a session that asked for speaker labels: its recent audio,
    its clusters (checkpointed) and the guess for its open utterance.

    ``wrap`` gives each final an embedding job (its result waits in the outbox until both
    its text and its pieces' vectors are there), ``rule`` labels results as they are
    published, in order, and ``state`` is what the checkpoint stored with them holds.
    """

    def __init__(self, options: Options, embedder: Embedder,
                 checkpoint: Mapping[str, Any] | None = None, join: float = JOIN):
        cp = checkpoint or {}
        self.options = options
        self.embedder = embedder
        self.clusters = Clusters.from_state(cp.get("speakers"), join)
        self.window = AudioWindow(int(cp.get("speakers_pos", 0)))
        self.last_speaker: str | None = cp.get("speakers_last") or None
        self._guess: tuple[float, EmbedJob] | None = None

    def feed(self, pcm: bytes, rate: int) -> None:
        self.window.feed(pcm, rate)

    @property
    def position(self) -> dict[str, Any]:
        """The checkpoint's field taken at its entry: where the session's audio is."""
        return {"speakers_pos": self.window.position}

    def state(self) -> dict[str, Any]:
        """The checkpoint's fields taken as its entry's results are published."""
        return {"speakers": self.clusters.to_state(),
                "speakers_last": self.last_speaker or ""}

    def _job(self, start: float, end: float, cut: bool) -> EmbedJob:
        audio, first = self.window.span(start, end)
        spans = [(round(first + a / RATE, 3), round(first + b / RATE, 3), audio[a:b])
                 for a, b in (pieces(audio) if cut else [(0, len(audio))])] if len(audio) else []
        return self.embedder.submit(EmbedJob(spans))

    def wrap(self, items: Sequence[Any]) -> list[Any]:
        """An entry's items with an embedding job on each final; a partial long enough
        starts the guess of its utterance's speaker."""
        from .messages import Scheduled
        out: list[Any] = []
        for item in items:
            result = item.result if isinstance(item, Scheduled) else item
            kind = result.get("type")
            if kind == "final":
                job = self._job(float(result["start"]), float(result["end"]), cut=True)
                self._guess = None
                if isinstance(item, Scheduled):
                    item = Scheduled(item.result, Both(item.job, job), item.rules)
                else:
                    item = Scheduled(item, job)
            elif kind == "partial":
                start, end = float(result["start"]), float(result["end"])
                if end - start >= GUESS_S and (self._guess is None or self._guess[0] != start):
                    self._guess = (start, self._job(start, end, cut=False))
            out.append(item)
        return out

    def rule(self, result: Any) -> Any:
        """The speaker stage's rule: a final's labels (and a relabel of the one before),
        a partial's likely label."""
        kind = result.get("type")
        if kind == "final":
            return self._final(result)
        if kind == "partial":
            return {**result, "speaker": self._likely(float(result["start"]))}
        return result

    def _likely(self, start: float) -> str:
        guess = self._guess
        if guess is not None and guess[0] == start and guess[1].done and guess[1].voices:
            vector = guess[1].voices[0][2]
            return label(self.clusters.choose(vector, GUESS_S, self.options))
        return self.last_speaker or label(0)

    def _final(self, result: Any) -> Any:
        out = dict(result)
        voices = out.pop("_voices", None) or []
        if not voices:
            speaker = self.last_speaker or label(0)
            label_words(out, [(float(out["start"]), float(out["end"]), speaker)])
            self.last_speaker = speaker
            return out
        out["words"] = [dict(w) for w in out.get("words") or []]
        who, relabel = self.clusters.place(int(out.get("utterance", 0)), voices, self.options)
        label_words(out, [(s, e, label(i)) for (s, e, _), i in zip(voices, who, strict=True)])
        if self.options.mode == "file":
            out["voices"] = [[s, e, encode_voice(v)] for s, e, v in voices]
        if relabel is not None:
            out["relabel"] = {"utterance": relabel[0], "speaker": label(relabel[1])}
        self.last_speaker = out["speaker"]
        return out
