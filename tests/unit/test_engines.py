"""Every engine through one contract, and what the ``whisper-live`` engine promises beyond it.

The contract (``test_contract_*``) runs each engine that decodes inside the worker's loop
(the 2-pass engines defer their finals to the finals stage: tests/system/test_whisper.py) through
the same checks on real speech: the shape of results, ``flush``, a stream rebuilt from each
checkpoint, 8/16/48 kHz sessions, and audio no microphone should send.
"""

from __future__ import annotations

import wave
from typing import Any

import numpy as np
import pytest
import soxr

from cosyvoice.asr import ENGINES, live_engine, live_stream, load_model, tiny_whisper
from cosyvoice.settings import Settings

from ..helpers import (
    FIXTURES,
    corpus_wer,
    finals,
    fixture_texts,
    harvard_texts,
    read_pcm,
    reference_text,
    run_stream,
    wer,
)

pytestmark = pytest.mark.unit

CONTRACT_ENGINES = sorted(name for name, spec in ENGINES.items() if spec.stage != "finals")
HARVARD = harvard_texts()


def fixture(name: str) -> bytes:
    with wave.open(str(FIXTURES / f"{name}.wav"), "rb") as w:
        return w.readframes(w.getnframes())


_MODELS: dict[str, object] = {}


@pytest.fixture(scope="module", params=CONTRACT_ENGINES)
def engine(request):
    if request.param not in _MODELS:
        _MODELS[request.param] = load_model(request.param, Settings())
    return request.param, _MODELS[request.param]


@pytest.fixture(scope="module")
def live():
    return load_model("whisper-live", Settings())




def text_of(results) -> str:
    return " ".join(f["text"] for f in finals(results))


def resampled(pcm16: bytes, rate: int) -> bytes:
    x = np.frombuffer(pcm16, dtype="<i2").astype(np.float32) / 32768
    return (np.clip(soxr.resample(x, 16000, rate), -1, 1) * 32767).astype("<i2").tobytes()


# ---- the contract ---------------------------------------------------------------------


def test_contract_results_have_one_shape(engine):
    name, model = engine
    results, _ = run_stream(model, fixture("two_utterances"))
    assert results and finals(results)
    for r in results:
        assert r["type"] in ("partial", "final")
        assert isinstance(r["text"], str) and isinstance(r["utterance"], int)
        assert 0 <= r["start"] <= r["end"]
    for f in finals(results):
        assert isinstance(f["words"], list)
        for w in f["words"]:
            assert set(w) >= {"word", "start", "end", "conf"}
            assert f["start"] <= w["start"] <= w["end"] <= f["end"] + 0.01
            assert 0.0 <= w["conf"] <= 1.0
    if name != "null":
        assert [f["utterance"] for f in finals(results)] == [0, 1]
        assert finals(results)[0]["end"] <= finals(results)[1]["start"]
        assert wer(reference_text("two_utterances"), text_of(results)) <= 0.35


def test_contract_flush_ends_the_open_utterance(engine):
    name, model = engine
    pcm = read_pcm("coffee")
    cut = len(pcm) * 3 // 4 // 6400 * 6400  # mid-speech: no endpoint before the flush
    results, _ = run_stream(model, pcm[:cut])
    assert finals(results), "flush gives the final of speech in progress"
    if name != "null":
        assert finals(results)[-1]["text"]


def test_contract_a_rebuilt_stream_continues_exactly_from_each_checkpoint(engine):
    name, model = engine
    pcm = fixture("two_utterances")
    results, checkpoints = run_stream(model, pcm)
    if name == "null":
        return  # no finals before the flush, so no checkpoint to rebuild from
    assert checkpoints
    for position, cp in checkpoints.items():
        resumed, _ = run_stream(model, pcm, checkpoint=cp, start=position)
        assert finals(resumed) == finals(results)[cp["utterance"]:]


@pytest.mark.parametrize("rate", [8000, 48000])
def test_contract_every_supported_rate_is_recognised(engine, rate):
    name, model = engine
    ref = fixture_texts()["door"]
    base = text_of(run_stream(model, read_pcm("door"))[0])
    results, _ = run_stream(model, resampled(read_pcm("door"), rate), rate=rate)
    assert finals(results)
    if name != "null":
        # band-limited 8 kHz audio costs a recogniser some words; nothing else should
        slack = 0.35 if rate == 8000 else 0.1
        assert wer(ref, text_of(results)) <= wer(ref, base) + slack, text_of(results)


