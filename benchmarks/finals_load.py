"""Concurrent real-time 2-pass sessions: how many keep their partials and finals on time.

For each level of N sessions, a fresh stack (embedded Redis, gateway, ``--workers`` worker
processes, engine ``2pass``, each process holding ceil(N / workers) sessions) serves N
sessions at once, each streaming in real time for ``--seconds``: the single-sentence
fixtures one after another (each session starting at a different one), 0.6 s of silence
between them, so every sentence is an utterance with its Whisper final (the last one's comes
from the ``last`` chunk). Measured, per level:

* partial latency: a chunk sent -> the partial whose ``seq`` is that chunk (P50/P99);
* final latency: the chunk that closed the utterance sent -> its final (P50/P95), and of
  those, ``last`` -> its final (the session's end);
* the finals' word error rate against the fixtures' texts (Whisper's English normaliser);
* the CPU per second of audio streamed (so: cores per real-time session) of the worker
  processes' loops (PocketSphinx, Redis) and of their finals processes (Whisper).

The targets (issue: 2-pass for many sessions): partial P99 < 500 ms, final P95 < 800 ms.

    python benchmarks/finals_load.py [--levels 1,2,4,6,8] [--seconds 30] [--workers 2]
        [--backend torch] [--env KEY=VALUE ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.finals import corpus_wer, texts  # noqa: E402
from benchmarks.report import markdown, pair, save_json  # noqa: E402
from benchmarks.stack import Stack, fixture_names, percentile, read_fixture  # noqa: E402
from benchmarks.transport import machine  # noqa: E402
from cosyvoice.client import StreamingClient  # noqa: E402

RATE = 16000
SILENCE = b"\x00\x00" * int(0.6 * RATE)


def programme(k: int, seconds: float) -> tuple[bytes, str]:
    """Session ``k``'s audio (whole sentences, starting at the k-th) and its text."""
    names, refs = fixture_names(), texts()
    pcm, said, i = b"", [], k
    while len(pcm) < seconds * 2 * RATE:
        name = names[i % len(names)]
        pcm += read_fixture(name) + SILENCE
        said.append(refs[name])
        i += 1
    # the stream ends with its last sentence: that final comes from ``last``
    return pcm[:-len(SILENCE)], " ".join(said)


def one(url: str, k: int, seconds: float, out: list, lock: threading.Lock) -> None:
    pcm, ref = programme(k, seconds)
    c = StreamingClient(url, mode="2pass")
    try:
        c.connect()
        c.stream_pcm(pcm, RATE, pace="realtime")
        ended = c.wait_end(120)
        last_seq = max(c.sent_at)
        partial: list[float] = []
        final: list[float] = []
        last: list[float] = []
        for t, e, d in c.result.events:
            if e != "text" or d.get("seq") not in c.sent_at:
                continue
            ms = (t - c.sent_at[d["seq"]]) * 1000
            (partial if d["type"] == "partial" else final).append(ms)
            if d["type"] == "final" and d["seq"] == last_seq:
                last.append(ms)
        c.stop()
        with lock:
            out.append({"ref": ref, "hyp": c.result.text, "ended": ended, "partial": partial,
                        "final": final, "last": last, "errors": len(c.result.errors)})
    finally:
        c.close()


def pct(values: list[float], q: float) -> int | None:
    return round(percentile(values, q)) if values else None


def workers_cpu_s(stack: Stack) -> dict[str, float]:
    """CPU seconds of the worker processes (loop: PocketSphinx, Redis) and of their finals
    processes (Whisper)."""
    out = {"loop": 0.0, "finals": 0.0}
    for worker in psutil.Process(stack.pool.proc.pid).children():
        out["loop"] += sum(worker.cpu_times()[:2])
        out["finals"] += sum(sum(p.cpu_times()[:2]) for p in worker.children())
    return out


def run_level(n: int, args) -> dict:
    env = {"COSYVOICE_ENGINE": "2pass", "COSYVOICE_WHISPER_BACKEND": args.backend,
           "COSYVOICE_TWOPASS_PARTIALS": "pocketsphinx",  # the figures' partials
           "COSYVOICE_MAX_SESSIONS_PER_CLIENT": "0",
           "COSYVOICE_WORKER_CAPACITY": str(math.ceil(n / args.workers)),
           **dict(kv.split("=", 1) for kv in args.env)}
    with Stack(processes=args.workers, env=env) as stack:
        cpu0, t0 = workers_cpu_s(stack), time.monotonic()
        out: list[dict] = []
        lock = threading.Lock()
        threads = [threading.Thread(target=one, args=(stack.url, k, args.seconds, out, lock))
                   for k in range(n)]
        for t in threads:
            t.start()
            time.sleep(0.2 / n)  # spread chunk phases across the 200 ms period
        for t in threads:
            t.join()
        cpu1 = workers_cpu_s(stack)
        cpu = {k: cpu1[k] - cpu0[k] for k in cpu1}
        wall = time.monotonic() - t0
    partial = [x for r in out for x in r["partial"]]
    final = [x for r in out for x in r["final"]]
    last = [x for r in out for x in r["last"]]
    audio_s = sum(len(programme(k, args.seconds)[0]) / 2 / RATE for k in range(n))
    return {
        "sessions": n, "ended": sum(r["ended"] for r in out),
        "errors": sum(r["errors"] for r in out),
        "partial_ms": {"p50": pct(partial, 50),
                       "p99": pct(partial, 99), "n": len(partial)},
        "final_ms": {"p50": pct(final, 50), "p95": pct(final, 95),
                     "max": round(max(final)) if final else None, "n": len(final)},
        "last_to_final_ms": {"p50": pct(last, 50),
                             "p95": pct(last, 95), "n": len(last)},
        "wer": round(corpus_wer([r["ref"] for r in out], [r["hyp"] for r in out]), 4),
        "loop_cpu_per_audio_s": round(cpu["loop"] / audio_s, 3),
        "finals_cpu_per_audio_s": round(cpu["finals"] / audio_s, 3), "wall_s": round(wall, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="1,2,4,6,8")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the stack")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    rows = []
    for n in (int(x) for x in args.levels.split(",")):
        rows.append(run_level(n, args))
        print(json.dumps(rows[-1]), flush=True)
    print()
    print(markdown(
        ["sessions", "partial P50 / P99", "final P50 / P95", "last → final P50 / P95", "WER",
         "core per session: loop + finals"],
        ([r["sessions"], pair(r["partial_ms"], "p50", "p99") + " ms",
          pair(r["final_ms"]) + " ms", pair(r["last_to_final_ms"]) + " ms", f"{r['wer']:.1%}",
          f"{r['loop_cpu_per_audio_s']} + {r['finals_cpu_per_audio_s']}"] for r in rows)))
    if args.json:
        save_json(args.json, {"machine": machine(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
