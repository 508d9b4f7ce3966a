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

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from .clustering import (  # noqa: F401 - the package's names
    FRAME,
    JOIN,
    MAX_SPEAKERS,
    MIN_NEW_S,
    MIN_PIECE_S,
    PAUSE_S,
    QUIET_DB,
    RATE,
    Options,
    Piece,
    apply_relabel,
    best_mapping,
    cluster,
    decode_voice,
    encode_voice,
    label,
    label_index,
    label_words,
    main_speaker,
    parse_auth,
    pieces,
    recluster,
    stable_labels,
)
from .embedder import (  # noqa: F401 - the package's names
    CHANGE,
    CHANGE_CONTEXT,
    CHANGE_MIN_S,
    CHANGE_SEARCH_S,
    KEEP_S,
    REFINE_S,
    REFINE_STEP_S,
    WINDOW_RATE,
    AudioWindow,
    Both,
    Embedder,
    EmbedJob,
    Encoder,
    voice_changes,
)
from .memory import (  # noqa: F401 - the package's names
    ANCHOR_CAP_S,
    MAX_PIECES,
    Memory,
)

log = logging.getLogger("cosyvoice.speakers")

GUESS_S = 1.6  # an open utterance's label is guessed once it has this much audio


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
        from ...wire.messages import Scheduled
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
            from ... import metrics
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
