"""Speaker labels through the running service (real gateway, whisper-live worker processes,
real Redis) on conversations of the festival voices: live labels on finals, words and
partials, the whole-file labels a client computes at the end, a session without labels,
and a worker killed mid-conversation."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import threading
from typing import Any

import openai
import pytest
import srt
import webvtt

from cosyvoice.client import Refused, StreamingClient, transcribe_pcm
from cosyvoice.store import bus as busmod
from cosyvoice.text import speakers, subtitles

from .. import launcher
from ..helpers import TEST_ENV, attributed, conversation, kill_owners, wer, write_pcm_wav
from ..launcher import wait_for

pytestmark = pytest.mark.system

FAULT_ENV = {**TEST_ENV, "COSYVOICE_LEASE_TTL_MS": "1500", "COSYVOICE_LEASE_RENEW_MS": "300",
             "COSYVOICE_CLAIM_INTERVAL_MS": "300", "COSYVOICE_ENGINE": "whisper-live"}
TWO = ["speakers/slt1", "speakers/kal1", "speakers/slt2", "speakers/kal2", "speakers/slt3",
       "speakers/kal3"]
THREE = ["speakers/slt4", "speakers/kal4", "speakers/ked1", "speakers/slt5", "speakers/ked2",
         "speakers/kal5", "speakers/ked3", "speakers/slt6"]


@pytest.fixture(scope="module")
def speaker_service(module_redis, artifacts):
    svc = launcher.start_service(module_redis.url, env=FAULT_ENV, logs=artifacts,
                                 name="speakers")
    yield svc
    svc.stop()


def test_two_voices_live_and_a_session_without_labels(speaker_service):
    pcm, truth = conversation(TWO[:4], gaps=[1.0, 0.6, 1.2])
    got: dict[str, Any] = {}

    def run(name: str, **options):
        got[name] = transcribe_pcm(speaker_service.url, pcm, 16000, pace="realtime",
                                   language="en", **options)
    plain = threading.Thread(target=run, args=("plain",))
    plain.start()
    run("labelled", diarize=True)
    plain.join(120)
    labelled, unlabelled = got["labelled"], got["plain"]
    assert not labelled.fatal_errors and not unlabelled.fatal_errors
    finals = labelled.finals
    assert [f["speaker"] for f in finals] == ["S1", "S2", "S1", "S2"]
    assert attributed(finals, truth) >= 0.9
    assert all(w["speaker"] == f["speaker"] for f in finals for w in f["words"])
    assert labelled.partials and all(p["speaker"] in ("S1", "S2") for p in labelled.partials)
    assert all("voices" not in f for f in finals)
    # the same words either way, and no speaker anywhere in a session that did not ask
    assert wer(unlabelled.text, labelled.text) <= 0.05
    for event in unlabelled.finals + unlabelled.partials:
        assert "speaker" not in event and "voices" not in event
        assert all("speaker" not in w for w in event.get("words", []))


def test_three_voices_live_and_as_a_whole_file(speaker_service):
    pcm, truth = conversation(THREE, gaps=[0.8, 1.0, 0.5, 1.5, 0.7, 1.0, 0.6])
    # labels do not depend on the pace (the same finals either way): as fast as acked
    result = transcribe_pcm(speaker_service.url, pcm, 16000, pace="fast", language="en",
                            diarize="file")
    assert not result.fatal_errors
    finals = result.finals
    assert len({f["speaker"] for f in finals}) == 3
    assert attributed(finals, truth) >= 0.9
    assert all(len(f["voices"]) >= 1 for f in finals)
    whole = speakers.recluster(finals)
    assert [f["speaker"] for f in whole] == ["S1", "S2", "S3", "S1", "S3", "S2", "S3", "S1"]
    assert attributed(whole, truth) >= 0.95


def test_a_known_number_of_speakers_caps_the_labels(speaker_service):
    pcm, _ = conversation(THREE[:5], gaps=[0.8] * 4)
    result = transcribe_pcm(speaker_service.url, pcm, 16000, pace="fast", language="en",
                            diarize=True, max_speakers=2)
    assert {f["speaker"] for f in result.finals} <= {"S1", "S2"}


def test_bad_speaker_options_are_refused(speaker_service):
    client = StreamingClient(speaker_service.url, diarize="yes")
    with pytest.raises(Refused) as refused:
        client.connect(timeout=10)
    client.close()
    assert refused.value.code == "unauthorized" and "diarize" in str(refused.value)


def test_a_worker_killed_mid_conversation_gives_the_same_labels(speaker_service):
    """The next owner starts from the checkpoint, the speakers it met and all. (The
    labels do not depend on the pace: the reference goes as fast as acked.)"""
    pcm, truth = conversation(TWO[:4], gaps=[1.0] * 3)
    reference = transcribe_pcm(speaker_service.url, pcm, 16000, pace="fast",
                               language="en", diarize=True)
    rds: Any = busmod.connect(speaker_service.redis_url, blocking=False)
    killed: list[int] = []
    # in the third turn
    timer = threading.Timer(truth[2][1] + 0.5, kill_owners, (rds, killed))
    timer.start()
    try:
        got = transcribe_pcm(speaker_service.url, pcm, 16000, pace="realtime", language="en",
                             diarize=True)
    finally:
        timer.cancel()
    assert killed, "a worker process was killed mid-session"

    def strip(result):
        return [(f["utterance"], f["text"], f["speaker"],
                 [w["speaker"] for w in f["words"]]) for f in result.finals]
    assert strip(got) == strip(reference)
    assert [f["speaker"] for f in got.finals] == ["S1", "S2"] * 2
    wait_for(lambda: len(busmod.Bus(rds).live_workers()) >= 2, timeout=30)
    rds.close()


def cli(service, wav, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "cosyvoice", "transcribe", str(wav), "--url",
                          service.url, "--pace", "fast", "--language", "en", "--diarize",
                          *args], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_the_command_line_writes_speakers_into_every_format(speaker_service, tmp_path):
    pcm, truth = conversation(THREE[:6], gaps=[0.8, 1.0, 0.6, 1.2, 0.9])
    wav = tmp_path / "three.wav"
    write_pcm_wav(wav, pcm)
    voices = [t[0] for t in truth]
    want = [f"S{sorted(set(voices), key=voices.index).index(v) + 1}" for v in voices]
    subs = list(srt.parse(cli(speaker_service, wav, "--output-format", "srt")))
    cue_speakers = [re.sub(r"^\[(S\d)\] .*", r"\1", c.content, flags=re.S) for c in subs]
    assert list(dict.fromkeys(cue_speakers)) == ["S1", "S2", "S3"]
    captions = webvtt.from_buffer(io.StringIO(cli(speaker_service, wav, "--output-format",
                                                  "vtt")))
    assert [c.voice for c in captions.captions] == cue_speakers
    whole = json.loads(cli(speaker_service, wav, "--output-format", "json"))
    assert whole["speakers"] == ["S1", "S2", "S3"]
    assert [f["speaker"] for f in whole["finals"]] == want
    assert all("voices" not in f for f in whole["finals"])
    assert attributed(whole["finals"], truth) >= 0.95
    # the text format of the same finals (what --output-format text renders): a paragraph
    # a turn, its speaker first
    paragraphs = [p for p in subtitles.to_text(whole["finals"]).split("\n\n") if p.strip()]
    assert [p.split(":", 1)[0] for p in paragraphs] == want


def test_the_openai_file_api_gives_diarized_json(speaker_service, tmp_path):
    pcm, truth = conversation(TWO[:4], gaps=[0.8, 1.0, 0.7])
    write_pcm_wav(tmp_path / "two.wav", pcm)
    upload = (tmp_path / "two.wav").read_bytes()
    with openai.OpenAI(base_url=speaker_service.url + "/v1", api_key="unused",
                       timeout=120) as c:
        r = c.audio.transcriptions.create(model="gpt-4o-transcribe-diarize",
                                          file=("two.wav", upload, "audio/wav"),
                                          response_format="diarized_json",
                                          language="en")
        events = list(c.audio.transcriptions.create(
            model="whisper-1", file=("two.wav", upload, "audio/wav"),
            response_format="diarized_json", language="en", stream=True))
    assert isinstance(r, openai.types.audio.TranscriptionDiarized)
    assert [s.speaker for s in r.segments] == ["A", "B", "A", "B"]
    assert " ".join(seg.text for seg in r.segments) == r.text  # the words, cut by speaker
    for seg, (_, start, end, _) in zip(r.segments, truth, strict=True):
        assert start - 0.5 <= seg.start < seg.end <= end + 0.5
    streamed = [e.speaker for e in events if e.type == "transcript.text.segment"]
    assert streamed == ["A", "B", "A", "B"]
    assert events[-1].type == "transcript.text.done"
