"""Speaker labels: who said each final, live and for whole files.

A session that asks (``auth.diarize``) gets ``speaker`` (``S1``, ``S2``, … in the order
they first speak) on every final and on each of its words, and on its partials the label
the open utterance will likely get. The unit is the utterance the endpointer cuts:

- **Pieces.** A final's audio (the worker keeps the session's recent audio at 16 kHz,
  ``AudioWindow``) is cut at its inner pauses (``PAUSE_S`` of quiet, pieces at least
  ``MIN_PIECE_S`` long), and each part again where its voice changes
  (``voice_changes``: the speaker encoder's 1.6 s windows, two a second, before a point
  and after it less alike than ``CHANGE``), so one piece rarely holds two speakers, even where one
  answers without a pause. Each piece has a vector, a 256-dimension d-vector from the
  GE2E speaker encoder of ``resemblyzer`` (weights in its wheel), computed on the
  worker's embedder thread (``Embedder``) while the final's text is decoded.
- **Clustering at each final** (``Memory``, pure, in the session's checkpoint so a worker
  that takes the session over gives the same labels): the new final's pieces and the
  session's recent ones (``MAX_PIECES``; older ones are kept as one anchor vector per
  speaker) are clustered again, average-linkage agglomerative clustering on cosine
  distance cut at ``JOIN`` (0.78) average similarity, or at the number of speakers asked
  for (``cluster``); pieces under ``MIN_NEW_S`` are too short to shape the groups and
  join the nearest one. The groups keep the speakers' indexes (``stable_labels``), and
  every earlier final whose pieces end up with another speaker is said to have moved: a
  ``relabel`` message (never silently).
- **Whole files** (``recluster``): with ``auth.diarize: "file"`` each final also carries
  its pieces' vectors (``voices``), and the client that has them all (``cosyvoice
  transcribe``, the file API) clusters every piece of the recording at once at its end.

The thresholds were chosen on synthetic voices (festival's slt, kal and ked, and the
Mandarin fixtures' voice): one turn against another of the same voice 0.74-1.0 (5 % under
0.81), of the two close male voices 0.57-0.83 (95 % under 0.80), of the others under 0.61
(docs/speakers.md has the runs). Real recordings may want other values:
``COSYVOICE_SPEAKER_JOIN`` sets ``JOIN``.
"""

from __future__ import annotations

import base64
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger("cosyvoice.speakers")

RATE = 16000  # what the speaker encoder takes
JOIN = 0.78  # groups of pieces merge down to this average cosine similarity
MIN_NEW_S = 1.0  # a piece shorter than this joins the groups the longer ones make
MAX_PIECES = 48  # a session's pieces kept for clustering (older ones: an anchor a speaker)
ANCHOR_CAP_S = 30.0  # an anchor weighs at most this many seconds of speech
MIN_PIECE_S = 1.0  # pauses cut a final into pieces no shorter than this
PAUSE_S = 0.3  # the quiet that may separate two speakers inside one final
GUESS_S = 1.6  # an open utterance's label is guessed once it has this much audio
CHANGE = 0.80  # a piece is cut where its windows before and after are less alike than this
CHANGE_MIN_S = 2.5  # ... if it is at least this long (two windows of the encoder, and more)
CHANGE_CONTEXT = 3  # windows each side of a point compared (a turn in the middle shows)
WINDOW_RATE = 2.0  # the encoder's 1.6 s windows a second (resemblyzer's default is 1.3)
CHANGE_SEARCH_S = 0.6  # the cut is looked for this near the windows' guess
REFINE_S = 0.8  # ... by the voice of this much audio either side of each candidate
REFINE_STEP_S = 0.05  # ... a candidate every 50 ms, then the quietest 90 ms near the best
KEEP_S = 45.0  # audio the worker keeps per session (more than the longest utterance)
MAX_SPEAKERS = 16  # what auth accepts for speakers/min_speakers/max_speakers
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
class Piece:
    """A piece of a final as the session remembers it: its final (``utterance``), times,
    vector (float16 precision, as the checkpoint stores it) and speaker index."""
    utterance: int
    start: float
    end: float
    vector: np.ndarray
    speaker: int = -1

    @property
    def seconds(self) -> float:
        return self.end - self.start


def _f16(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, dtype="<f2").astype(np.float32)


