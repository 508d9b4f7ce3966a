"""Opus on the wire through the running service: every fixture at every rung with the
default engine and with PocketSphinx, the command line's ``--codec opus``, what a second
of audio costs on the wire, and a corrupt packet in the middle of a session."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import socketio

from cosyvoice.client import Refused, transcribe_pcm
from cosyvoice.settings import Settings
from cosyvoice.wire import codecs
from cosyvoice.wire.protocol import NAMESPACE, encode_opus_chunk

from .. import launcher
from ..helpers import (
    ENGINE,
    FIXTURES,
    TEST_ENV,
    corpus_wer,
    fixture_texts,
    harvard_texts,
    read_pcm,
)
from ..launcher import wait_for
from ..stack import scrape

pytestmark = pytest.mark.system

TEXTS = {**fixture_texts(), **harvard_texts()}
RUNGS = Settings().opus_bitrate_list
# Corpus WER (on the single-sentence and Harvard fixtures, 88 words) a rung may add to
# PCM's through the same service: what it added when measured, about a word more, and no
# tighter at a lower bitrate than at a higher one. Encoding and decoding are deterministic,
# so a rerun moves nothing unless the engine does. Measured: whisper-live +2.3 points at
# every rung (it writes "sea shore" for "seashore"); PocketSphinx 0, +3.4, +5.7, 0.
WER_BOUND = {
    "whisper-live": {32000: 0.035, 24000: 0.035, 16000: 0.035, 12000: 0.035},
    "pocketsphinx": {32000: 0.015, 24000: 0.045, 16000: 0.07, 12000: 0.07},
}


@pytest.fixture(scope="module", params=[ENGINE, "pocketsphinx"])
def opus_service(request, service, module_redis, artifacts):
    """(engine, service): the test service (the default engine), then PocketSphinx on a
    Redis of its own."""
    if request.param == ENGINE:
        yield ENGINE, service
        return
    svc = launcher.start_service(module_redis.url, logs=artifacts, name="opus-pocketsphinx",
                                 env={**TEST_ENV, "COSYVOICE_ENGINE": request.param})
    yield request.param, svc
    svc.stop()


@pytest.fixture(scope="module")
def runs(opus_service):
    """Every fixture as PCM and as Opus at every rung, six sessions at a time:
    {(bitrate, name): transcript}, bitrate 0 for PCM."""
    engine, svc = opus_service
    jobs = [(rung, name) for rung in (0, *RUNGS) for name in sorted(TEXTS)]

    def run(job):
        rung, name = job
        codec = codecs.OPUS if rung else codecs.PCM16
        # The shared service's admission follows what its decoding costs, and sessions
        # sent faster than real time cost more than live ones: by this module it may
        # admit fewer than six at once. A refused job waits its turn, as a client would.
        deadline = time.monotonic() + 120
        while True:
            try:
                return job, transcribe_pcm(svc.url, read_pcm(name), 16000, pace="fast",
                                           codec=codec, bitrate=rung)
            except Refused as exc:
                if exc.code != "overloaded" or time.monotonic() > deadline:
                    raise

    with ThreadPoolExecutor(6) as pool:
        return engine, svc, dict(pool.map(run, jobs))


def _wer(runs: dict, rung: int) -> float:
    names = sorted(TEXTS)
    return corpus_wer([TEXTS[n] for n in names], [runs[(rung, n)].text for n in names])


@pytest.mark.parametrize("rung", RUNGS)
def test_every_fixture_as_opus_within_the_rungs_bound(runs, rung):
    engine, _svc, results = runs
    assert not [r.errors for r in results.values() if r.errors]
    for name in TEXTS:
        result = results[(rung, name)]
        assert result.ended and result.finals, name
        session = [data for _t, event, data in result.events if event == "session"][0]
        assert session["codec"] == "opus"  # the session event echoes it
    print(f"{engine} opus {rung}: WER {_wer(results, rung):.4f}, PCM {_wer(results, 0):.4f}",
          {n: (results[(0, n)].text, results[(rung, n)].text) for n in TEXTS
           if results[(0, n)].text != results[(rung, n)].text})
    assert _wer(results, rung) <= _wer(results, 0) + WER_BOUND[engine][rung], (
        {n: results[(rung, n)].text for n in TEXTS})


def test_a_second_of_opus_costs_under_a_seventh_of_pcms_bytes(runs):
    """Measured at the gateway: the payloads it stored over the audio they held."""
    _engine, svc, _results = runs
    m = scrape(svc.url + "/metrics")

    def per_second(codec: str) -> float:
        return (m[f'cosyvoice_audio_bytes_total{{codec="{codec}"}}']
                / m[f'cosyvoice_audio_seconds_total{{codec="{codec}"}}'])

    pcm, opus = per_second("pcm16"), per_second("opus")
    assert 32000 <= pcm < 32000 * 1.02  # 16-bit samples at 16 kHz and the envelope
    assert opus < pcm / 7, (opus, pcm)


def test_the_command_line_streams_opus_at_the_bitrate_asked(runs):
    engine, svc, results = runs
    out = subprocess.run(
        [sys.executable, "-m", "cosyvoice", "transcribe", str(FIXTURES / "weather.wav"),
         "--url", svc.url, "--pace", "fast", "--codec", "opus", "--bitrate", "24k", "--json"],
        capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    session = [e for e in events if e.get("event") == "session"][0]
    assert (session["codec"], session["bitrate"]) == ("opus", 24000)
    finals = " ".join(e["text"] for e in events if e.get("event") == "text"
                      and e["type"] == "final")
    # the same packets as the fixture's 24k run: the same transcript
    assert finals.strip() == results[(24000, "weather")].text.strip()


def test_a_corrupt_packet_gets_bad_packet_and_the_session_goes_on(runs):
    _engine, svc, results = runs
    chunks = codecs.opus_chunks(read_pcm("weather"), 24000)
    events: list[tuple[str, dict]] = []
    sio = socketio.Client(reconnection=False)
    for name in ("session", "text", "end", "error"):
        sio.on(name, lambda data, name=name: events.append((name, data)), namespace=NAMESPACE)
    sio.connect(svc.url, namespaces=[NAMESPACE], transports=["websocket"],
                auth={"codec": "opus", "bitrate": 24000})

    def send(packets: list[bytes], seq: int, last: bool = False):
        payload = encode_opus_chunk(packets, seq, bitrate=24000, last=last)
        return sio.call("audio_chunk", payload, namespace=NAMESPACE, timeout=10)

    try:
        for seq in range(3):
            assert send(chunks[seq], seq) == {"seq": seq}
        # framing that cannot be: a code 3 packet without its frame count byte
        assert send([chunks[3][0], b"\x03"], 3) == {"error": "bad_packet", "seq": 3}
        for seq in range(3, len(chunks)):
            assert send(chunks[seq], seq, last=seq == len(chunks) - 1) == {"seq": seq}
        wait_for(lambda: any(name == "end" for name, _ in events), timeout=60)
        sio.call("stop", namespace=NAMESPACE, timeout=10)
    finally:
        sio.disconnect()
    errors = [data for name, data in events if name == "error"]
    assert [(e["code"], e["seq"]) for e in errors] == [("bad_packet", 3)]
    assert "Opus packet 1" in errors[0]["msg"]
    finals = [d["text"] for name, d in events if name == "text" and d["type"] == "final"]
    # the session went on as if the bad chunk had never come
    assert " ".join(f for f in finals if f).strip() == results[(24000, "weather")].text
