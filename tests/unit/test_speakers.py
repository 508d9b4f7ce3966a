"""Speaker labels' rules (cosyvoice/text/speakers/) on the real speaker encoder and the speaker
fixtures (three festival voices): pieces cut at pauses, online clustering and its
checkpoint, the relabel of the final before, whole-file clustering, the auth options."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from cosyvoice.text import speakers
from cosyvoice.text.speakers import Memory, Options, SessionSpeakers
from cosyvoice.text.speakers import memory as speaker_memory

from ..helpers import conversation, read_pcm, speaker_texts

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def encoder() -> speakers.Encoder:
    return speakers.Encoder()


def audio(name: str) -> np.ndarray:
    return np.frombuffer(read_pcm(name), dtype="<i2").astype(np.float32) / 32768.0


@pytest.fixture(scope="module")
def vectors(encoder) -> dict[str, tuple[str, np.ndarray, float]]:
    """name -> (voice, vector, seconds) of every speaker fixture."""
    return {name: (voice, encoder.embed(audio(name)), len(audio(name)) / speakers.RATE)
            for name, (voice, _) in speaker_texts().items()}


def interleaved(vectors, voices: list[str], turns: int) -> list[tuple[str, str]]:
    """(voice, name) per turn, the voices taking turns in order."""
    pools = {v: [n for n, (voice, _, _) in vectors.items() if voice == v] for v in voices}
    return [(voices[i % len(voices)], pools[voices[i % len(voices)]].pop(0))
            for i in range(turns)]


def place_all(memory: Memory, vectors, turns, options: Options | None = None) -> list[int]:
    """Each turn's final placed in order: the labels as shown, relabels applied."""
    options = options or Options()
    shown: list[int] = []
    for i, (_, name) in enumerate(turns):
        _, vector, seconds = vectors[name]
        who, changed = memory.place(i, [(3.0 * i, 3.0 * i + seconds, vector)], options)
        shown.append(who[0])
        for utterance, now in changed:
            shown[utterance] = now[0][2]
    return shown


@pytest.mark.parametrize("voices", [["slt", "kal"], ["kal", "ked"], ["slt", "kal", "ked"]])
def test_each_voice_gets_its_own_label_in_order_of_appearance(vectors, voices):
    turns = interleaved(vectors, voices, 8 * len(voices) - 2)
    got = place_all(Memory(), vectors, turns)
    assert got == [i % len(voices) for i in range(len(turns))]  # S1 first, S2 second, ...


def test_max_speakers_caps_and_min_speakers_splits(vectors):
    turns = interleaved(vectors, ["slt", "kal", "ked"], 9)
    assert len(set(place_all(Memory(), vectors, turns, Options(max_speakers=2)))) == 2
    # all the same voice, but the caller says there are two
    same = [("kal", n) for n in sorted(n for n, (v, _, _) in vectors.items() if v == "kal")]
    assert len(set(place_all(Memory(), vectors, same, Options(min_speakers=2)))) == 2
    assert len(set(place_all(Memory(), vectors, same))) == 1


def test_the_memory_round_trips_through_a_checkpoint_and_forgets_into_anchors(vectors):
    turns = interleaved(vectors, ["kal", "ked"], 16)
    whole = Memory()
    labels = [whole.place(i, [(3.0 * i, 3.0 * i + vectors[n][2], vectors[n][1])], Options())[0]
              for i, (_, n) in enumerate(turns)]
    first = Memory()
    for i, (_, n) in enumerate(turns[:7]):
        first.place(i, [(3.0 * i, 3.0 * i + vectors[n][2], vectors[n][1])], Options())
    resumed = Memory.from_state(json.loads(json.dumps(first.to_state())))
    again = [resumed.place(i + 7, [(3.0 * (i + 7), 3.0 * (i + 7) + vectors[n][2],
                                    vectors[n][1])], Options())[0]
             for i, (_, n) in enumerate(turns[7:])]
    assert again == labels[7:]
    # a memory of 4 pieces keeps the speakers apart by their anchors
    small = Memory()
    old, speaker_memory.MAX_PIECES = speaker_memory.MAX_PIECES, 4
    try:
        shown = place_all(small, vectors, turns)
    finally:
        speaker_memory.MAX_PIECES = old
    assert len(small.pieces) == 4 and set(small.anchors) == {0, 1}
    assert shown == [i % 2 for i in range(len(turns))]


