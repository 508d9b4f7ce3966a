"""The page at `/` in real headless Chromium: fake microphone to transcript on screen.

Chromium plays a fixture through its fake capture device (which loops the file, so the
fixture is padded with silence and Stop is pressed after one pass); the page captures it
with its AudioWorklet and streams it to the real gateway and workers.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
import srt
from playwright.sync_api import ConsoleMessage, Page, ViewportSize, expect, sync_playwright

from cosyvoice.client import StreamingClient, transcribe_pcm
from cosyvoice.gateway import tokens
from cosyvoice.settings import Settings
from cosyvoice.store import keys
from cosyvoice.store.embedded_redis import free_port
from cosyvoice.text import script

from .. import launcher
from ..helpers import (
    FIXTURES,
    TEST_ENV,
    cer,
    conversation,
    corpus_wer,
    fixture_texts,
    han,
    harvard_texts,
    joined,
    phase_bound,
    read_pcm,
    wer,
    write_pcm_wav,
    zh_texts,
)
from ..netfault import CuttableProxy
from ..netlink import slow_link
from ..stack import scrape

pytestmark = pytest.mark.e2e

TEXTS = fixture_texts()
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
PAD_BEFORE_S = 1.0
# A test stops recording this long after the speech ended.
SILENCE_BEFORE_STOP_S = 2.0
# The fake microphone plays its file in a loop. After the speech and the silence before
# Stop, the file holds this much more silence: longer than what a test waits for between
# Start and Stop on a busy machine (a gateway's restart and the reconnection, the slow
# link's switch), so the speech never starts over before Stop.
LOOP_GUARD_S = 60.0
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
BASE_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--no-first-run", "--use-fake-device-for-media-stream"]

# Records what the reader sees: each partial text as it is shown, each final as appended.
OBSERVER_JS = """
window.__seen = [];
document.addEventListener("DOMContentLoaded", () => {
  const partial = document.getElementById("partial");
  const finals = document.getElementById("finals");
  new MutationObserver(() => {
    const text = partial.textContent.trim();
    if (text) window.__seen.push(["partial", text]);
  }).observe(partial, { childList: true, characterData: true, subtree: true });
  new MutationObserver((records) => {
    for (const r of records)
      for (const node of r.addedNodes)
        if (node.nodeType === Node.ELEMENT_NODE) window.__seen.push(["final", node.textContent]);
  }).observe(finals, { childList: true });
});
"""


def padded_wav(pcm: bytes, path: Path) -> float:
    """Writes 16 kHz PCM with silence around it as the fake microphone's file; how long
    from the start of capture until the speech and ``SILENCE_BEFORE_STOP_S`` have played."""
    silence = lambda s: b"\0\0" * int(16000 * s)  # noqa: E731
    write_pcm_wav(path, silence(PAD_BEFORE_S) + pcm
                  + silence(SILENCE_BEFORE_STOP_S + LOOP_GUARD_S))
    return PAD_BEFORE_S + len(pcm) / 32000 + SILENCE_BEFORE_STOP_S


@dataclass
class Observed:
    """Everything the page did that a test checks besides what it shows."""

    console_errors: list[str] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)

    def watch(self, page: Page) -> None:
        def on_console(message: ConsoleMessage) -> None:
            if message.type == "error":
                self.console_errors.append(message.text)

        page.on("console", on_console)
        page.on("pageerror", lambda e: self.console_errors.append(str(e)))
        page.on("request", lambda r: self.urls.append(r.url))
        page.on("websocket", lambda ws: self.urls.append(ws.url))
        page.add_init_script(OBSERVER_JS)

    def assert_stayed_local(self) -> None:
        assert self.urls and all(urlsplit(u).hostname in LOCAL_HOSTS for u in self.urls), self.urls


@contextlib.contextmanager
def browser_page(viewport: ViewportSize, microphone_wav: Path | None = None,
                 allow_microphone: bool = True, executable: str = CHROMIUM,
                 extra_args: tuple[str, ...] = ()) -> Iterator[tuple[Page, Observed]]:
    """A fresh headless Chromium (own temporary profile) with one page, and what it did."""
    args = [*BASE_ARGS, *extra_args]
    if allow_microphone:
        args.append("--use-fake-ui-for-media-stream")
    if microphone_wav is not None:
        args.append(f"--use-file-for-fake-audio-capture={microphone_wav}")
    observed = Observed()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, headless=True, args=args)
        try:
            page = browser.new_page(viewport=viewport)
            observed.watch(page)
            yield page, observed
        finally:
            browser.close()


def wait_until_played(started: float, duration_s: float) -> None:
    """Waits until ``duration_s`` (``padded_wav``'s answer) after ``started``: the fake
    device plays its file from when capture opened."""
    time.sleep(max(0.0, started + duration_s - time.monotonic()))


def record_one_pass(page: Page, duration_s: float) -> None:
    """Start, one pass of the fake microphone's file, Stop, and back to Start once the
    server sent ``end`` for the last chunk."""
    button = page.locator("#record")
    page.get_by_role("button", name="Start").click()
    expect(button).to_have_attribute("aria-pressed", "true")
    wait_until_played(time.monotonic(), duration_s)
    page.get_by_role("button", name="Stop").click()
    expect(button).to_have_text("Start", timeout=30_000)


def bound(name: str) -> float:
    return phase_bound(TEXTS[name], read_pcm(name))


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_speech_into_the_page_microphone_shows_its_transcript(service, artifacts, tmp_path, name):
    wav = tmp_path / f"{name}.wav"
    duration = padded_wav(read_pcm(name), wav)
    with browser_page({"width": 900, "height": 760}, wav) as (page, observed):
        page.goto(service.url + "/")
        button = page.locator("#record")
        page.get_by_role("button", name="Start").click()
        expect(button).to_have_attribute("aria-pressed", "true")
        started = time.monotonic()
        expect(page.locator("#connection")).to_contain_text("Connected")
        wait_until_played(started, duration)
        page.get_by_role("button", name="Stop").click()
        # Back to Start once the server sent `end` for the last chunk and `stop` was acked.
        expect(button).to_have_text("Start", timeout=30_000)
        expect(page.locator("#message")).to_be_hidden()
        page.screenshot(path=str(artifacts / f"browser-{name}.png"), full_page=True)
        text = page.locator("#finals").inner_text()
        seen = page.evaluate("window.__seen")
        latency = page.locator("#latency").inner_text()
        connection = page.locator("#connection").inner_text()
        audio = page.locator("#audio").inner_text()

    print(f"{name}: page WER {wer(TEXTS[name], text):.3f}, bound {bound(name):.3f}, "
          f"latency {latency}, {audio}: {text!r}")
    # Chromium's WebCodecs encodes Opus: the page sends it at the server's best bitrate
    assert audio.endswith(f"Opus {Settings().opus_bitrate_list[0] // 1000} kbit/s"), audio
    assert wer(TEXTS[name], text) <= bound(name), (text, TEXTS[name])
    kinds = [kind for kind, _text in seen]
    assert "partial" in kinds and "final" in kinds, seen
    assert kinds.index("partial") < kinds.index("final"), seen
    assert re.fullmatch(r"\d+ ms", latency), latency
    assert connection == "Not connected"
    assert observed.console_errors == []
    observed.assert_stayed_local()


def _stored_audio_s(url: str) -> dict[str, float]:
    """Seconds of audio the gateway stored so far, by codec."""
    m = scrape(url + "/metrics")
    return {codec: m[f'cosyvoice_audio_seconds_total{{codec="{codec}"}}']
            for codec in ("pcm16", "opus")}


def test_the_page_sends_pcm_when_its_address_asks(service, tmp_path):
    """``?codec=pcm16``: the microphone's audio goes as PCM (what the page does where the
    browser has no WebCodecs Opus encoder or the server offers no Opus), and the gateway
    stores PCM, not Opus."""
    wav = tmp_path / "coffee.wav"
    duration = padded_wav(read_pcm("coffee"), wav)
    before = _stored_audio_s(service.url)
    with browser_page({"width": 900, "height": 760}, wav) as (page, observed):
        page.goto(service.url + "/?codec=pcm16")
        page.get_by_role("button", name="Start").click()
        started = time.monotonic()
        expect(page.locator("#connection")).to_contain_text("Connected")
        expect(page.locator("#audio")).to_contain_text("PCM")
        wait_until_played(started, duration)
        page.get_by_role("button", name="Stop").click()
        expect(page.locator("#record")).to_have_text("Start", timeout=30_000)
        text = page.locator("#finals").inner_text()
    after = _stored_audio_s(service.url)
    assert wer(TEXTS["coffee"], text) <= bound("coffee"), text
    assert after["pcm16"] - before["pcm16"] >= duration - 0.5
    assert after["opus"] == before["opus"]
    assert observed.console_errors == []


def test_on_a_slow_link_the_page_is_switched_down_and_keeps_up(service, tmp_path):
    """Chromium in a network namespace whose uplink carries 16 kbit/s (tests/netlink.py),
    far under Opus at 32 kbit/s with its framing: the server switches the page down, the
    page says so and encodes at the lower bitrate, and the transcript stays within its
    bound."""
    names = ["birch", "glue", "depth"]
    wav = tmp_path / "speech.wav"
    speech = (b"\0\0" * 4800).join(read_pcm(n) for n in names)
    duration = padded_wav(speech, wav)
    reference = " ".join(harvard_texts()[n] for n in names)
    # the same speech as PCM over loopback: the bound is its WER and 5 points for the
    # lower rungs and a switch mid-sentence (benchmarks/abr.py's definition of failure)
    bound = corpus_wer([reference], [transcribe_pcm(service.url, speech, 16000,
                                                    pace="fast").text]) + 0.05
    with slow_link(16) as link:
        proxy = CuttableProxy(int(service.url.rsplit(":", 1)[1]), listen_host=link.host_ip)
        wrapper = tmp_path / "chromium-in-namespace"
        wrapper.write_text(f'#!/bin/sh\nexec ip netns exec {link.namespace} {CHROMIUM} "$@"\n')
        wrapper.chmod(0o755)
        try:
            with browser_page({"width": 900, "height": 760}, wav, executable=str(wrapper),
                              extra_args=(f"--unsafely-treat-insecure-origin-as-secure="
                                          f"{proxy.url}",)) as (page, observed):
                page.goto(proxy.url + "/")
                page.get_by_role("button", name="Start").click()
                started = time.monotonic()
                expect(page.locator("#connection")).to_contain_text("Connected", timeout=15_000)
                expect(page.locator("#message")).to_contain_text("The network is slow",
                                                                 timeout=20_000)
                switched = page.locator("#audio").inner_text()
                wait_until_played(started, duration)
                page.get_by_role("button", name="Stop").click()
                expect(page.locator("#record")).to_have_text("Start", timeout=40_000)
                text = page.locator("#finals").inner_text()
        finally:
            proxy.close()
    print(f"switched to {switched!r}: {text!r}")
    assert re.search(r"Opus (24|16|12) kbit/s$", switched), switched
    assert corpus_wer([reference], [text]) <= bound, text
    assert observed.console_errors == []


def test_page_works_by_keyboard_alone_at_phone_width(service, artifacts, tmp_path):
    name = "coffee"
    wav = tmp_path / f"{name}.wav"
    duration = padded_wav(read_pcm(name), wav)
    with browser_page({"width": 390, "height": 844}, wav) as (page, observed):
        page.goto(service.url + "/")
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        page.keyboard.press("Tab")
        expect(page.get_by_role("button", name="Start")).to_be_focused()
        page.keyboard.press("Space")
        expect(page.get_by_role("button", name="Stop")).to_be_focused()
        started = time.monotonic()
        wait_until_played(started, duration)
        page.keyboard.press("Enter")
        expect(page.get_by_role("button", name="Start")).to_be_focused(timeout=30_000)
        # What a screen reader announces: the labelled live region with the final text.
        text = page.get_by_role("log", name="Final text").inner_text()
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        page.screenshot(path=str(artifacts / "browser-phone.png"), full_page=True)
    assert wer(TEXTS[name], text) <= bound(name), text
    assert observed.console_errors == []
    observed.assert_stayed_local()


def test_denied_microphone_says_how_to_allow_it(service):
    with browser_page({"width": 900, "height": 760}, allow_microphone=False) as (page, observed):
        page.goto(service.url + "/")
        page.get_by_role("button", name="Start").click()
        expect(page.get_by_role("alert")).to_contain_text("Microphone access was denied")
        expect(page.locator("#record")).to_have_text("Start")
        expect(page.locator("#connection")).to_have_text("Not connected")
    assert observed.console_errors == []
    observed.assert_stayed_local()


@contextlib.contextmanager
def own_gateway_process(redis_url: str, artifacts: Path, extra_env: dict | None = None):
    """A gateway process of the test's own on a free port; restartable with `start`."""
    port = free_port()
    env = {**TEST_ENV, **(extra_env or {})}
    url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        gateway = launcher.start_gateway(redis_url, env=env, logs=artifacts,
                                         name=f"own-gateway-{port}", port=port)
        procs.append(gateway.proc)
        return gateway.proc

    start()
    try:
        yield url, start, procs
    finally:
        launcher.stop(*procs)


