"""Soak: sessions created and finished continuously; does anything grow?

Keeps N real-time sessions of real speech going for the given time (each session streams
one fixture, then alternately stops or just disconnects, and a new one starts), and
samples the RSS of the gateway (its gunicorn worker processes) and of every ASR worker
process, Redis's key count and its dataset memory every 30 s.

    python benchmarks/soak.py --minutes 10 --sessions 6
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--sessions", type=int, default=6)
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
