"""Soak: does anything grow, over many sessions or over one long one?

``churn`` keeps N real-time sessions of real speech going for the given time (each
session streams one fixture, then alternately stops or just disconnects, and a new one
starts), and samples the RSS of the gateway (its gunicorn worker processes) and of every
ASR worker process, Redis's key count and its dataset memory every 30 s (PocketSphinx).

``long`` is one session of ``--minutes`` of speech on the default engine (whisper-live):
the sentence fixtures in a shuffled cycle with pauses of 0.4-2.5 s (one in ten 6 s), sent
in 200 ms chunks at ``--speed`` times real time (the gateway's rate limit raised to
match). Per audio minute: the worker process's RSS, the finals' lag (from sending the
chunk a final ends in to receiving it) and the text; at the end the word error rate, the
most times any phrase of 2-8 words repeats back to back (in the transcript and in the
reference), RSS growth after the first 5 minutes and the last 10 minutes' median lag
against the first 10's.

    python benchmarks/soak.py churn --minutes 10 --sessions 6
    python benchmarks/soak.py long --minutes 60 --speed 4 [--json-out F]

An hour at 4x takes about 15 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.stack import POCKETSPHINX, Stack, fixture_names, read_fixture  # noqa: E402
from cosyvoice.client import StreamingClient, TranscribeError  # noqa: E402
from tests.soak import longest_repeat, looped_speech, rss_mb, stream_long  # noqa: E402


def serving_rss_mb(pid: int) -> float:
    """RSS of the processes that serve connections: gunicorn's workers (its children),
    or the process itself when it has none (``cosyvoice gateway``)."""
    children = psutil.Process(pid).children()
    return sum(rss_mb(p.pid) for p in children) if children else rss_mb(pid)


def sample(stack: Stack) -> dict:
    workers = psutil.Process(stack.pool.proc.pid).children()
    info = stack.client.info("memory")
    return {"t": round(time.monotonic(), 1),
            "gateway_rss_mb": round(serving_rss_mb(stack.gateway.proc.pid), 1),
            "worker_rss_mb": [round(rss_mb(w.pid), 1) for w in workers],
            "redis_keys": stack.client.dbsize(),
            "redis_dataset_kb": round(int(info["used_memory_dataset"]) / 1024, 1)}


def churn(args: argparse.Namespace) -> None:
    names = fixture_names()
    stop_at = time.monotonic() + args.minutes * 60
    counts = {"finished": 0, "errors": 0}
    lock = threading.Lock()

    with Stack(processes=2, env={**POCKETSPHINX, "COSYVOICE_SESSION_GRACE_S": "5"}) as stack:
        def loop(k: int) -> None:
            i = k
            while time.monotonic() < stop_at:
                c = StreamingClient(stack.url, reconnect=False)
                try:
                    c.connect(overload_retries=50)
                    c.stream_pcm(read_fixture(names[i % len(names)]), 16000)
                    ok = c.wait_end(30)
                    if i % 2:
                        c.stop()
                    with lock:
                        counts["finished" if ok else "errors"] += 1
                except TranscribeError:
                    with lock:
                        counts["errors"] += 1
                finally:
                    c.close()
                i += 1

        samples = [sample(stack)]
        threads = [threading.Thread(target=loop, args=(k,)) for k in range(args.sessions)]
        for t in threads:
            t.start()
        while time.monotonic() < stop_at:
            time.sleep(min(30, max(0.0, stop_at - time.monotonic())))
            samples.append(sample(stack))
        for t in threads:
            t.join()
        time.sleep(7)  # the last disconnected sessions' grace period
        samples.append(sample(stack))
    print(json.dumps({"sessions": counts, "first": samples[0], "after_warmup": samples[1],
                      "last_loaded": samples[-2], "idle_end": samples[-1],
                      "samples": samples}, indent=1))


# ---- one long session --------------------------------------------------------------------


def long_session(args: argparse.Namespace) -> dict:
    from benchmarks.stack import percentile
    from tests.helpers import corpus_wer

    audio, reference = looped_speech(args.minutes, args.seed)
    env = {"COSYVOICE_RATE_LIMIT_FACTOR": str(args.speed * 1.5),
           "COSYVOICE_MAX_SESSION_S": str(args.minutes * 60 / args.speed + 3600)}
    with Stack(processes=1, env=env) as stack:
        worker = psutil.Process(stack.pool.proc.pid).children()[0]
        run = stream_long(stack.url, worker.pid, audio, args.speed)
    finals, text, rss = run.finals, run.text, run.rss_mb
    per_minute: dict[int, list[float]] = {}
    for f in finals:
        if f["lag_s"] is not None:
            per_minute.setdefault(int(f["end"] // 60), []).append(f["lag_s"])
    minutes = sorted(per_minute)
    first = [x for m in minutes[:10] for x in per_minute[m]]
    last = [x for m in minutes[-10:] for x in per_minute[m]]
    return {
        "minutes": args.minutes, "speed": args.speed, "ended": run.ended, "finals": len(finals),
        "wer": round(corpus_wer([reference], [text]), 4),
        "longest_repeat": longest_repeat(text),
        "longest_repeat_reference": longest_repeat(reference),
        "rss_mb": [(round(t, 1), round(mb, 1)) for t, mb in rss],
        "rss_growth_after_5_min_mb": round(run.rss_growth_mb(5), 1),
        "lag_first_10_min": {"p50": round(percentile(first, 50), 3),
                             "p95": round(percentile(first, 95), 3)} if first else None,
        "lag_last_10_min": {"p50": round(percentile(last, 50), 3),
                            "p95": round(percentile(last, 95), 3)} if last else None,
        "lag_p50_by_minute": {m: round(percentile(per_minute[m], 50), 3) for m in minutes},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="kind", required=True)
    c = sub.add_parser("churn", help="many short sessions (PocketSphinx)")
    c.add_argument("--minutes", type=float, default=10.0)
    c.add_argument("--sessions", type=int, default=6)
    lg = sub.add_parser("long", help="one long session (the default engine)")
    lg.add_argument("--minutes", type=float, default=60.0)
    lg.add_argument("--speed", type=float, default=4.0)
    lg.add_argument("--seed", type=int, default=2026)
    lg.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.kind == "churn":
        churn(args)
        return
    out = long_session(args)
    print(json.dumps(out, indent=1))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