def test_a_later_final_relabels_an_earlier_one():
    """One voice's first final, a little apart from the rest of it, is a speaker of its
    own until the finals after it show it to be the same voice: then it is moved, and
    said so."""
    def at(degrees: float) -> np.ndarray:
        v = np.zeros(256, dtype=np.float32)
        v[0], v[1] = np.cos(np.radians(degrees)), np.sin(np.radians(degrees))
        return v
    memory = Memory()
    assert memory.place(0, [(0, 3, at(0))], Options()) == ([0], [])
    assert memory.place(1, [(4, 7, at(40))], Options()) == ([1], [])  # cos 0.77: apart
    who, changed = memory.place(2, [(8, 11, at(20))], Options())  # between: all one voice
    assert who == [0] and changed == [(1, [(4.0, 7.0, 0)])]
    assert {p.speaker for p in memory.pieces} == {0}
    # the freed label is the next new speaker's
    assert memory.place(3, [(12, 15, at(90))], Options())[0] == [1]
    # a final moved as its pieces are forgotten (into anchors) is still said to move
    small = Memory()
    old, speaker_memory.MAX_PIECES = speaker_memory.MAX_PIECES, 1
    try:
        small.place(0, [(0, 3, at(0))], Options())
        small.place(1, [(4, 7, at(40))], Options())
        who, changed = small.place(2, [(8, 11, at(20))], Options())
    finally:
        speaker_memory.MAX_PIECES = old
    assert [p.utterance for p in small.pieces] == [2]
    assert changed == [(1, [(4.0, 7.0, 0)])]
    assert speakers.relabel(1, changed[0][1]) == {"utterance": 1, "speaker": "S1"}


def test_stable_labels_keep_the_old_indexes():
    # groups 7 and 3 (the clustering's own numbers): 7 holds what was speaker 1
    assert speakers.stable_labels([7, 7, 3, 3, 7], [1, 1, 0, -1, -1], [1] * 5) == {7: 1, 3: 0}
    # two old speakers merged: the heavier keeps its index; a new group takes the lowest free
    assert speakers.stable_labels([5, 5, 5, 9], [0, 1, 1, -1], [1, 1, 1, 1]) == {5: 1, 9: 0}


def test_a_voice_change_without_a_pause_cuts_a_piece(encoder):
    def trimmed(x: np.ndarray) -> np.ndarray:  # the fixtures' own silence at both ends
        loud = np.flatnonzero(np.abs(x) > 0.01)
        return x[loud[0]:loud[-1] + 1]
    one, two = trimmed(audio("speakers/slt3")), trimmed(audio("speakers/kal3"))
    cuts = encoder.pieces(np.concatenate([one, two]))
    assert len(cuts) == 2
    assert abs(cuts[0][1] - len(one)) < 0.25 * speakers.RATE  # within a quarter second
    same = encoder.pieces(np.concatenate([one, trimmed(audio("speakers/slt4"))]))
    assert len(same) == 1 or float(same[0][2] @ same[1][2]) > 0.7


def test_pieces_are_cut_at_pauses_only():
    one = audio("speakers/slt1")
    two = audio("speakers/kal1")
    assert speakers.pieces(one) == [(0, len(one))]
    gap = np.zeros(int(0.5 * speakers.RATE), dtype=np.float32)
    cuts = speakers.pieces(np.concatenate([one, gap, two]))
    assert len(cuts) == 2
    assert len(one) <= cuts[0][1] <= len(one) + len(gap)
    def trimmed(x: np.ndarray) -> np.ndarray:  # the fixtures' own silence at both ends
        loud = np.flatnonzero(np.abs(x) > 0.01)
        return x[loud[0]:loud[-1] + 1]
    tight = speakers.pieces(np.concatenate([trimmed(one), np.zeros(800, dtype=np.float32),
                                            trimmed(two)]))
    assert len(tight) == 1  # 50 ms is no pause


