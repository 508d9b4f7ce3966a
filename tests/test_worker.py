"""Session ownership with real worker processes: leases, capacity, hand-over, take-over.

Each test writes a session's audio straight into Redis with the gateway's own Bus calls,
so the timing of what the worker sees is under the test's control.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import redis

from cosyvoice import bus as busmod
from cosyvoice.audio import split_chunks

from . import launcher
from .helpers import (
    direct_decode,
    fixture_texts,
    read_pcm,
    results,
    rounds_until,
    wer,
    write_session,
)
from .launcher import terminate, wait_for

LEASE_MS = 1000
# Short leases, so that a hand-over or take-over happens within a test.
LEASE_ENV = {"COSYVOICE_LEASE_TTL_MS": str(LEASE_MS), "COSYVOICE_LEASE_RENEW_MS": "200",
             "COSYVOICE_CLAIM_INTERVAL_MS": "200"}


def start_pool(redis_url: str, artifacts, name: str, capacity: int = 4) -> subprocess.Popen:
    """One worker process with short leases, once it is live."""
    return launcher.start_worker_pool(redis_url, capacity=capacity, env=LEASE_ENV,
                                      logs=artifacts, name=name).proc


def ended(client, sid) -> bool:
    return any(r["type"] == "end" for r in results(client, sid))


def final_text(client, sid) -> str:
    return " ".join(r["text"] for r in results(client, sid) if r["type"] == "final")


def test_audio_written_before_any_worker_runs_is_all_decoded(fresh_redis, fresh_redis_client,
                                                             artifacts):
    client = fresh_redis_client
    bus = busmod.Bus(client)
    write_session(bus, "early", read_pcm("weather"))
    worker = start_pool(fresh_redis.url, artifacts, "early")
    try:
        wait_for(lambda: ended(client, "early"), timeout=20)
        assert final_text(client, "early") == direct_decode(read_pcm("weather"))
        # the announcement is acknowledged and the lease released once the session ended
        wait_for(lambda: not client.exists(busmod.lease_key("early")))
        assert client.xpending(busmod.SESSIONS, busmod.WORKER_GROUP)["pending"] == 0
    finally:
        terminate(worker)


def test_capacity_limits_sessions_per_process(fresh_redis, fresh_redis_client, artifacts):
    client = fresh_redis_client
    bus = busmod.Bus(client)
    worker = start_pool(fresh_redis.url, artifacts, "capacity", capacity=1)
    try:
        write_session(bus, "a", read_pcm("coffee"), last=False)
        wait_for(lambda: client.exists(busmod.lease_key("a")))
        write_session(bus, "b", read_pcm("door"))
        time.sleep(1.0)
        assert not client.exists(busmod.lease_key("b")), "no second session at capacity 1"
        info = busmod.Bus(client).live_workers()[0]
        assert (info["load"], info["capacity"]) == (1, 1)
        client.delete(*busmod.session_keys("a"))  # the first session is stopped
        wait_for(lambda: ended(client, "b"), timeout=20)
        assert wer(fixture_texts()["door"], final_text(client, "b")) <= \
            wer(fixture_texts()["door"], direct_decode(read_pcm("door"))) + 0.01
    finally:
        terminate(worker)


def _two_utterance_audio() -> bytes:
    return read_pcm("weather") + b"\x00\x00" * 24000 + read_pcm("call")


def _reference_finals(client: redis.Redis, bus: busmod.Bus) -> list[dict]:
    pcm = _two_utterance_audio()
    write_session(bus, "ref", pcm)
    wait_for(lambda: ended(client, "ref"), timeout=30)
    return [r for r in results(client, "ref") if r["type"] == "final"]


def test_sigterm_hands_sessions_over_and_the_transcript_is_unchanged(fresh_redis,
                                                                     fresh_redis_client,
                                                                     artifacts):
    client = fresh_redis_client
    bus = busmod.Bus(client)
    first = start_pool(fresh_redis.url, artifacts, "handover-1")
    second = None
    try:
        reference = _reference_finals(client, bus)
        pcm = _two_utterance_audio()
        n = len(split_chunks(pcm, 16000))
        # the first utterance and part of the second are written, then the worker stops
        write_session(bus, "ho", pcm, upto=n - 5)
        wait_for(lambda: any(r["type"] == "final" for r in results(client, "ho")), timeout=20)
        time.sleep(0.5)
        assert terminate(first) == 0
        assert not client.exists(busmod.lease_key("ho")), "the lease was released"
        second = start_pool(fresh_redis.url, artifacts, "handover-2")
        write_session(bus, "ho", pcm, start=n - 5)
        wait_for(lambda: ended(client, "ho"), timeout=30)
        finals = [r for r in results(client, "ho") if r["type"] == "final"]
        assert _strip_seq(finals) == _strip_seq(reference)
    finally:
        terminate(first)
        if second:
            terminate(second)


def _strip_seq(rs):
    return [{k: v for k, v in r.items() if k != "seq"} for r in rs]


@pytest.mark.parametrize("pools", [1, 2])
def test_a_killed_worker_is_taken_over_without_duplicate_finals(fresh_redis, fresh_redis_client,
                                                                artifacts, pools):
    """kill -9 the process decoding a session mid-utterance: a restarted worker (one
    pool) or another worker (two pools) continues from the checkpoint."""
    client = fresh_redis_client
    bus = busmod.Bus(client)
    workers = [start_pool(fresh_redis.url, artifacts, f"takeover-{pools}-{i}")
               for i in range(pools)]
    try:
        reference = _reference_finals(client, bus)
        pcm = _two_utterance_audio()
        n = len(split_chunks(pcm, 16000))
        write_session(bus, "kt", pcm, upto=n - 5)
        wait_for(lambda: any(r["type"] == "final" for r in results(client, "kt")), timeout=20)
        owner = client.get(busmod.lease_key("kt")).decode()
        os.kill(int(owner.split("-")[-2]), signal.SIGKILL)
        write_session(bus, "kt", pcm, start=n - 5)
        wait_for(lambda: ended(client, "kt"), timeout=30)
        finals = [r for r in results(client, "kt") if r["type"] == "final"]
        assert _strip_seq(finals) == _strip_seq(reference)
        new_owner_took_it = client.xpending(busmod.SESSIONS, busmod.WORKER_GROUP)["pending"] == 0
        assert new_owner_took_it
    finally:
        for w in workers:
            terminate(w)


class ExplodingModel:
    """Test double (named as such): an engine whose stream fails on a chosen session's
    audio. A real engine cannot be made to fail on demand."""

    name = "exploding"

    def __init__(self, real):
        self.real = real
        self.explode = False

    def preload(self, n):
        pass

    def stream(self, sample_rate, checkpoint=None, mode=None):
        real = self.real.stream(sample_rate, checkpoint, mode=mode)
        model = self

        class Stream:
            checkpoint = property(lambda self: real.checkpoint)

            def feed(self, pcm, rate=None):
                if model.explode:
                    raise RuntimeError("engine bug")
                return real.feed(pcm, rate)

            def flush(self):
                return real.flush()

            def close(self):
                real.close()

        return Stream()


@pytest.mark.fast
def test_an_engine_failure_ends_only_its_session_with_an_internal_error(fresh_redis,
                                                                        fresh_redis_client):
    from cosyvoice.asr import load_model
    from cosyvoice.settings import Settings
    from cosyvoice.worker import Worker

    client = fresh_redis_client
    bus = busmod.Bus(client)
    model = ExplodingModel(load_model("pocketsphinx", Settings()))
    worker = Worker(Settings(redis_url=fresh_redis.url), model, client)
    worker.bus.ensure_group()
    model.explode = True
    write_session(bus, "bad", read_pcm("weather"))
    rounds_until(worker, lambda: "bad" not in worker.sessions
                 and client.exists(busmod.text_key("bad")), timeout=10)
    assert [r["code"] for r in results(client, "bad") if r["type"] == "error"] == ["internal"]
    assert not client.exists(busmod.lease_key("bad"))
    model.explode = False
    write_session(bus, "good", read_pcm("weather"))
    rounds_until(worker, lambda: ended(client, "good"), timeout=20)
    assert final_text(client, "good") == direct_decode(read_pcm("weather"), "pocketsphinx")