@pytest.fixture
def own_gateway(service, artifacts):
    """A gateway of the test's own on the shared Redis and workers, which it may kill."""
    with own_gateway_process(service.redis_url, artifacts) as gateway:
        yield gateway


def session_id(page) -> str:
    """The session the page shows, once its `session` event (after `connect`) arrived."""
    expect(page.locator("#session")).to_have_attribute("title", re.compile(r"^[0-9a-f]{24}$"))
    return page.locator("#session").get_attribute("title")


def crash(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_server_gone_mid_recording_is_reported_after_the_reconnection_attempts(
        own_gateway, redis_client: redis.Redis, tmp_path):
    url, _start, procs = own_gateway
    wav = tmp_path / "weather.wav"
    padded_wav(read_pcm("weather"), wav)
    with browser_page({"width": 900, "height": 760}, wav) as (page, observed):
        page.goto(url + "/")
        page.get_by_role("button", name="Start").click()
        expect(page.locator("#connection")).to_contain_text("Connected")
        session = session_id(page)
        crash(procs[0])
        expect(page.locator("#connection")).to_contain_text("reconnecting")
        # 5 attempts, 1 s apart backing off to 5 s (randomised by half): under 40 s.
        expect(page.get_by_role("alert")).to_contain_text("Cannot reach the server", timeout=40_000)
        expect(page.locator("#connection")).to_have_text("Server unreachable")
        expect(page.locator("#record")).to_have_text("Start")
    observed.assert_stayed_local()
    redis_client.delete(*keys.session_keys(session))  # the crashed gateway's leftovers


def test_gateway_crash_mid_recording_loses_no_text_and_says_what_happened(
        own_gateway, redis_client: redis.Redis, artifacts, tmp_path):
    url, start, procs = own_gateway
    pcm = (FIXTURES / "two_utterances.wav").read_bytes()[44:]
    reference = (FIXTURES / "two_utterances.txt").read_text().split("\t")[1]
    wav = tmp_path / "two.wav"
    duration = padded_wav(pcm, wav)
    with browser_page({"width": 900, "height": 760}, wav) as (page, observed):
        page.goto(url + "/")
        page.get_by_role("button", name="Start").click()
        started = time.monotonic()
        expect(page.locator("#connection")).to_contain_text("Connected")
        first_session = session_id(page)
        # The first utterance's final is on the page: the gateway dies in the pause after it.
        expect(page.locator("#finals")).not_to_be_empty(timeout=15_000)
        crash(procs[0])
        start()
        # The server either resumes the session or the page opens a new one; either way
        # the reader is told which.
        message = page.get_by_role("alert")
        expect(message).to_contain_text(re.compile("session continues|new session started"),
                                         timeout=20_000)
        resumed = session_id(page) == first_session
        expect(message).to_contain_text("session continues" if resumed else "new session started")
        wait_until_played(started, duration)
        page.get_by_role("button", name="Stop").click()
        expect(page.locator("#record")).to_have_text("Start", timeout=30_000)
        text = page.locator("#finals").inner_text()
        page.screenshot(path=str(artifacts / "browser-reconnect.png"), full_page=True)
    print(f"after the crash ({'resumed' if resumed else 'new session'}): {text!r}")
    assert wer(reference, text) <= phase_bound(reference, pcm), text
    observed.assert_stayed_local()
    redis_client.delete(*keys.session_keys(first_session))  # left over unless resumed


def test_service_requiring_a_token_refuses_the_page_without_one_and_takes_it_from_the_address(
        service, artifacts):
    secret = "browser-test-secret"
    env = {"COSYVOICE_AUTH_SECRET": secret}
    with own_gateway_process(service.redis_url, artifacts, env) as (url, _start, _procs), \
            browser_page({"width": 900, "height": 760}) as (page, observed):
        page.goto(url + "/")
        page.get_by_role("button", name="Start").click()
        expect(page.get_by_role("alert")).to_contain_text("needs a valid token")
        expect(page.locator("#record")).to_have_text("Start")
        page.wait_for_timeout(500)  # the refused connection's close must not hide why
        expect(page.get_by_role("alert")).to_contain_text("needs a valid token")

        page.goto(f"{url}/#token={tokens.issue(secret, 'browser-test')}")
        page.get_by_role("button", name="Start").click()
        expect(page.locator("#connection")).to_contain_text("Connected")
        expect(page.get_by_role("alert")).to_be_hidden()
        page.get_by_role("button", name="Stop").click()
        expect(page.locator("#record")).to_have_text("Start", timeout=30_000)
        expect(page.get_by_role("alert")).to_be_hidden()
    observed.assert_stayed_local()


@contextlib.contextmanager
def isolated_service(artifacts: Path, name: str, extra_env: dict):
    """Gateway and one worker process on a Redis of their own, for limits no other test
    may disturb (capacity, sessions per address)."""
    with launcher.redis_server() as server:
        svc = launcher.start_service(server.url, processes=1, env={**TEST_ENV, **extra_env},
                                     logs=artifacts, name=name)
        try:
            yield svc
        finally:
            svc.stop()


def test_page_says_when_the_service_is_at_capacity(artifacts):
    with isolated_service(artifacts, "capacity", {"COSYVOICE_WORKER_CAPACITY": "1"}) as svc:
        holder = StreamingClient(svc.url)
        try:
            holder.connect()  # takes the only decoding slot
            with browser_page({"width": 900, "height": 760}) as (page, observed):
                page.goto(svc.url + "/")
                page.get_by_role("button", name="Start").click()
                alert = page.get_by_role("alert")
                expect(alert).to_contain_text("The service is at capacity")
                expect(alert).to_contain_text(re.compile(r"try again in \d+ s"))
                expect(page.locator("#record")).to_have_text("Start")
                page.wait_for_timeout(500)  # the refused connection's close must not hide why
                expect(alert).to_contain_text("The service is at capacity")
            observed.assert_stayed_local()
        finally:
            holder.close()


def test_page_says_when_the_service_spaces_its_live_text_out(artifacts, tmp_path):
    """A worker whose partial budget is tiny (COSYVOICE_LIVE_PARTIAL_BUSY) spaces a session's
    partials out and sends a ``load`` event: the page shows the busy notice while it
    records, the final text as ever, and no notice once it stops."""
    names = ["door", "weather", "call"]
    pcm = (b"\0\0" * 4800).join(read_pcm(n) for n in names)
    wav = tmp_path / "busy.wav"
    duration = padded_wav(pcm, wav)
    env = {"COSYVOICE_LIVE_PARTIAL_BUSY": "0.05", "COSYVOICE_LIVE_PARTIAL_FLOOR_S": "3"}
    with isolated_service(artifacts, "busy-page", env) as svc, \
            browser_page({"width": 900, "height": 760}, wav) as (page, observed):
        page.goto(svc.url + "/")
        busy = page.locator("#busy")
        expect(busy).to_be_hidden()
        button = page.locator("#record")
        page.get_by_role("button", name="Start").click()
        expect(button).to_have_attribute("aria-pressed", "true")
        started = time.monotonic()
        expect(busy).to_be_visible(timeout=int(duration * 1000))
        expect(busy).to_have_text(re.compile(r"busy: live text every \d+(\.\d)? s"))
        page.screenshot(path=str(artifacts / "browser-busy.png"))
        wait_until_played(started, duration)
        page.get_by_role("button", name="Stop").click()
        expect(button).to_have_text("Start", timeout=30_000)
        expect(busy).to_be_hidden()
        text = page.locator("#finals").inner_text()
    reference = " ".join(TEXTS[n] for n in names)
    assert corpus_wer([reference], [text]) <= 0.1, text
    assert observed.console_errors == []


def test_page_explains_a_refused_connection_and_keeps_the_reason(artifacts):
    env = {"COSYVOICE_MAX_SESSIONS_PER_CLIENT": "1"}
    with isolated_service(artifacts, "per-address", env) as svc:
        holder = StreamingClient(svc.url)
        try:
            holder.connect()  # this address's only session
            with browser_page({"width": 900, "height": 760}) as (page, observed):
                page.goto(svc.url + "/")
                page.get_by_role("button", name="Start").click()
                alert = page.get_by_role("alert")
                expect(alert).to_contain_text("limits for this address were reached")
                expect(page.locator("#record")).to_have_text("Start")
                page.wait_for_timeout(500)  # the refused connection's close must not hide why
                expect(alert).to_contain_text("limits for this address were reached")
                # a refusal is a Socket.IO connect error: the connection never opened
                expect(page.locator("#connection")).to_have_text("Refused")
            observed.assert_stayed_local()
        finally:
            holder.stop()
            holder.close()


# ---- files in, transcripts out ----------------------------------------------------------------


def _drop(page: Page, name: str, data: bytes, mime: str) -> None:
    """Drops a file on the transcript, as a user dragging it from their desktop would."""
    import base64
    transfer = page.evaluate_handle(
        """([name, b64, mime]) => {
            const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
            const dt = new DataTransfer();
            dt.items.add(new File([bytes], name, { type: mime }));
            return dt;
        }""", [name, base64.b64encode(data).decode(), mime])
    page.dispatch_event("#transcript", "dragover", {"dataTransfer": transfer})
    page.dispatch_event("#transcript", "drop", {"dataTransfer": transfer})


def test_a_dropped_audio_file_is_transcribed_and_the_transcript_saved(service, artifacts,
                                                                      tmp_path):
    """An MP3 (44.1 kHz stereo, made by the test with PyAV) dropped on the page: decoded by
    the browser, streamed through the session protocol, transcribed within the bound of
    the microphone test; Copy and the three downloads give the page's text."""
    import numpy as np
    import srt
    import webvtt

    from ..system.test_cli import encode

    name = "door"
    x = np.frombuffer(read_pcm(name), "<i2").astype(np.float32) / 32768
    mp3 = encode(tmp_path / f"{name}.mp3", "mp3", "libmp3lame", x, 44100, 2)
    with browser_page({"width": 900, "height": 760}, allow_microphone=False) as (page, observed):
        page.context.grant_permissions(["clipboard-read", "clipboard-write"])
        page.goto(service.url + "/")
        _drop(page, mp3.name, mp3.read_bytes(), "audio/mpeg")
        expect(page.get_by_role("alert")).to_contain_text(f"Transcribing “{mp3.name}”")
        expect(page.locator("#record")).to_have_text("Stop")
        expect(page.locator("#record")).to_have_text("Start", timeout=60_000)
        expect(page.get_by_role("alert")).to_be_hidden()
        text = page.locator("#finals").inner_text()
        assert wer(TEXTS[name], text) <= bound(name), (text, TEXTS[name])
        assert page.locator("#finals .segment").first.get_attribute("data-engine") \
            == "whisper-live"

        page.get_by_role("button", name="Copy").click()
        expect(page.get_by_role("alert")).to_contain_text("copied")
        assert page.evaluate("navigator.clipboard.readText()").split() == text.split()
        saved = {}
        for fmt in ("txt", "srt", "vtt"):
            with page.expect_download() as download:
                page.get_by_role("button", name=f"Download .{fmt}").click()
            assert download.value.suggested_filename.endswith(f".{fmt}")
            saved[fmt] = Path(download.value.path()).read_text(encoding="utf-8")
        page.screenshot(path=str(artifacts / "browser-dropped-file.png"), full_page=True)
        assert observed.console_errors == []
        observed.assert_stayed_local()
    assert saved["txt"].split() == text.split()
    subs = list(srt.parse(saved["srt"]))
    assert " ".join(s.content for s in subs).split() == text.split()
    cues = webvtt.from_string(saved["vtt"]).captions
    assert " ".join(c.text for c in cues).split() == text.split()
    assert all(a.end <= b.start for a, b in zip(subs, subs[1:], strict=False))


def test_a_file_that_is_not_audio_gets_a_readable_message(service, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("these are meeting notes, not audio\n" * 20)
    with browser_page({"width": 900, "height": 760}, allow_microphone=False) as (page, observed):
        page.goto(service.url + "/")
        _drop(page, notes.name, notes.read_bytes(), "text/plain")
        alert = page.get_by_role("alert")
        expect(alert).to_contain_text("“notes.txt” could not be read as audio")
        expect(page.locator("#record")).to_have_text("Start")
        page.locator("#file").set_input_files(str(notes))  # picked rather than dropped
        expect(alert).to_contain_text("“notes.txt” could not be read as audio")
        expect(page.locator("#connection")).to_have_text("Not connected")  # nothing sent
        observed.assert_stayed_local()


def test_a_server_with_several_modes_lets_the_page_choose_before_start(artifacts):
    """A 2-pass gateway offers its session modes (`/config`): the page shows the choice."""
    with launcher.redis_server() as server:
        gateway = launcher.start_gateway(server.url, env={**TEST_ENV,
                                                          "COSYVOICE_ENGINE": "2pass"},
                                         logs=artifacts, name="modes-gateway")
        try:
            with browser_page({"width": 900, "height": 760}) as (page, observed):
                page.goto(gateway.url + "/")
                choice = page.get_by_label("Mode")
                expect(choice).to_be_visible()
                options = choice.locator("option")
                expect(options).to_have_count(3)
                assert [options.nth(i).get_attribute("value") for i in range(3)] == \
                    ["2pass", "pocketsphinx", "whisper"]
                choice.select_option("whisper")
                observed.assert_stayed_local()
        finally:
            launcher.stop(gateway.proc)


def test_mandarin_into_the_page_microphone_shows_simplified_text(service, artifacts, tmp_path):
    """The page's language choice (Chinese, remembered over a reload), a Mandarin speaker
    at the fake microphone: the transcript is Chinese, in Simplified characters, without
    spaces between the sentences."""
    names = ["zh/zh01", "zh/zh06"]
    wav = tmp_path / "zh.wav"
    duration = padded_wav(joined(names), wav)
    with browser_page({"width": 900, "height": 760}, wav) as (page, observed):
        page.goto(service.url + "/")
        choice = page.get_by_label("Language")
        expect(choice).to_be_visible()
        assert choice.locator("option").first.get_attribute("value") == "auto"
        choice.select_option("zh")
        page.reload()
        expect(page.get_by_label("Language")).to_have_value("zh")  # remembered
        expect(page.locator("#script-choice")).to_be_visible()
        record_one_pass(page, duration)
        page.screenshot(path=str(artifacts / "browser-mandarin.png"), full_page=True)
        text = page.locator("#finals").inner_text()
        seen = page.evaluate("window.__seen")
    print(f"Mandarin on the page: {text!r}")
    reference = "".join(zh_texts()[n] for n in names)
    assert han(text) and cer([reference], [text]) <= 0.15, text
    assert script.convert(text, "hans") == text, text  # no Traditional character
    assert " " not in text.strip(), text
    assert any(kind == "partial" and han(t) for kind, t in seen), seen
    assert observed.console_errors == []
    observed.assert_stayed_local()


def test_two_voices_at_the_page_microphone_show_two_speakers(service, artifacts, tmp_path):
    """The page's "Speaker labels" switch (remembered over a reload), two voices taking
    turns at the fake microphone: each turn shows its speaker's label in a colour of its
    own, and the downloaded subtitles carry the speakers."""
    pcm, truth = conversation(["speakers/slt1", "speakers/kal1", "speakers/slt2",
                               "speakers/kal2"], gaps=[1.0, 0.8, 1.0])
    wav = tmp_path / "two.wav"
    duration = padded_wav(pcm, wav)
    with browser_page({"width": 900, "height": 760}, wav) as (page, observed):
        page.goto(service.url + "/")
        page.get_by_label("Speaker labels").check()
        page.reload()
        expect(page.get_by_label("Speaker labels")).to_be_checked()  # remembered
        record_one_pass(page, duration)
        page.screenshot(path=str(artifacts / "browser-speakers.png"), full_page=True)
        segments = page.locator("#finals .segment")
        speakers = [segments.nth(i).get_attribute("data-speaker")
                    for i in range(segments.count())]
        turns = page.locator("#finals .segment.turn")
        colours = {turns.nth(i).evaluate("e => getComputedStyle(e, '::before')"
                                         ".backgroundColor") for i in range(turns.count())}
        with page.expect_download() as download:
            page.get_by_role("button", name="Download .srt").click()
        subtitles = Path(download.value.path()).read_text()
    print(f"speakers on the page: {speakers}")
    assert speakers == ["S1", "S2", "S1", "S2"]
    assert len(colours) == 2  # a colour each
    cues = list(srt.parse(subtitles))
    assert [c.content[:4] for c in cues] == ["[S1]", "[S2]", "[S1]", "[S2]"]
    assert observed.console_errors == []
    observed.assert_stayed_local()