def test_contract_audio_no_microphone_sends_crashes_nothing(engine):
    _name, model = engine
    rng = np.random.default_rng(7)
    square = np.where(np.arange(16000) % 40 < 20, 32767, -32768).astype("<i2").tobytes()
    stream = model.stream(16000)
    results = stream.feed(b"")
    for bad in (square, rng.integers(-32768, 32767, 16000, dtype="<i2").tobytes(),
                np.full(16000, 32767, dtype="<i2").tobytes(), b"", read_pcm("weather")):
        for i in range(0, len(bad), 6400):
            results += stream.feed(bad[i:i + 6400])
    results += stream.flush()
    stream.close()
    assert all(r["type"] in ("partial", "final") for r in results)


@pytest.mark.parametrize("name", ["silence", "noise", "tone"])
def test_contract_no_speech_ends_cleanly(engine, name):
    """PocketSphinx's decoder has no path through some noise (its seg() is None): that
    ended the session with an internal error before."""
    _name, model = engine
    results, _ = run_stream(model, fixture(name))
    assert all(r["type"] in ("partial", "final") for r in results)


# ---- whisper-live ---------------------------------------------------------------------


@pytest.mark.fast
def test_agreed_prefix_ignores_case_and_punctuation():
    assert live_stream.agreed_prefix(["The", "weather", "is"], ["the", "weather,", "was"]) == 2
    assert live_stream.agreed_prefix([], ["a"]) == 0
    assert live_stream.agreed_prefix(["a", "b"], ["a", "b", "c"]) == 2


@pytest.mark.fast
def test_model_files_are_verified_and_a_changed_one_is_refused(monkeypatch):
    assert (tiny_whisper.model_dir() / "model.bin").is_file()
    monkeypatch.setitem(tiny_whisper.MODEL_FILES, "config.json", "0" * 64)
    with pytest.raises(tiny_whisper.ModelDataError, match="config.json.*refusing"):
        tiny_whisper.model_dir()


@pytest.mark.parametrize("name", ["silence", "noise", "tone"])
def test_no_speech_gives_no_text(live, name):
    results, _ = run_stream(live, fixture(name))
    assert results == []


def test_whisper_live_halves_pocketsphinx_word_errors(live):
    """Every single-sentence fixture: corpus WER (Whisper's normaliser on both sides) at
    most half PocketSphinx's over them all and on the Harvard sentences. The first group
    was written for PocketSphinx, which decodes all of it (0 %): there one word split in two
    (two edits) more than PocketSphinx's errors is allowed (tiny.en writes "sea shore")."""
    ps = load_model("pocketsphinx", Settings())
    totals: dict[str, list[str]] = {"refs": [], "live": [], "ps": []}
    for group in (fixture_texts(), HARVARD):
        names = sorted(group)
        refs = [group[n] for n in names]
        live_text = [text_of(run_stream(live, read_pcm(n))[0]) for n in names]
        ps_text = [text_of(run_stream(ps, read_pcm(n))[0]) for n in names]
        live_wer, ps_wer = corpus_wer(refs, live_text), corpus_wer(refs, ps_text)
        split_word = 2 / sum(len(r.split()) for r in refs)
        assert live_wer <= max(ps_wer / 2, ps_wer + split_word), (live_wer, ps_wer, live_text)
        for key, texts in (("refs", refs), ("live", live_text), ("ps", ps_text)):
            totals[key] += texts
    live_wer = corpus_wer(totals["refs"], totals["live"])
    ps_wer = corpus_wer(totals["refs"], totals["ps"])
    print(f"corpus WER: whisper-live {live_wer:.3f}, pocketsphinx {ps_wer:.3f}")
    assert live_wer <= ps_wer / 2, (live_wer, ps_wer, totals["live"])


def test_finals_carry_word_times_confidences_and_the_engine(live):
    results, _ = run_stream(live, fixture("two_utterances") + read_pcm("meeting"))
    assert "o'clock." in finals(results)[-1]["text"]  # one word, though two pieces
    for f in finals(results):
        assert f["engine"] == "whisper-live"
        assert [w["word"] for w in f["words"]] == f["text"].split()
        starts = [w["start"] for w in f["words"]]
        assert starts == sorted(starts)