def stable_labels(groups: Sequence[int], before: Sequence[int],
                  weights: Sequence[float]) -> dict[int, int]:
    """Speaker indexes for the groups of a new clustering that keep the old ones: the
    heaviest group first takes the index most of its pieces had (by ``weights``; -1: a
    new piece), each index once; a group left without one gets the lowest index nobody
    holds."""
    order = sorted(set(groups), key=lambda g: (-sum(w for x, w in zip(groups, weights,
                                                                       strict=True) if x == g),
                                               g))
    taken: dict[int, int] = {}
    for g in order:
        votes: dict[int, float] = {}
        for x, old, w in zip(groups, before, weights, strict=True):
            if x == g and old >= 0 and old not in taken.values():
                votes[old] = votes.get(old, 0.0) + w
        if votes:
            taken[g] = max(votes, key=lambda k: (votes[k], -k))
    for g in order:
        if g not in taken:
            taken[g] = next(i for i in itertools.count() if i not in taken.values())
    return taken


@dataclass
class Memory:
    """The speakers a session has met, as the pieces of its recent finals (at most
    ``MAX_PIECES``) and, for older pieces, an anchor per speaker (the sum of their unit
    vectors and their seconds). Each final's pieces are clustered again with all of these
    (``cluster``, as a whole file is), and the groups keep the speakers' indexes
    (``stable_labels``): what the new final shows about the voices can move an earlier
    final to another speaker (a relabel), and a speaker's first words are judged with
    what they said later."""
    pieces: list[Piece] = field(default_factory=list)
    anchors: dict[int, tuple[np.ndarray, float]] = field(default_factory=dict)
    join: float = JOIN

    def _items(self) -> tuple[list[np.ndarray], list[float], list[int]]:
        """Vectors, seconds and speakers of the pieces and anchors."""
        held = sorted(self.anchors)
        return ([p.vector for p in self.pieces] + [_unit(self.anchors[k][0]) for k in held],
                [p.seconds for p in self.pieces]
                + [max(MIN_NEW_S, min(self.anchors[k][1], ANCHOR_CAP_S)) for k in held],
                [p.speaker for p in self.pieces] + held)

    def place(self, utterance: int, voices: Sequence[tuple[float, float, np.ndarray]],
              options: Options) -> tuple[list[int], list[tuple[int, list[tuple[float, float,
                                                                            int]]]]]:
        """Place a final's pieces ((start, end, vector) each): the speaker index of each,
        and the earlier finals whose pieces' speakers changed, (utterance, its pieces'
        (start, end, speaker)) each, taken before the oldest pieces are forgotten."""
        before = self._by_final()
        new = [Piece(utterance, float(s), float(e), _f16(v)) for s, e, v in voices]
        self.pieces += new
        vectors, seconds, speakers_ = self._items()
        groups = cluster(vectors, seconds, options.min_speakers, options.max_speakers,
                         self.join)
        mapping = stable_labels(groups, speakers_, seconds)
        for p, g in zip(self.pieces, groups, strict=False):
            p.speaker = mapping[g]
        after = self._by_final()
        changed = [(u, after[u]) for u in before if after[u] != before[u]]
        self._forget()
        return [p.speaker for p in new], changed

    def _by_final(self) -> dict[int, list[tuple[float, float, int]]]:
        """Each final's pieces, (start, end, speaker), by utterance."""
        out: dict[int, list[tuple[float, float, int]]] = {}
        for p in self.pieces:
            out.setdefault(p.utterance, []).append((p.start, p.end, p.speaker))
        return out

    def _forget(self) -> None:
        """Fold the oldest pieces past ``MAX_PIECES`` into their speakers' anchors."""
        while len(self.pieces) > MAX_PIECES:
            old = self.pieces.pop(0)
            total, weight = self.anchors.get(old.speaker, (np.zeros_like(old.vector), 0.0))
            self.anchors[old.speaker] = (_f16(total + old.seconds * _unit(old.vector)),
                                         weight + old.seconds)

    def likely(self, vector: np.ndarray, options: Options) -> int:
        """The speaker a piece would most likely get now, without placing it: the
        nearest speaker's index, or a new one's where none is alike enough."""
        vectors, seconds, speakers_ = self._items()
        if not vectors:
            return 0
        sums: dict[int, np.ndarray] = {}
        for v, n, k in zip(vectors, seconds, speakers_, strict=True):
            sums[k] = sums.get(k, 0) + n * _unit(v)
        names = sorted(sums)
        sims = np.array([_unit(sums[k]) for k in names]) @ _unit(vector)
        best = int(np.argmax(sims))
        if sims[best] >= self.join or len(names) >= options.max_speakers:
            return names[best]
        return next(i for i in itertools.count() if i not in sums)

    def to_state(self) -> dict[str, Any]:
        return {"pieces": [[p.utterance, p.start, p.end, p.speaker, encode_voice(p.vector)]
                           for p in self.pieces],
                "anchors": [[k, w, encode_voice(v)] for k, (v, w) in sorted(self.anchors.items())]}

    @classmethod
    def from_state(cls, state: Mapping[str, Any] | None, join: float = JOIN) -> Memory:
        if not state:
            return cls(join=join)
        return cls([Piece(int(u), float(s), float(e), decode_voice(v), int(k))
                    for u, s, e, k, v in state.get("pieces", [])],
                   {int(k): (decode_voice(v), float(w)) for k, w, v in state.get("anchors", [])},
                   join)