def test_whole_file_clustering_labels_every_piece(vectors):
    turns = interleaved(vectors, ["slt", "kal", "ked"], 15)
    finals = [{"type": "final", "utterance": i, "start": 3.0 * i, "end": 3.0 * i + 2,
               "words": [{"word": "a", "start": 3.0 * i, "end": 3.0 * i + 1, "conf": 1}],
               "voices": [[3.0 * i, 3.0 * i + 2, speakers.encode_voice(vectors[n][1])]]}
              for i, (_, n) in enumerate(turns)]
    out = speakers.recluster(finals)
    assert [f["speaker"] for f in out] == [f"S{i % 3 + 1}" for i in range(15)]
    assert all(f["words"][0]["speaker"] == f["speaker"] for f in out)
    assert all("voices" not in f for f in out)
    two = speakers.recluster(finals, max_speakers=2)
    assert len({f["speaker"] for f in two}) == 2


def test_a_session_labels_finals_words_and_partials(encoder):
    """SessionSpeakers as the worker drives it: audio fed, finals wrapped with an
    embedding job, labels set as the results are published, state in the checkpoint."""
    pcm, truth = conversation(["speakers/slt1", "speakers/kal1", "speakers/slt2",
                               "speakers/kal2"])
    embedder = speakers.Embedder(lambda: encoder)
    try:
        session = SessionSpeakers(Options(), embedder)
        session.feed(pcm, 16000)
        labels = []
        for i, (_, start, end, _) in enumerate(truth):
            final = {"type": "final", "text": "x", "utterance": i, "start": start, "end": end,
                     "words": [{"word": "x", "start": start, "end": end, "conf": 1.0}]}
            [item] = session.wrap([final])
            deadline = 100
            while not item.done and deadline:
                import time
                time.sleep(0.05)
                deadline -= 1
            decoded = session.rule(item.decoded())
            labels.append(decoded["speaker"])
            assert decoded["words"][0]["speaker"] == decoded["speaker"]
            assert "_voices" not in decoded and "voices" not in decoded
        assert labels == ["S1", "S2", "S1", "S2"]
        partial = {"type": "partial", "text": "x", "utterance": 0, "start": 9.0, "end": 9.5}
        assert session.rule(partial)["speaker"] == "S2"  # no guess yet: the last speaker
        state = {**session.position, **session.state()}
        resumed = SessionSpeakers(Options(), embedder, state)
        assert resumed.window.position == len(pcm) // 2
        assert resumed.last_speaker == "S2"
    finally:
        embedder.stop()


@pytest.mark.parametrize("auth, fields", [
    ({}, {}),
    ({"diarize": False}, {}),
    ({"diarize": True}, {"diarize": "live", "min_speakers": "1", "max_speakers": "16"}),
    ({"diarize": "file", "speakers": 2},
     {"diarize": "file", "min_speakers": "2", "max_speakers": "2"}),
    ({"diarize": "live", "min_speakers": 2, "max_speakers": 3},
     {"diarize": "live", "min_speakers": "2", "max_speakers": "3"}),
])
def test_auth_options(auth, fields):
    assert speakers.parse_auth(auth) == (fields, None)


@pytest.mark.parametrize("auth", [
    {"diarize": "yes"}, {"diarize": 1}, {"diarize": True, "speakers": 0},
    {"diarize": True, "speakers": 17}, {"diarize": True, "max_speakers": "2"},
    {"diarize": True, "min_speakers": 3, "max_speakers": 2},
    {"diarize": True, "speakers": True},
])
def test_bad_auth_options_are_refused(auth):
    fields, problem = speakers.parse_auth(auth)
    assert fields == {} and problem


def test_loading_the_encoder_is_not_counted_as_busy(encoder):
    """Admission reads the embedder's busy fraction: a process that loads the encoder for
    its first labelled session must not look full for it (it did: a shared test service
    dropped to a capacity of 1 and refused the next tests' sessions)."""
    def slow_load() -> speakers.Encoder:
        time.sleep(0.6)  # the load: torch's import, the weights, the warm-up pass
        return encoder
    embedder = speakers.Embedder(slow_load)
    try:
        embedder.sample()
        job = embedder.submit(speakers.EmbedJob([(0.0, 2.0, audio("speakers/slt1"))]))
        for _ in range(200):
            if job.done:
                break
            time.sleep(0.01)
        assert job.done and not job.failed and len(job.voices) == 1
        assert embedder.sample() < 0.3
    finally:
        embedder.stop()