def test_long_speech_without_a_pause_is_cut_below_the_window(live):
    pcm = fixture("long_unbroken")
    assert len(pcm) / 32000 > live_stream.MAX_CLIP_S - 5
    results, _ = run_stream(live, pcm)
    assert len(finals(results)) >= 2
    assert all(f["end"] - f["start"] <= 20.0 + 0.3 for f in finals(results))
    assert wer(reference_text("long_unbroken"), text_of(results)) <= 0.15, text_of(results)


def test_a_long_utterance_ends_at_a_pause_after_the_pause_cut(live):
    model = load_model("whisper-live", Settings(live_pause_cut_s=4.0))
    results, _ = run_stream(model, fixture("harvard_long"))
    ref = reference_text("harvard_long")
    assert all(f["end"] - f["start"] <= 4.0 + 1.5 for f in finals(results))
    assert wer(ref, text_of(results)) <= 0.2, text_of(results)


def test_previous_finals_are_the_prompt_and_travel_in_the_checkpoint(live):
    stream = live.stream(16000)
    pcm = fixture("two_utterances")
    for i in range(0, len(pcm), 6400):
        stream.feed(pcm[i:i + 6400])
    stream.flush()
    assert "weather" in stream.checkpoint["prompt"] and "morning" in stream.checkpoint["prompt"]


class Clock:
    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def _partials(step: float) -> tuple[list[dict], int]:
    model = live_engine.LiveModel(Settings())
    model.clock = Clock(step)
    results, _ = run_stream(model, read_pcm("shells") + read_pcm("birch"))
    return [r for r in results if r["type"] == "partial"], len(finals(results))


def test_partials_are_paced_by_audio_and_clock_and_stable_words_lead():
    # one clock reading per 200 ms chunk: a real-time session
    realtime, utterances = _partials(0.2)
    assert len(realtime) > utterances
    for p in realtime:
        assert p["text"].split()[:len(p["stable"].split())] == p["stable"].split()
    assert any(p["stable"] for p in realtime)
    # A session decoded faster than the clock (catching up) skips re-decodes: one per
    # utterance at most.
    behind, _ = _partials(0.0)
    assert 0 < len(behind) <= utterances


def test_a_stream_follows_the_interval_its_runner_sets_and_says_so_with_load_events():
    """A scheduler under load sets a longer partial interval: the stream asks for partials
    that far apart (in audio and on the clock) and tells the session once with a ``load``
    event; back at the base, it says so again."""
    model = live_engine.LiveModel(Settings())
    model.clock = Clock(0.2)  # real time: one reading a chunk
    pcm = fixture("harvard_long")
    model.runner.partial_interval = 2.5
    stream = model.stream(16000)
    out: list[Any] = []
    for i in range(0, len(pcm) // 2, 6400):
        out += stream.feed(pcm[i:i + 6400])
    model.runner.partial_interval = None  # the load is gone
    for i in range(len(pcm) // 2, len(pcm), 6400):
        out += stream.feed(pcm[i:i + 6400])
    out += stream.flush()
    loads = [r for r in out if r["type"] == "load"]
    assert loads == [{"type": "load", "busy": True, "partial_interval_ms": 2500},
                     {"type": "load", "busy": False, "partial_interval_ms": 1000}]
    back = out.index(loads[1])
    spaced = [r for r in out[:back] if r["type"] == "partial"]
    assert len(spaced) >= 2
    # partials of one utterance are 2.5 s of audio apart
    for a, b in zip(spaced, spaced[1:], strict=False):
        if a["utterance"] == b["utterance"]:
            assert b["end"] - a["end"] >= 2.5 - 1e-6
    assert len([r for r in out[back:] if r["type"] == "partial"]) > len(spaced)


# ---- capacity -------------------------------------------------------------------------


@pytest.mark.fast
def test_a_slower_host_admits_fewer_sessions():
    from cosyvoice.asr.calibrate import Calibration
    assert Calibration("whisper-live", 0.1, 0.1, 4).capacity == 4
    assert Calibration("whisper-live", 0.2, 0.1, 4).capacity == 2
    assert Calibration("whisper-live", 0.05, 0.1, 4).capacity == 8
    assert Calibration("whisper-live", 5.0, 0.1, 4).capacity == 1  # never none
