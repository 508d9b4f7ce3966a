"""Speaker labels, the pure part: labels and the options a session asks for, a final cut
into pieces at its pauses, the clustering of the pieces' voices (``cluster``, and
``recluster`` for a whole file), labels on words, and how well labels match a truth."""

from __future__ import annotations

import base64
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger("cosyvoice.speakers")

RATE = 16000  # what the speaker encoder takes
JOIN = 0.78  # groups of pieces merge down to this average cosine similarity
MIN_NEW_S = 1.0  # a piece shorter than this joins the groups the longer ones make
MIN_PIECE_S = 1.0  # pauses cut a final into pieces no shorter than this
PAUSE_S = 0.3  # the quiet that may separate two speakers inside one final
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
