"""Proportional set size (PSS) of ASR worker processes: pre-forked pool vs independent.

Runs the same real-time load (4 sessions per worker process, real speech) twice:
  * shared: one `cosyvoice worker --processes 2` pool (model and decoders created
    before fork, pages shared copy-on-write);
  * independent: two `cosyvoice worker --processes 1` pools, i.e. two separately loaded
    copies of everything.
PSS (from /proc/PID/smaps_rollup) is read for every process of the pools while the
sessions are decoding. Parents are counted too: they hold the pages the children share.

    python benchmarks/memory.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.stack import POCKETSPHINX, Stack, fixture_names, read_fixture  # noqa: E402
from cosyvoice.client import StreamingClient  # noqa: E402


def pss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


def load_and_measure(stack: Stack, pools: list[subprocess.Popen], sessions: int) -> dict:
    pcm = b"".join(read_fixture(n) for n in fixture_names())
    samples: list[dict] = []
    done = threading.Event()

    def run(k):
        c = StreamingClient(stack.url)
        c.connect()
        c.stream_pcm(pcm, 16000, pace="realtime")
        c.wait_end(30)
        c.stop()
        c.close()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(sessions)]
    for t in threads:
        t.start()
    time.sleep(8)  # every session is mid-stream now
    for pool in pools:
        parent = psutil.Process(pool.pid)
        children = parent.children()
        samples.append({"parent_kb": pss_kb(parent.pid),
                        "children_kb": [pss_kb(c.pid) for c in children]})
    for t in threads:
        t.join()
    done.set()
    total = sum(s["parent_kb"] + sum(s["children_kb"]) for s in samples)
    return {"pools": samples, "total_kb": total}


def main() -> None:
    report = {}
    # 4 sessions per process, the capacity this comparison was first measured at.
    env = {**POCKETSPHINX, "COSYVOICE_WORKER_CAPACITY": "4"}
    with Stack(processes=2, env=env) as stack:
        report["shared"] = load_and_measure(stack, [stack.pool.proc], 8)
    with Stack(processes=1, env=env) as stack:
        second = stack.add_pool(1)
        report["independent"] = load_and_measure(stack, [stack.pool.proc, second.proc], 8)
    report["ratio"] = report["shared"]["total_kb"] / report["independent"]["total_kb"]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
