"""Adaptive bitrate through a rate-limited link of the test's own (``tests/netlink.py``):
a client in a network namespace whose uplink carries 150 kbit/s, the service on the
host's side. Fixed PCM (about 270 kbit/s on the wire) falls further behind every second;
the same recording with ``--abr`` is switched down to Opus within seconds and keeps up.
The full table, over more links and sessions, is ``benchmarks/abr.py``'s."""

from __future__ import annotations

import json
import sys
import time

import pytest

from ..helpers import ROOT, corpus_wer, harvard_texts, read_pcm, write_pcm_wav
from ..netfault import CuttableProxy
from ..netlink import slow_link
from ..stack import scrape

pytestmark = pytest.mark.system

RATE_KBIT = 150
NAMES = ["birch", "glue", "depth"]
GAP = b"\x00\x00" * 4800  # 0.3 s between the sentences


@pytest.fixture(scope="module")
def link(service):
    """(the namespace's link, the service's URL as a client in it reaches it)."""
    with slow_link(RATE_KBIT) as link:
        proxy = CuttableProxy(int(service.url.rsplit(":", 1)[1]), listen_host=link.host_ip)
        try:
            yield link, proxy.url
        finally:
            proxy.close()


def transcribe(link, url: str, wav, *args: str) -> tuple[float, list[dict]]:
    """``cosyvoice transcribe --json`` in the namespace: (seconds it took, its events)."""
    started = time.monotonic()
    out = link[0].run([sys.executable, "-m", "cosyvoice", "transcribe", str(wav), "--url",
                       url, "--json", *args], capture_output=True, text=True, timeout=150,
                      cwd=ROOT)
    took = time.monotonic() - started
    assert out.returncode == 0, out.stderr[-2000:]
    return took, [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def text_of(events: list[dict]) -> str:
    return " ".join(e["text"] for e in events if e["event"] == "text" and e["type"] == "final")


def _switches(url: str) -> float:
    return scrape(url + "/metrics").get(
        'cosyvoice_abr_switches_total{direction="down",reason="congestion"}', 0.0)


def test_on_a_150_kbit_link_fixed_pcm_falls_behind_and_abr_keeps_up(link, service, tmp_path):
    pcm = GAP.join(read_pcm(n) for n in NAMES)
    audio_s = len(pcm) / 32000
    wav = tmp_path / "speech.wav"
    write_pcm_wav(wav, pcm)
    refs = " ".join(harvard_texts()[n] for n in NAMES)
    switches_before = _switches(service.url)

    fixed_s, fixed = transcribe(link, link[1], wav, "--codec", "pcm16")
    adaptive_s, adaptive = transcribe(link, link[1], wav, "--abr")
    print(f"{audio_s:.1f} s of audio: fixed PCM took {fixed_s:.1f} s, --abr {adaptive_s:.1f} s;",
          [e for e in adaptive if e["event"].startswith("switch")])

    # 270 kbit/s through 150: the end comes about as late as the audio is long
    assert fixed_s > audio_s + 5
    assert not [e for e in fixed if e["event"].startswith("switch")]
    downs = [e for e in adaptive if e["event"] == "switch_down"]
    assert downs, adaptive
    assert {k: downs[0][k] for k in ("codec", "sample_rate", "reason")} == {
        "codec": "opus", "sample_rate": 16000, "reason": "congestion"}
    assert downs[0]["bitrate"] in (32000, 24000, 16000, 12000)
    session = [e for e in adaptive if e["event"] == "session"][0]
    assert session["codec"] == "pcm16"  # no hint from a script: it starts on the highest
    # it keeps up: its last final comes seconds before the fixed run's. Compared with the
    # fixed run rather than the audio's length: both runs pay the same process start and
    # stop, which a busy machine stretches. And as accurate as the fixed run within the
    # Opus rungs' measured cost.
    assert fixed_s - adaptive_s > 3, (fixed_s, adaptive_s)
    assert corpus_wer([refs], [text_of(adaptive)]) <= corpus_wer([refs], [text_of(fixed)]) + 0.035
    assert _switches(service.url) >= switches_before + 1
