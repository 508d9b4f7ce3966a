"""Latency through the running service with real PocketSphinx recognition.

Measures, against a fresh embedded Redis + gateway + worker pool on this machine:
  * `last` chunk ack -> its final result, over N utterances (one session at a time);
  * chunk sent -> the partial result that covers it (the partial whose `seq` is that
    chunk), with 1 and with 8 concurrent real-time sessions.

    python benchmarks/latency.py [--utterances 21] [--seconds 30] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.stack import (  # noqa: E402
    POCKETSPHINX,
    Stack,
    fixture_names,
    last_to_final,
    percentile,
    read_fixture,
)
from cosyvoice.client import StreamingClient, TranscribeError  # noqa: E402
from cosyvoice.store import bus as busmod


def hammer(url: str, stop: threading.Event, counts: dict) -> None:
    """Keeps asking for a session while the service is full, as impatient clients do."""
    while not stop.is_set():
        c = StreamingClient(url, reconnect=False)
        try:
            c.connect(overload_retries=0)
            counts["admitted"] += 1
            c.stop()
        except TranscribeError as err:
            counts[err.code] = counts.get(err.code, 0) + 1
        finally:
            c.close()
        stop.wait(0.05)


def partial_latency(url: str, sessions: int, seconds: float) -> tuple[list[float], int]:
    names = fixture_names()
    silence = b"\x00\x00" * 8000
    pcm = b"".join(read_fixture(n) + silence for n in names)
    lat: list[float] = []
    lock = threading.Lock()
    errors = []

    def one(k: int):
        c = StreamingClient(url)
        try:
            c.connect()
            # each session starts at a different place in the audio
            offset = (k * 6400 * 7) % len(pcm)
            audio = (pcm[offset:] + pcm[:offset]) * 4
            audio = audio[: int(seconds * 32000) // 6400 * 6400]
            c.stream_pcm(audio, 16000, pace="realtime")
            c.wait_end(30)
            with lock:
                errors.extend(c.result.errors)
                for t, e, d in c.result.events:
                    if e == "text" and d["type"] == "partial" and d["seq"] in c.sent_at:
                        lat.append((t - c.sent_at[d["seq"]]) * 1000)
            c.stop()
        finally:
            c.close()

    threads = [threading.Thread(target=one, args=(k,)) for k in range(sessions)]
    for t in threads:
        t.start()
        time.sleep(0.2 / sessions * 0.9)  # spread chunk phases across the 200 ms period
    for t in threads:
        t.join()
    return lat, len(errors)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--utterances", type=int, default=21)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--overload", type=int, default=8,
                    help="clients that keep asking for sessions while `capacity` run")
    args = ap.parse_args()
    report: dict[str, dict[str, object]] = {}
    with Stack(processes=args.workers, env=POCKETSPHINX) as stack:
        # warm-up
        last_to_final(stack.url, 1)
        lf = last_to_final(stack.url, args.utterances)
        report["last_to_final_ms"] = {"n": len(lf), "p50": percentile(lf, 50),
                                      "p95": percentile(lf, 95), "max": max(lf)}
        for n in (int(x) for x in args.concurrency.split(",")):
            lat, errs = partial_latency(stack.url, n, args.seconds)
            report[f"partial_ms_{n}_sessions"] = {
                "n": len(lat), "p50": percentile(lat, 50), "p99": percentile(lat, 99),
                "max": max(lat) if lat else None, "errors": errs}
        # Admission control: the service is full; more clients keep knocking.
        capacity = sum(w["capacity"] for w in busmod.Bus(stack.client).live_workers())
        if args.overload:
            stop, counts = threading.Event(), {"admitted": 0}
            knockers = [threading.Thread(target=hammer, args=(stack.url, stop, counts))
                        for _ in range(args.overload)]

            def start_knocking() -> None:
                time.sleep(2.0)  # the running sessions have been admitted by then
                for t in knockers:
                    t.start()

            threading.Thread(target=start_knocking).start()
            lat, errs = partial_latency(stack.url, capacity, args.seconds)
            stop.set()
            for t in knockers:
                t.join()
            report[f"partial_ms_{capacity}_sessions_plus_{args.overload}_knocking"] = {
                "n": len(lat), "p50": percentile(lat, 50), "p99": percentile(lat, 99),
                "max": max(lat) if lat else None, "errors": errs, "knocks": counts}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
