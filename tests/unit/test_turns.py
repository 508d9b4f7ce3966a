"""Turn control per session on the engines themselves (real models, real audio): the
endpointing silence a session asks for, a finalize that ends the utterance in progress and
lets the stream go on, speech_started items, all carried in the checkpoint."""

from __future__ import annotations

from typing import Any

import pytest

from cosyvoice.asr import Turn, load_model
from cosyvoice.settings import Settings
from cosyvoice.wire.messages import kind

from ..helpers import finals, joined, read_pcm, run_stream, wer

pytestmark = pytest.mark.unit

CHUNK = 6400  # 200 ms at 16 kHz


@pytest.fixture(scope="module", params=["whisper-live", "pocketsphinx"])
def model(request):
    return load_model(request.param, Settings(engine=request.param))


@pytest.fixture(scope="module")
def live():
    return load_model("whisper-live", Settings())


def feed(stream, pcm: bytes) -> list[Any]:
    out: list[Any] = []
    for i in range(0, len(pcm), CHUNK):
        out += stream.feed(pcm[i:i + CHUNK])
    return out


def texts(results) -> list[str]:
    return [r["text"] for r in finals(results) if r["text"]]


def test_a_short_endpointing_silence_splits_where_a_long_one_does_not(live):
    pcm = joined(["weather", "call"], gap_s=0.8)
    short = live.stream(16000, language="en", turn=Turn(endpoint_ms=200))
    long = live.stream(16000, language="en", turn=Turn(endpoint_ms=1500))
    got_short = texts(feed(short, pcm) + short.flush())
    got_long = texts(feed(long, pcm) + long.flush())
    short.close()
    long.close()
    assert len(got_short) == 2 and len(got_long) == 1
    both = "the weather is nice today please call me back in the morning"
    assert wer(both, " ".join(got_short)) <= 0.1 and wer(both, got_long[0]) <= 0.1


def test_the_turn_is_carried_in_the_checkpoint(live):
    """A stream rebuilt from the checkpoint of a long-silence session, after its first
    final, keeps the long silence: the two sentences 0.8 s apart that follow are one final,
    as in the session it continues."""
    gap = b"\0\0" * 32000  # 2 s: an end even for a 1.5 s endpointing silence
    pcm = read_pcm("door") + gap + joined(["weather", "call"], gap_s=0.8)
    turn = Turn(endpoint_ms=1500, speech_events=True)
    results, checkpoints = run_stream(live, pcm, language="en", turn=turn)
    assert len(texts(results)) == 2
    position = min(checkpoints)
    cp = checkpoints[position]
    assert (cp["endpoint_ms"], cp["speech_events"]) == (1500, True)
    resumed, _ = run_stream(live, pcm, checkpoint=cp, start=position)
    assert texts(resumed) == texts(results)[1:]
    assert [r for r in resumed if kind(r) == "speech_started"]


def test_finalize_ends_the_utterance_and_the_stream_goes_on(model):
    """Half a sentence, finalize, the rest and another sentence: a final for the half at
    once, then the stream decodes on as it would."""
    sentence = read_pcm("weather")
    half = len(sentence) // 2 // CHUNK * CHUNK
    stream = model.stream(16000)
    early = feed(stream, sentence[:half])
    flushed = stream.finalize()
    rest = feed(stream, sentence[half:] + b"\0\0" * 16000 + read_pcm("call"))
    rest += stream.flush()
    stream.close()
    assert not finals(early)
    assert len(texts(flushed)) == 1  # the half said so far, as a final now
    assert finals(flushed)[0]["end"] <= half / 32000 + 0.05
    later = texts(rest)
    assert later and wer("please call me back in the morning", later[-1]) <= 0.15
    # nothing heard twice: each final starts after the one before ends
    spans = [(f["start"], f["end"]) for f in finals(flushed + rest) if f["text"]]
    assert all(b[0] >= a[1] - 0.3 for a, b in zip(spans, spans[1:], strict=False))


def test_finalize_between_utterances_gives_nothing(model):
    stream = model.stream(16000)
    assert feed(stream, read_pcm("silence")[:4 * CHUNK]) == []
    assert stream.finalize() == []
    got = texts(feed(stream, read_pcm("weather")) + stream.flush())
    stream.close()
    assert wer("the weather is nice today", " ".join(got)) <= 0.1


def test_speech_started_comes_before_each_utterance_it_opens(live):
    pcm = joined(["weather", "call"])
    stream = live.stream(16000, language="en", turn=Turn(speech_events=True))
    results = feed(stream, pcm) + stream.flush()
    stream.close()
    started = [r for r in results if kind(r) == "speech_started"]
    done = [r for r in finals(results) if r["text"]]
    assert len(started) == 2 and len(done) == 2
    for s, f in zip(started, done, strict=True):
        assert f["start"] <= s["start"] <= f["start"] + 0.6  # the final keeps its pre-roll
        assert results.index(s) < results.index(f)
    quiet, _ = run_stream(live, pcm, language="en")  # not asked for: none
    assert not [r for r in quiet if kind(r) == "speech_started"]