def main_speaker(spans: Sequence[tuple[float, float, str]]) -> str:
    """The speaker of most of the spans' time (of equals, the first to speak)."""
    totals: dict[str, float] = {}
    for start, end, who in spans:
        totals[who] = totals.get(who, 0.0) + end - start
    first = [who for *_, who in spans]
    return max(totals, key=lambda k: (totals[k], -first.index(k)))


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
    result["speaker"] = main_speaker(spans)


# ---- whole files ------------------------------------------------------------------------

def cluster(vectors: Sequence[np.ndarray], seconds: Sequence[float], min_speakers: int = 1,
            max_speakers: int = MAX_SPEAKERS, join: float = JOIN) -> list[int]:
    """A group for each piece: average-linkage agglomerative clustering on cosine distance
    of the pieces of at least ``MIN_NEW_S`` (a shorter one's vector is too noisy to shape
    the groups), cut at ``join`` similarity or at the number of speakers asked for; each
    shorter piece then joins the group whose mean is nearest."""
    from scipy.cluster.hierarchy import fcluster, linkage

    units = np.array([_unit(v) for v in vectors])
    long = [i for i, n in enumerate(seconds) if n >= MIN_NEW_S] or list(range(len(units)))
    if len(long) == 1:
        found = np.array([1])
    else:
        tree = linkage(units[long], "average", metric="cosine")
        found = fcluster(tree, 1 - join, "distance")
        count = len(set(found))
        if count > max_speakers or count < min_speakers:
            wanted = min(max(count, min_speakers), max_speakers, len(long))
            found = fcluster(tree, wanted, "maxclust")
    groups = [-1] * len(units)
    for i, g in zip(long, found, strict=True):
        groups[i] = int(g)
    names = sorted(set(groups) - {-1})
    means = np.array([_unit(units[[i for i in long if groups[i] == g]].sum(axis=0))
                      for g in names])
    for i, g in enumerate(groups):
        if g == -1:
            groups[i] = names[int(np.argmax(means @ units[i]))]
    return groups


def recluster(finals: Sequence[Mapping[str, Any]], min_speakers: int = 1,
              max_speakers: int = MAX_SPEAKERS, join: float = JOIN) -> list[dict[str, Any]]:
    """Finals (as a client received them, each with ``voices``: ``[start, end, vector]``
    per piece) labelled again by clustering all their pieces at once: ``speaker`` on each
    final and word, ``S1`` the first to speak. Finals without voices keep their label."""
    spans = [(i, float(s), float(e), decode_voice(v))
             for i, f in enumerate(finals) for s, e, v in f.get("voices") or []]
    out = [dict(f, words=[dict(w) for w in f.get("words") or []]) for f in finals]
    if not spans:
        return out
    groups = cluster([v for *_, v in spans], [e - s for _, s, e, _ in spans],
                     min_speakers, max_speakers, join)
    names: dict[int, str] = {}
    by_final: dict[int, list[tuple[float, float, str]]] = {}
    for (i, s, e, _), g in zip(spans, groups, strict=True):
        name = names.setdefault(int(g), label(len(names)))
        by_final.setdefault(i, []).append((s, e, name))
    for i, spans_i in by_final.items():
        label_words(out[i], spans_i)
        out[i].pop("voices", None)
    return out


