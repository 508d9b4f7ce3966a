"""A busy service: partials spaced out with a ``load`` event, finals on time and in order,
and ``GET /load`` (and the load metric) saying how busy it is.

Real parts: the gateway and one whisper-live worker process on a Redis of their own. The
service's partial budget is tiny (``COSYVOICE_LIVE_PARTIAL_BUSY``), so two real-time
sessions are more partial decoding than it lets its scheduler do: it must space every
session's partials out, down to the floor, and say so.
"""

from __future__ import annotations

import threading
import time
from statistics import median

import pytest
import requests

from cosyvoice.client import StreamingClient

from .. import launcher
from ..helpers import TEST_ENV, corpus_wer, fixture_texts, read_pcm
from ..stack import scrape

pytestmark = pytest.mark.system

TEXTS = fixture_texts()
FLOOR_S = 3.0
BUSY_ENV = {"COSYVOICE_LIVE_PARTIAL_BUSY": "0.05", "COSYVOICE_LIVE_PARTIAL_FLOOR_S": str(FLOOR_S),
            "COSYVOICE_MAX_SESSIONS_PER_CLIENT": "0"}
# two utterances: three sentences run together (a long one), then two; the sessions end
# an utterance after ENDPOINT_MS of silence, so the short pauses inside each do not
ENDPOINT_MS = 1000
UTTERANCES = [["door", "weather", "call"], ["coffee", "meeting"]]


def silence(seconds: float) -> bytes:
    return b"\0\0" * int(16000 * seconds)


def speech() -> tuple[bytes, list[str]]:
    pcm, refs = b"", []
    for names in UTTERANCES:
        pcm += silence(0.2).join(read_pcm(n) for n in names) + silence(2.0)
        refs.append(" ".join(TEXTS[n] for n in names))
    return pcm, refs


@pytest.fixture(scope="module")
def busy_service(artifacts):
    with launcher.redis_server() as server:
        svc = launcher.start_service(server.url, processes=1, env={**TEST_ENV, **BUSY_ENV},
                                     logs=artifacts, name="busy")
        try:
            yield svc
        finally:
            svc.stop()


def stream_sessions(url: str, n: int, during=None) -> list[StreamingClient]:
    """``n`` sessions of ``speech()`` in real time at once; ``during()`` runs meanwhile."""
    pcm, _ = speech()
    clients = [StreamingClient(url, endpoint_ms=ENDPOINT_MS) for _ in range(n)]
    errors: list[BaseException] = []

    def run(c: StreamingClient) -> None:
        try:
            c.connect()
            c.stream_pcm(pcm, 16000, pace="realtime")
            c.wait_end(60)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    if during is not None:
        during()
    for t in threads:
        t.join(90)
    for c in clients:
        c.close()
    assert not errors, errors
    return clients


def partial_gaps(c: StreamingClient, after: float) -> list[float]:
    """Seconds between a session's consecutive partials of one utterance, the later one
    after ``after``."""
    gaps: list[float] = []
    last: dict[int, float] = {}
    for t, event, data in c.result.events:
        if event != "text" or data["type"] != "partial":
            continue
        if data["utterance"] in last and t > after:
            gaps.append(t - last[data["utterance"]])
        last[data["utterance"]] = t
    return gaps


def test_a_busy_worker_spaces_partials_out_says_so_keeps_its_finals_and_load_shows_it(
        busy_service):
    seen: list[dict] = []

    def watch() -> None:  # GET /load while the sessions stream
        deadline = time.monotonic() + 12
        while time.monotonic() < deadline:
            seen.append(requests.get(busy_service.url + "/load", timeout=10).json())
            time.sleep(0.5)

    clients = stream_sessions(busy_service.url, 2, watch)
    _, refs = speech()
    for c in clients:
        assert c.result.ended and not c.result.errors
        loads = c.result.loads
        assert loads, "no load event"
        first = loads[0]
        # spaced out: past the 1 s base, at most the floor
        assert first["busy"] is True and 1000 < first["partial_interval_ms"] <= FLOOR_S * 1000
        told_at = next(t for t, e, _ in c.result.events if e == "load")
        gaps = partial_gaps(c, told_at)
        assert gaps and median(gaps) >= 0.75 * first["partial_interval_ms"] / 1000, gaps
        # the finals: every utterance, in order, as accurate as an idle service's
        finals = c.result.finals
        assert [f["utterance"] for f in finals] == list(range(len(finals)))
        assert len(finals) >= len(UTTERANCES)
        assert corpus_wer([" ".join(refs)], [c.result.text]) <= 0.1, c.result.text
    # GET /load while they streamed: both sessions, the spaced-out partials
    busiest = max(seen, key=lambda s: s["partial_interval_ms"] or 0)
    assert busiest["sessions"] == 2 and busiest["capacity"] >= 2
    assert busiest["partial_interval_ms"] > 1000
    worker = busiest["workers"][0]
    assert worker["sessions"] == 2 and worker["partial_interval_ms"] > 1000
    assert worker["partial_wait_p95_ms"] is not None and 0 <= worker["busy"] <= 1

    # and once they ended: nothing open, room, the drain measured, the same as gauges
    body = requests.get(busy_service.url + "/load", timeout=10).json()
    assert set(body) == {"sessions", "capacity", "load", "full", "final_wait_p95_ms",
                         "partial_wait_p95_ms", "partial_interval_ms", "drain_per_s",
                         "retry_after_ms", "workers"}
    assert body["sessions"] == 0 and body["capacity"] >= 1 and body["load"] == 0
    assert body["full"] is False and body["retry_after_ms"] is None
    assert body["drain_per_s"] > 0  # the two sessions ended within the drain window
    assert len(body["workers"]) == 1
    assert set(body["workers"][0]) == {"id", "sessions", "capacity", "busy",
                                       "final_wait_p95_ms", "partial_wait_p95_ms",
                                       "partial_interval_ms"}
    metrics = scrape(busy_service.url + "/metrics")
    assert metrics["cosyvoice_service_sessions"] == 0
    assert metrics["cosyvoice_service_capacity"] == body["capacity"]
    assert metrics["cosyvoice_service_load_ratio"] == 0
