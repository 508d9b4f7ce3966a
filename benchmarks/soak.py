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
from collections.abc import Mapping
from typing import Any

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.stack import POCKETSPHINX, Stack, fixture_names, read_fixture  # noqa: E402
from cosyvoice.client import StreamingClient, TranscribeError  # noqa: E402


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


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


def looped_speech(minutes: float, seed: int = 2026) -> tuple[bytes, str]:
    """``minutes`` of the sentence fixtures in shuffled cycles with pauses (16 kHz PCM),
    and the reference text. A cycle never starts with the sentence the last one ended on,
    so the reference repeats no sentence back to back."""
    import random

    from tests.helpers import fixture_texts

    texts = fixture_texts()
    names = [n for n in fixture_names() if n in texts]
    rng = random.Random(seed)
    parts: list[bytes] = []
    said: list[str] = []
    size, goal = 0, int(minutes * 60 * 16000 * 2)
    last = None
    while size < goal:
        cycle = names[:]
        rng.shuffle(cycle)
        if cycle[0] == last:
            cycle.append(cycle.pop(0))
        for name in cycle:
            pause = 6.0 if rng.random() < 0.1 else rng.uniform(0.4, 2.5)
            pcm = read_fixture(name) + b"\0\0" * int(pause * 16000)
            parts.append(pcm)
            said.append(texts[name])
            size += len(pcm)
            last = name
            if size >= goal:
                break
    return b"".join(parts), " ".join(said)


def longest_repeat(text: str) -> int:
    """The most times a phrase of 2-8 words follows itself directly in ``text``."""
    words = text.lower().split()
    best = 1
    for n in range(2, 9):
        for i in range(len(words) - n):
            k = 1
            while words[i + k * n:i + (k + 1) * n] == words[i:i + n]:
                k += 1
            best = max(best, k)
    return best


def long_session(args: argparse.Namespace) -> dict:
    from benchmarks.stack import percentile
    from tests.helpers import corpus_wer

    audio, reference = looped_speech(args.minutes, args.seed)
    chunk = 16000 * 2 // 5  # 200 ms
    chunks = [audio[i:i + chunk] for i in range(0, len(audio), chunk)]
    sent_at: dict[int, float] = {}
    finals: list[dict] = []
    env = {"COSYVOICE_RATE_LIMIT_FACTOR": str(args.speed * 1.5),
           "COSYVOICE_MAX_SESSION_S": str(args.minutes * 60 / args.speed + 3600)}
    with Stack(processes=1, env=env) as stack:
        worker = psutil.Process(stack.pool.proc.pid).children()[0]

        def on_event(event: str, data: Mapping[str, Any]) -> None:
            if event == "text" and data.get("type") == "final":
                seq = int(data.get("seq", -1))
                lag = time.monotonic() - sent_at[seq] if seq in sent_at else None
                finals.append({**data, "lag_s": lag, "rss_mb": rss_mb(worker.pid)})

        client = StreamingClient(stack.url, on_event=on_event)
        client.connect()
        rss = [(0.0, rss_mb(worker.pid))]
        start = time.monotonic()
        for seq, pcm in enumerate(chunks):
            due = start + seq * 0.2 / args.speed
            time.sleep(max(0.0, due - time.monotonic()))
            sent_at[seq] = time.monotonic()
            client.send(pcm, seq, last=seq == len(chunks) - 1, sample_rate=16000 if seq == 0 else 0)
            if seq % int(60 / 0.2) == 0:  # each audio minute
                rss.append((seq * 0.2 / 60, rss_mb(worker.pid)))
        ended = client.wait_end(300)
        rss.append((len(chunks) * 0.2 / 60, rss_mb(worker.pid)))
        client.stop()
        client.close()
    text = " ".join(f["text"].strip() for f in finals if f["text"].strip())
    per_minute: dict[int, list[float]] = {}
    for f in finals:
        if f["lag_s"] is not None:
            per_minute.setdefault(int(f["end"] // 60), []).append(f["lag_s"])
    minutes = sorted(per_minute)
    first = [x for m in minutes[:10] for x in per_minute[m]]
    last = [x for m in minutes[-10:] for x in per_minute[m]]
    after_warmup = [mb for t, mb in rss if t >= 5]
    return {
        "minutes": args.minutes, "speed": args.speed, "ended": ended, "finals": len(finals),
        "wer": round(corpus_wer([reference], [text]), 4),
        "longest_repeat": longest_repeat(text),
        "longest_repeat_reference": longest_repeat(reference),
        "rss_mb": [(round(t, 1), round(mb, 1)) for t, mb in rss],
        "rss_growth_after_5_min_mb": round(max(after_warmup) - after_warmup[0], 1)
        if after_warmup else None,
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