def apply_relabel(finals: Sequence[dict[str, Any]], utterance: int, speaker: str,
                  spans: Sequence[Sequence[Any]] | None = None) -> None:
    """A ``relabel`` message, applied to the finals a client holds: the final of that
    utterance belongs to ``speaker``, and so do its words, or where ``spans`` (start, end,
    speaker) are given, each word to the span that holds its middle."""
    for final in finals:
        if final.get("utterance") != utterance:
            continue
        if spans:
            label_words(final, [(float(a), float(b), str(who)) for a, b, who in spans])
        else:
            for word in final.get("words") or []:
                word["speaker"] = speaker
        final["speaker"] = speaker


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
        from .. import metrics  # only in worker processes (after metrics_dir.choose)
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
    the speakers it met (its ``Memory``, checkpointed) and the guess for its open utterance.

    ``wrap`` gives each final an embedding job (its result waits in the outbox until both
    its text and its pieces' vectors are there), ``rule`` labels results as they are
    published, in order, and ``state`` is what the checkpoint stored with them holds.
    """

    def __init__(self, options: Options, embedder: Embedder,
                 checkpoint: Mapping[str, Any] | None = None, join: float = JOIN):
        cp = checkpoint or {}
        self.options = options
        self.embedder = embedder
        self.memory = Memory.from_state(cp.get("speakers"), join)
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
        return {"speakers": self.memory.to_state(),
                "speakers_last": self.last_speaker or ""}

    def _job(self, start: float, end: float, cut: bool) -> EmbedJob:
        audio, first = self.window.span(start, end)
        spans = [(round(first + a / RATE, 3), round(first + b / RATE, 3), audio[a:b])
                 for a, b in (pieces(audio) if cut else [(0, len(audio))])] if len(audio) else []
        return self.embedder.submit(EmbedJob(spans, cut))

    def wrap(self, items: Sequence[Any]) -> list[Any]:
        """An entry's items with an embedding job on each final; a partial long enough
        starts the guess of its utterance's speaker."""
        from ..wire.messages import Scheduled
        out: list[Any] = []
        for item in items:
            result = item.result if isinstance(item, Scheduled) else item
            kind = result.get("type")
            if kind == "final":
                job = self._job(float(result["start"]), float(result["end"]), cut=True)
                self._new_guess(None)
                if isinstance(item, Scheduled):
                    item = Scheduled(item.result, Both(item.job, job), item.rules)
                else:
                    item = Scheduled(item, job)
            elif kind == "partial":
                start, end = float(result["start"]), float(result["end"])
                if end - start >= GUESS_S and (self._guess is None or self._guess[0] != start):
                    self._new_guess((start, self._job(start, end, cut=False)))
            out.append(item)
        return out

    def _new_guess(self, guess: tuple[float, EmbedJob] | None) -> None:
        """The open utterance's guess from now on; the one before it is overtaken."""
        if self._guess is not None:
            self._guess[1].stale = True
        self._guess = guess

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
            return label(self.memory.likely(vector, self.options))
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
        who, changed = self.memory.place(int(out.get("utterance", 0)), voices, self.options)
        label_words(out, [(s, e, label(i)) for (s, e, _), i in zip(voices, who, strict=True)])
        if self.options.mode == "file":
            out["voices"] = [[s, e, encode_voice(v)] for s, e, v in voices]
        if changed:
            out["relabel"] = [relabel(u, spans) for u, spans in changed]
            from .. import metrics
            metrics.SPEAKER_RELABELS.inc(len(changed))
        self.last_speaker = out["speaker"]
        return out


def relabel(utterance: int, parts: Sequence[tuple[float, float, int]]) -> dict[str, Any]:
    """The ``relabel`` of an earlier final from its pieces (start, end, speaker index): its
    speaker (that of most of its time) and, where its pieces now have different speakers,
    each piece's."""
    spans = [(s, e, label(k)) for s, e, k in parts]
    change: dict[str, Any] = {"utterance": utterance, "speaker": main_speaker(spans)}
    if len({who for *_, who in spans}) > 1:
        change["spans"] = [[s, e, who] for s, e, who in spans]
    return change
