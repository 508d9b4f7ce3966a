"""Speaker labels' rules (cosyvoice/speakers.py) on the real speaker encoder and the speaker
fixtures (three festival voices): pieces cut at pauses, online clustering and its
checkpoint, the relabel of the final before, whole-file clustering, the auth options."""

from __future__ import annotations

import numpy as np
import pytest

from cosyvoice import speakers
from cosyvoice.speakers import Clusters, Options, SessionSpeakers

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


@pytest.mark.parametrize("voices", [["slt", "kal"], ["kal", "ked"], ["slt", "kal", "ked"]])
def test_online_clustering_labels_each_voice_apart(vectors, voices):
    clusters = Clusters()
    got = []
    for i, (_, name) in enumerate(interleaved(vectors, voices, 8 * len(voices) - 2)):
        _, vector, seconds = vectors[name]
        who, _ = clusters.place(i, [(0.0, seconds, vector)], Options())
        got.append(who[0])
    want = [i % len(voices) for i in range(len(got))]
    assert got == want  # S1 is the first to speak, S2 the second, ...


def test_max_speakers_caps_and_min_speakers_splits(vectors):
    turns = interleaved(vectors, ["slt", "kal", "ked"], 9)
    capped, split = Clusters(), Clusters()
    for i, (_, name) in enumerate(turns):
        _, vector, seconds = vectors[name]
        capped.place(i, [(0.0, seconds, vector)], Options(max_speakers=2))
        split.place(i, [(0.0, seconds, vector)], Options(min_speakers=3))
    assert len(capped.known()) == 2
    assert len(split.known()) == 3


def test_the_clusters_round_trip_through_a_checkpoint(vectors):
    turns = interleaved(vectors, ["kal", "ked"], 12)
    whole = Clusters()
    labels = [whole.place(i, [(0.0, vectors[n][2], vectors[n][1])], Options())[0]
              for i, (_, n) in enumerate(turns)]
    first = Clusters()
    for i, (_, n) in enumerate(turns[:5]):
        first.place(i, [(0.0, vectors[n][2], vectors[n][1])], Options())
    resumed = Clusters.from_state(first.to_state())
    again = [resumed.place(i + 5, [(0.0, vectors[n][2], vectors[n][1])], Options())[0]
             for i, (_, n) in enumerate(turns[5:])]
    assert again == labels[5:]


def test_a_later_final_relabels_the_one_before():
    """A voice first heard a little apart starts a speaker of its own; once the next final
    pulls the first speaker's mean towards it, it is moved there, and said so."""
    def at(degrees: float) -> np.ndarray:
        v = np.zeros(256, dtype=np.float32)
        v[0], v[1] = np.cos(np.radians(degrees)), np.sin(np.radians(degrees))
        return v
    clusters = Clusters()
    assert clusters.place(0, [(0, 3, at(0))], Options()) == ([0], None)
    assert clusters.place(1, [(4, 7, at(41.4))], Options()) == ([1], None)  # cos 0.75
    assert clusters.place(2, [(8, 11, at(20))], Options()) == ([0], (1, 0))
    assert clusters.known() == [0]
    # the emptied label is the next new speaker's
    assert clusters.place(3, [(12, 15, at(90))], Options()) == ([1], None)


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
