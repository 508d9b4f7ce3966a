"""Languages through the running service (real gateway, a whisper-live worker pool, real
Redis): Mandarin pinned and detected, a session that changes language, Traditional
script, smart formatting, an unknown code refused, CJK subtitles from the command line
parsed back, and a worker killed under a Mandarin session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any

import pytest
import requests
import srt
import webvtt

from cosyvoice.client import Refused, StreamingClient, transcribe_pcm
from cosyvoice.store import bus as busmod
from cosyvoice.text import script

from .. import launcher
from ..helpers import TEST_ENV, cer, han, joined, kill_owners, write_pcm_wav, zh_texts
from ..launcher import wait_for

pytestmark = pytest.mark.system

ZH = zh_texts()
FAULT_ENV = {**TEST_ENV, "COSYVOICE_LEASE_TTL_MS": "1500", "COSYVOICE_LEASE_RENEW_MS": "300",
             "COSYVOICE_CLAIM_INTERVAL_MS": "300"}


@pytest.fixture(scope="module")
def lang_service(module_redis, artifacts):
    svc = launcher.start_service(module_redis.url, env={**FAULT_ENV,
                                                        "COSYVOICE_ENGINE": "whisper-live"},
                                 logs=artifacts, name="languages")
    yield svc
    svc.stop()


def _run(service, names: list[str], pace: str = "fast", **options):
    return transcribe_pcm(service.url, joined(names), 16000, pace=pace, **options)


def _session(result) -> dict:
    """The session event the client heard."""
    return [data for _, event, data in result.events if event == "session"][-1]


def _is_simplified(text: str) -> bool:
    """No Traditional character in it."""
    return script.convert(text, "hans") == text


def test_config_lists_the_languages_auto_first(lang_service):
    config = requests.get(lang_service.url + "/config", timeout=10).json()
    codes = [lang["code"] for lang in config["languages"]]
    assert codes[:3] == ["auto", "en", "zh"] and len(codes) == 100
    assert {"code": "zh", "name": "chinese"} in config["languages"]


def test_a_mandarin_session_reads_simplified_within_the_error_target(lang_service):
    names = sorted(ZH)
    got = _run(lang_service, names, language="zh")
    assert _session(got)["language"] == "zh" and not got.fatal_errors
    texts = [f["text"] for f in got.finals if f["text"]]
    # a sentence with a comma may be two utterances: the error rate is the session's
    assert len(texts) >= len(names), texts
    assert all(f["language"] == "zh" for f in got.finals)
    assert all(_is_simplified(t) for t in texts), texts
    assert cer(["".join(ZH[n] for n in names)], ["".join(texts)]) <= 0.08, texts
    # joined without spaces, as Chinese is written
    assert " " not in got.text


def test_auto_on_mandarin_detects_it_and_writes_simplified(lang_service):
    names = ["zh/zh02", "zh/zh05", "zh/zh08", "zh/zh10"]
    got = _run(lang_service, names, pace="realtime")
    assert _session(got)["language"] == "auto"
    finals = [f for f in got.finals if f["text"]]
    assert len(finals) >= 4 and all(f["language"] == "zh" for f in finals)
    assert all(f["language_prob"] >= 0.9 for f in finals)
    assert all(_is_simplified(f["text"]) for f in finals)
    assert cer(["".join(ZH[n] for n in names)], ["".join(f["text"] for f in finals)]) <= 0.10
    assert any(p.get("language") == "zh" and han(p["text"]) for p in got.partials)


def test_auto_on_english_gives_what_an_english_session_gives(lang_service):
    names = ["weather", "coffee", "door"]
    auto = _run(lang_service, names)
    english = _run(lang_service, names, language="en")
    assert [f["language"] for f in auto.finals] == ["en"] * 3
    assert [f["text"] for f in auto.finals] == [f["text"] for f in english.finals]


def test_a_session_that_changes_language_is_followed(lang_service):
    got = _run(lang_service, ["weather", "zh/zh01", "coffee", "zh/zh06"], pace="realtime")
    finals = [f for f in got.finals if f["text"]]
    assert [f["language"] for f in finals] == ["en", "zh", "en", "zh"]
    assert "coffee" in finals[2]["text"].lower()
    assert _is_simplified(finals[1]["text"]) and _is_simplified(finals[3]["text"])
    assert " " in got.text  # English and Mandarin are joined by a space, Mandarin alone not


def test_a_prompt_reaches_the_sessions_worker(lang_service):
    """``auth.prompt`` is stored with the session and its worker's stream starts from it:
    once a final is out, the session's checkpoint holds the prompt followed by that final."""
    prompt = "以下是普通话的句子。"
    stream = StreamingClient(lang_service.url, language="zh", prompt=prompt)
    client = busmod.connect(lang_service.redis_url)
    try:
        stream.connect()
        pcm = joined(["zh/zh03"])
        for seq, start in enumerate(range(0, len(pcm), 6400)):
            stream.send(pcm[start:start + 6400], seq, wait_ack=True)  # no last chunk
        wait_for(lambda: [f for f in stream.result.finals if f["text"]], timeout=60)
        info = busmod.Bus(client).session_info(stream.result.session)
    finally:
        stream.stop()
        stream.close()
        client.close()
    assert info["prompt"] == prompt
    final = next(f["text"] for f in stream.result.finals if f["text"])
    # the checkpoint follows the final it is published with: the engine's text, before
    # the script stage
    assert json.loads(info["checkpoint"])["prompt"].startswith(prompt + " ")
    assert cer([ZH["zh/zh03"]], [final]) <= 0.2


