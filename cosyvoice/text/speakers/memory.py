"""A session's speakers as its checkpoint keeps them (``Memory``, pure): its recent pieces
and an anchor voice per speaker, clustered again at each final, labels kept stable."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .clustering import (
    JOIN,
    MIN_NEW_S,
    Options,
    Piece,
    _f16,
    _unit,
    cluster,
    decode_voice,
    encode_voice,
    stable_labels,
)

log = logging.getLogger("cosyvoice.speakers")

MAX_PIECES = 48  # a session's pieces kept for clustering (older ones: an anchor a speaker)
ANCHOR_CAP_S = 30.0  # an anchor weighs at most this many seconds of speech


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
