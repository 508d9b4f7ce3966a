"""Session ownership with real worker processes: leases, capacity, hand-over, take-over.

Each test writes a session's audio straight into Redis with the gateway's own Bus calls,
so the timing of what the worker sees is under the test's control.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import redis

from cosyvoice.asr import ENGINES
from cosyvoice.store import bus as busmod
from cosyvoice.store import keys
from cosyvoice.wire.audio import split_chunks

from .. import launcher
from ..helpers import (
    direct_decode,
    fixture_texts,
    hogs,
    read_pcm,
    reference_text,
    results,
    rounds_until,
    wer,
    write_session,
)
from ..launcher import terminate, wait_for

pytestmark = pytest.mark.system

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
        wait_for(lambda: not client.exists(keys.lease_key("early")))
        assert client.xpending(keys.SESSIONS, keys.WORKER_GROUP)["pending"] == 0
    finally:
        terminate(worker)


def test_capacity_limits_sessions_per_process(fresh_redis, fresh_redis_client, artifacts):
    client = fresh_redis_client
    bus = busmod.Bus(client)
    worker = start_pool(fresh_redis.url, artifacts, "capacity", capacity=1)
    try:
        write_session(bus, "a", read_pcm("coffee"), last=False)
        wait_for(lambda: client.exists(keys.lease_key("a")))
        write_session(bus, "b", read_pcm("door"))
        time.sleep(1.0)
        assert not client.exists(keys.lease_key("b")), "no second session at capacity 1"
        info = busmod.Bus(client).live_workers()[0]
        assert (info["load"], info["capacity"]) == (1, 1)
        client.delete(*keys.session_keys("a"))  # the first session is stopped
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
        assert not client.exists(keys.lease_key("ho")), "the lease was released"
        second = start_pool(fresh_redis.url, artifacts, "handover-2")
        write_session(bus, "ho", pcm, start=n - 5)
        wait_for(lambda: ended(client, "ho"), timeout=30)
        finals = [r for r in results(client, "ho") if r["type"] == "final"]
        assert _strip_seq(finals) == _strip_seq(reference)
    finally:
        terminate(first)
        if second:
            terminate(second)


def test_a_session_whose_client_is_gone_is_decoded_after_the_connected_ones(
        fresh_redis, fresh_redis_client, artifacts):
    """Two sessions' audio is stored when the worker starts; the client of one has left
    (its keys expire, as in a disconnect's grace period). The connected one is decoded
    first, to its end; the other only then, to the same transcript (it waits for a
    resume)."""
    client = fresh_redis_client
    bus = busmod.Bus(client)
    pcm = _two_utterance_audio()
    write_session(bus, "here", pcm)
    write_session(bus, "away", pcm)
    for key in (keys.session_key("away"), keys.audio_key("away")):
        client.pexpire(key, 600_000)
    worker = start_pool(fresh_redis.url, artifacts, "away")
    try:
        wait_for(lambda: ended(client, "here") and ended(client, "away"), timeout=60)
        here_end = [i for i, f in client.xrange(keys.text_key("here"))
                    if json.loads(f[b"r"])["type"] == "end"][0]
        away_first = client.xrange(keys.text_key("away"), count=1)[0][0]
        # stream ids begin with the Redis server's clock in ms
        assert int(away_first.split(b"-")[0]) >= int(here_end.split(b"-")[0])
        finals = {sid: [r for r in results(client, sid) if r["type"] == "final"]
                  for sid in ("here", "away")}
        assert finals["here"] and _strip_seq(finals["away"]) == _strip_seq(finals["here"])
    finally:
        terminate(worker)


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
        owner = client.get(keys.lease_key("kt")).decode()
        os.kill(int(owner.split("-")[-2]), signal.SIGKILL)
        write_session(bus, "kt", pcm, start=n - 5)
        wait_for(lambda: ended(client, "kt"), timeout=30)
        finals = [r for r in results(client, "kt") if r["type"] == "final"]
        assert _strip_seq(finals) == _strip_seq(reference)
        # the new owner acknowledges the announcement after it publishes the end
        # (worker._finish), so "end" may be read a moment before the acknowledgement
        wait_for(lambda: client.xpending(keys.SESSIONS, keys.WORKER_GROUP)["pending"] == 0,
                 timeout=10)
    finally:
        for w in workers:
            terminate(w)


def test_a_session_claimed_before_its_dead_owners_lease_lapsed_is_adopted_once_it_does(
        fresh_redis, fresh_redis_client, artifacts):
    """A dead worker's announcement can be idle a lease long while its lease still runs
    (it renewed the lease, then died before touching the announcement): the worker that
    claims it must keep trying the lease, not hold the announcement without decoding."""
    client = fresh_redis_client
    bus = busmod.Bus(client)
    pcm = read_pcm("weather")
    write_session(bus, "lg", pcm)
    bus.ensure_group()
    dead = "host-1-dead00"
    client.xreadgroup(keys.WORKER_GROUP, dead, {keys.SESSIONS: ">"}, count=1)
    lease_left_ms = 4 * LEASE_MS
    client.set(keys.lease_key("lg"), dead, px=lease_left_ms)
    taken_at = time.monotonic()
    time.sleep(1.2 * LEASE_MS / 1000)  # the announcement is an orphan now, the lease is not
    worker = start_pool(fresh_redis.url, artifacts, "lease-lag")
    try:
        wait_for(lambda: ended(client, "lg"), timeout=30)
        assert time.monotonic() - taken_at >= lease_left_ms / 1000, "not before the lease lapsed"
        assert final_text(client, "lg") == direct_decode(pcm)
        wait_for(lambda: client.xpending(keys.SESSIONS, keys.WORKER_GROUP)["pending"] == 0)
    finally:
        terminate(worker)


class ExplodingModel:
    """Test double (named as such): an engine whose stream fails on a chosen session's
    audio. A real engine cannot be made to fail on demand."""

    name = "exploding"

    def __init__(self, real):
        self.real = real
        self.explode = False

    def preload(self, n):
        pass

    def after_fork(self):
        pass

    def start_stage(self, process=True):
        return None

    def stream(self, sample_rate, checkpoint=None, mode=None, language=None, prompt="",
               turn=None):
        real = self.real.stream(sample_rate, checkpoint, mode=mode, language=language,
                                prompt=prompt, turn=turn)
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
    from cosyvoice.worker.loop import Worker

    client = fresh_redis_client
    bus = busmod.Bus(client)
    model = ExplodingModel(load_model("pocketsphinx", Settings()))
    worker = Worker(Settings(redis_url=fresh_redis.url), model, client)
    worker.bus.ensure_group()
    model.explode = True
    write_session(bus, "bad", read_pcm("weather"))
    rounds_until(worker, lambda: "bad" not in worker.sessions
                 and client.exists(keys.text_key("bad")), timeout=10)
    assert [r["code"] for r in results(client, "bad") if r["type"] == "error"] == ["internal"]
    assert not client.exists(keys.lease_key("bad"))
    model.explode = False
    write_session(bus, "good", read_pcm("weather"))
    rounds_until(worker, lambda: ended(client, "good"), timeout=20)
    assert final_text(client, "good") == direct_decode(read_pcm("weather"), "pocketsphinx")


@pytest.mark.fast
def test_a_session_deleted_while_a_worker_hands_it_over_stays_deleted(fresh_redis,
                                                                      fresh_redis_client):
    """A draining worker may still hold a session that was just stopped: handing it over
    must not bring its hash back (it came back holding only its announcement, and the
    next worker to place it crashed on it)."""
    from cosyvoice.asr import load_model
    from cosyvoice.settings import Settings
    from cosyvoice.worker.loop import Worker

    client = fresh_redis_client
    bus = busmod.Bus(client)
    bus.ensure_group()
    bus.create_session("gone", 16000)
    old = bus.announce("gone")
    bus.delete_session("gone")
    bus.reannounce("gone", old)
    assert not client.exists(keys.session_key("gone")) and bus.open_sessions() == 0
    # an announcement that outlives its session, and a stray hash from an older version
    bus.create_session("late", 16000)
    bus.delete_session("late")
    bus.announce("late")
    assert not client.exists(keys.session_key("late"))
    client.hset(keys.session_key("stray"), "announcement", bus.announce("stray"))
    worker = Worker(Settings(redis_url=fresh_redis.url),
                    load_model("pocketsphinx", Settings()), client)
    rounds_until(worker, lambda: bus.open_sessions() == 0, timeout=10)
    assert worker.sessions == {}
    write_session(bus, "good", read_pcm("weather"))
    rounds_until(worker, lambda: ended(client, "good"), timeout=20)


# ---- capacity (the engine's, calibrated, or following the decode scheduler) ------------


def test_worker_calibrate_measures_this_host_and_prints_the_setting():
    import re
    import subprocess
    import sys

    from ..helpers import ROOT
    proc = subprocess.run([sys.executable, "-m", "cosyvoice", "worker", "--calibrate",
                           "--engine", "whisper-live"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    match = re.fullmatch(r"COSYVOICE_WORKER_CAPACITY=(\d+)\n", proc.stdout)
    assert match and int(match.group(1)) >= 1, proc.stdout
    said = re.search(r"engine whisper-live: ([\d.]+) CPU-s", proc.stderr)
    assert said and 0 < float(said.group(1)) < 1, proc.stderr


def test_the_pool_admits_the_engines_capacity_unless_told(fresh_redis, fresh_redis_client,
                                                          artifacts):
    """Unless told a capacity, a worker starts with the engine's, in the share of the
    cores that other work leaves it as it starts (all of it on a quiet host; the next
    test takes cores away on purpose); told one, it keeps it whatever the host."""
    import re

    from cosyvoice.asr.admission import start_capacity
    from cosyvoice.store import bus as busmod

    from .. import launcher
    engine = ENGINES["whisper-live"].capacity
    for capacity in (None, 3):
        name = f"capacity-{capacity}"
        pool = launcher.start_worker_pool(fresh_redis.url, capacity=capacity, logs=artifacts,
                                          name=name)
        try:
            # the pool is live, so its ready line is written (a log kept from a run before
            # has more: this pool's is the last)
            ready = re.findall(
                r"capacity (\d+)(?:; ([\d.]+) of (\d+) cores busy with other work)?\)",
                (artifacts / f"{name}.log").read_text())[-1]
            started = int(ready[0])
            if capacity is None:
                others = float(ready[1]) if ready[1] else None
                cores = int(ready[2]) if ready[2] else 1
                assert started == start_capacity(engine, cores, others) <= engine
            else:
                assert started == capacity
            infos = busmod.Bus(fresh_redis_client).live_workers()
            assert [i["capacity"] for i in infos] == [started]
        finally:
            launcher.stop(pool.proc)
            fresh_redis_client.flushall()


def test_a_pool_started_beside_busy_cores_starts_with_the_share_they_leave(
        fresh_redis, fresh_redis_client, artifacts):
    """All the pool's cores but one are taken by CPU-bound processes while it starts: it
    measures them (cosyvoice/worker/hostload.py) and its worker starts with that share of the
    engine's capacity instead of the quiet host's (cosyvoice/asr/admission.py)."""
    import re

    from cosyvoice.asr.admission import start_capacity
    from cosyvoice.store import bus as busmod
    from cosyvoice.worker import hostload

    from .. import launcher
    cores = len(hostload.cores())
    taken = max(1, cores - 1)
    with hogs(taken):
        time.sleep(0.5)
        pool = launcher.start_worker_pool(fresh_redis.url, logs=artifacts, name="busy-host")
        try:
            ready = wait_for(lambda: re.search(
                r"capacity (\d+); ([\d.]+) of (\d+) cores busy with other work",
                (artifacts / "busy-host.log").read_text()))
            capacity, others = int(ready.group(1)), float(ready.group(2))
            assert int(ready.group(3)) == cores
            assert others >= 0.8 * taken, "the hogs were seen"
            engine = ENGINES["whisper-live"].capacity
            assert capacity == start_capacity(engine, cores, others) < engine
            assert [w["capacity"] for w in busmod.Bus(fresh_redis_client).live_workers()] \
                == [capacity]
        finally:
            launcher.stop(pool.proc)


def test_a_worker_admits_what_its_decode_scheduler_measures(fresh_redis, fresh_redis_client,
                                                            artifacts):
    """whisper-live without a fixed capacity: the capacity the worker advertises follows
    its scheduler (cosyvoice/asr/admission.py). Told to keep its scheduler busy at most 1 %
    of the time, a worker decoding one real-time session measures that one already costs
    more and drops to a capacity of 1: the next session is refused as overloaded, and the
    first goes on to its transcript."""
    import threading
    import time

    from cosyvoice.client import Refused, StreamingClient
    from cosyvoice.store import bus as busmod

    from .. import launcher
    svc = launcher.start_service(fresh_redis.url, processes=1, logs=artifacts,
                                 name="admission-follows", env={
                                     "COSYVOICE_DECODE_BUSY_TARGET": "0.01",
                                     "COSYVOICE_MAX_SESSIONS_PER_CLIENT": "0"})
    bus = busmod.Bus(fresh_redis_client)
    first = StreamingClient(svc.url)
    try:
        assert [w["capacity"] for w in bus.live_workers()] == [ENGINES["whisper-live"].capacity]
        first.connect()
        streaming = threading.Thread(target=first.stream_pcm, args=(read_pcm("harvard_long"),
                                                                    16000),
                                     kwargs={"pace": "realtime"})
        streaming.start()
        deadline = time.monotonic() + 40
        while [w["capacity"] for w in bus.live_workers()] != [1]:
            assert time.monotonic() < deadline, bus.live_workers()
            time.sleep(0.2)
        second = StreamingClient(svc.url)
        try:
            with pytest.raises(Refused) as refused:
                second.connect(overload_retries=0)
            assert refused.value.code == "overloaded"
        finally:
            second.close()
        streaming.join(120)
        first.wait_end(60)
        assert wer(reference_text("harvard_long"), first.result.text) < 0.15
    finally:
        first.close()
        svc.stop()