def test_a_traditional_session_reads_traditional(lang_service):
    got = _run(lang_service, ["zh/zh03", "zh/zh09"], language="zh", script="hant")
    texts = [f["text"] for f in got.finals if f["text"]]
    assert len(texts) == 2
    assert all(script.convert(t, "hant") == t for t in texts), texts  # no Simplified left
    assert any(script.convert(t, "hans") != t for t in texts), texts  # and some Traditional


def test_formatting_writes_times_as_digits(lang_service):
    """Whisper writes most numbers as digits itself ("$25", "March 3, 1990", Mandarin
    amounts); the formatting stage writes the rest: "half past seven" is 07:30."""
    plain = _run(lang_service, ["half_past"])
    digits = _run(lang_service, ["half_past"], format=True)
    assert "half past seven" in plain.text.lower(), plain.text
    assert "07:30" in digits.text, digits.text
    assert _session(digits)["format"] is True and _session(plain)["format"] is False
    mandarin = _run(lang_service, ["zh/zh11"], language="zh", format=True)
    assert "350" in mandarin.text, mandarin.text


@pytest.mark.parametrize("auth", [{"language": "klingon"}, {"script": "cyrillic"}])
def test_an_unknown_language_or_script_is_refused(lang_service, auth):
    client = StreamingClient(lang_service.url, reconnect=False, **auth)
    with pytest.raises(Refused) as refused:
        client.connect()
    client.close()
    assert refused.value.code == "unsupported_language"


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_cjk_subtitles_from_the_command_line_parse_back(lang_service, tmp_path, fmt):
    wav = tmp_path / "zh.wav"
    write_pcm_wav(wav, joined(["zh/zh02", "zh/zh10"]))
    out = tmp_path / f"zh.{fmt}"
    proc = subprocess.run([sys.executable, "-m", "cosyvoice", "transcribe", str(wav),
                           "--url", lang_service.url, "--pace", "fast", "--language", "zh",
                           "--output", str(out)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr
    if fmt == "srt":
        cues = [(c.start.total_seconds(), c.end.total_seconds(), c.content)
                for c in srt.parse(out.read_text())]
    else:
        assert out.read_text().startswith("WEBVTT\nLanguage: zh\n")
        cues = [(c.start_in_seconds, c.end_in_seconds, c.text)
                for c in webvtt.read(str(out)).captions]
    assert len(cues) >= 2
    lines = [line for _, _, text in cues for line in text.splitlines()]
    assert all(0 < len(line) <= 16 for line in lines), lines
    assert all(" " not in line for line in lines)
    assert cer([ZH["zh/zh02"] + ZH["zh/zh10"]], ["".join(lines)]) <= 0.1
    starts = [start for start, _, _ in cues]
    assert starts == sorted(starts) and all(s < e for s, e, _ in cues)


def test_a_worker_killed_under_a_mandarin_session_changes_nothing(lang_service):
    """The next owner rebuilds the session from its checkpoint (language, prompt and all)
    and the client reads what it would have read without the kill."""
    names = ["zh/zh04", "zh/zh07", "zh/zh09"]
    reference = _run(lang_service, names, pace="realtime")
    rds: Any = busmod.connect(lang_service.redis_url, blocking=False)
    killed: list[int] = []
    timer = threading.Timer(4.5, kill_owners, (rds, killed))  # in the second sentence
    timer.start()
    try:
        got = _run(lang_service, names, pace="realtime")
    finally:
        timer.cancel()
    assert killed, "a worker process was killed mid-session"

    def strip(result):
        return [(f["utterance"], f["text"], f["language"], f["start"], f["end"])
                for f in result.finals]
    assert strip(got) == strip(reference)
    wait_for(lambda: len(busmod.Bus(rds).live_workers()) >= 2, timeout=30)
    rds.close()
