"""ASR capacity: how many concurrent real-time PocketSphinx sessions this machine serves.

Two measurements in one run:

* **Engine cost.** The PocketSphinx engine alone, in this process, decodes the speech
  fixtures (each followed by 0.5 s of silence) chunk by chunk: CPU seconds per second of
  audio (the real-time factor), and the time of each 200 ms chunk's ``feed``. The
  engine's own limit is ``cores / RTF`` real-time sessions, with nothing else running.
* **Service capacity.** For each per-process capacity C in ``--capacities``, a fresh
  stack (embedded Redis, gateway, ``--workers`` worker processes with
  ``COSYVOICE_WORKER_CAPACITY=C``) serves ``workers × C`` clients at once. Each client
  runs real-time sessions back to back (one to three fixture utterances, ``last``,
  ``end``, ``stop``) for ``--seconds``. Measured: chunk → partial (the partial whose
  ``seq`` is that chunk, from when the chunk was sent), ``last`` → final (from when the
  ``last`` chunk was sent to the final result that covers it, or ``end`` when the
  transcript was already final), error events, and CPU per process group.

A level meets the target when partial P99 < 500 ms, ``last`` → final P95 < 250 ms and no
error came; the capacity is the largest such level.

    python benchmarks/capacity.py [--capacities 3,4,5,6,7] [--workers 2] [--seconds 60]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.stack import POCKETSPHINX, Stack, fixture_names, percentile, read_fixture  # noqa: E402
from benchmarks.transport import CpuMeter, machine  # noqa: E402
from cosyvoice.client import StreamingClient  # noqa: E402
from cosyvoice.wire.audio import split_chunks  # noqa: E402

PARTIAL_P99_TARGET_MS = 500.0
FINAL_P95_TARGET_MS = 250.0
GAP = b"\x00\x00" * 8000  # 0.5 s of silence


def engine_cost(passes: int = 3) -> dict:
    """Real-time factor and per-chunk decode time of the PocketSphinx engine alone."""
    from cosyvoice.asr import load_model
    from cosyvoice.settings import Settings

    model = load_model("pocketsphinx", Settings())
    pcm = b"".join(read_fixture(n) + GAP for n in fixture_names())
    chunks = split_chunks(pcm, 16000)
    feed_ms: list[float] = []
    cpu = 0.0
    for _ in range(passes):
        stream = model.stream(16000)
        c0 = time.process_time()
        for chunk in chunks:
            t0 = time.perf_counter()
            stream.feed(chunk)
            feed_ms.append((time.perf_counter() - t0) * 1000)
        stream.flush()
        cpu += time.process_time() - c0
        stream.close()
    rtf = cpu / (passes * len(pcm) / 32000)
    cores = os.cpu_count() or 1
    return {"rtf": round(rtf, 4), "chunk_feed_ms": _dist(feed_ms, (50, 99)),
            "sessions_per_core": round(1 / rtf, 2),
            "engine_limit_sessions": int(cores / rtf), "cores": cores}


def _dist(values: list[float], qs=(50, 95, 99)) -> dict:
    if not values:
        return {"n": 0}
    out: dict[str, float] = {"n": len(values)}
    out.update({f"p{q}": round(percentile(values, q), 1) for q in qs})
    out["max"] = round(max(values), 1)
    return out


class Client(threading.Thread):
    """One microphone: real-time sessions back to back until the deadline."""

    def __init__(self, url: str, deadline: float, seed: int, tail: bytes = GAP):
        super().__init__(daemon=True)
        self.tail = tail  # what follows a session's last utterance
        self.url = url
        self.deadline = deadline
        self.rng = random.Random(seed)
        self.utterances = [read_fixture(n) for n in fixture_names()]
        self.partial_ms: list[float] = []
        self.final_ms: list[float] = []
        self.errors: list[Mapping[str, Any]] = []
        self.sessions = 0

    def run(self) -> None:
        while time.monotonic() < self.deadline:
            picks = self.rng.sample(self.utterances, self.rng.randint(1, 3))
            self._session(GAP.join(picks) + self.tail)

    def _session(self, pcm: bytes) -> None:
        c = StreamingClient(self.url)
        try:
            c.connect()
            c.stream_pcm(pcm, 16000, pace="realtime")
            c.wait_end(30)
            self._collect(c, len(split_chunks(pcm, 16000)) - 1)
            c.stop()
        except Exception as exc:  # noqa: BLE001 - counted, the run goes on
            self.errors.append({"code": "client", "msg": str(exc)})
        finally:
            c.close()

    def _collect(self, c: StreamingClient, last_seq: int) -> None:
        self.sessions += 1
        self.errors.extend(c.result.errors)
        final_at = None
        for t, event, data in c.result.events:
            if event == "text" and data["type"] == "partial" and data["seq"] in c.sent_at:
                self.partial_ms.append((t - c.sent_at[data["seq"]]) * 1000)
            elif final_at is None and (
                    (event == "text" and data["type"] == "final" and data["seq"] == last_seq)
                    or event == "end"):
                final_at = t
        if final_at is not None and last_seq in c.sent_at:
            self.final_ms.append((final_at - c.sent_at[last_seq]) * 1000)
        else:
            self.errors.append({"code": "no_final", "msg": "no final after last"})


def run_level(capacity: int, workers: int, seconds: float) -> dict:
    sessions = capacity * workers
    env = {**POCKETSPHINX, "COSYVOICE_WORKER_CAPACITY": str(capacity),
           "COSYVOICE_MAX_SESSIONS_PER_CLIENT": "0"}
    with Stack(processes=workers, env=env) as stack:
        meter = CpuMeter({"gateway": stack.gateway.proc.pid, "workers": stack.pool.proc.pid,
                          "redis": stack.redis_pid})
        before = meter.sample()
        deadline = time.monotonic() + seconds
        clients = [Client(stack.url, deadline, seed=k) for k in range(sessions)]
        for client in clients:
            client.start()
            time.sleep(0.2 / sessions)  # spread the chunk phases over the 200 ms period
        for client in clients:
            client.join(seconds + 90)
        after = meter.sample()
    wall = after["wall"] - before["wall"]
    partial = [x for c in clients for x in c.partial_ms]
    final = [x for c in clients for x in c.final_ms]
    errors = [e for c in clients for e in c.errors]
    result: dict[str, Any] = {
        "capacity_per_process": capacity, "workers": workers, "sessions": sessions,
        "completed_sessions": sum(c.sessions for c in clients),
        "partial_ms": _dist(partial), "last_to_final_ms": _dist(final),
        "errors": sorted({e.get("code", "?") for e in errors}), "error_count": len(errors),
        "cpu_cores": {k: round((after[k] - before[k]) / wall, 2) for k in after if k != "wall"},
    }
    result["meets"] = (bool(partial) and bool(final) and not errors
                       and result["partial_ms"]["p99"] < PARTIAL_P99_TARGET_MS
                       and result["last_to_final_ms"]["p95"] < FINAL_P95_TARGET_MS)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--capacities", default="3,4,5,6,7",
                    help="sessions per worker process to try, in increasing order")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    engine = engine_cost()
    levels: list[dict[str, Any]] = []
    report: dict[str, Any] = {"machine": machine(), "args": vars(args), "engine": engine,
                              "levels": levels}
    print(json.dumps(engine), file=sys.stderr, flush=True)
    for capacity in (int(x) for x in args.capacities.split(",")):
        level = run_level(capacity, args.workers, args.seconds)
        levels.append(level)
        print(json.dumps(level), file=sys.stderr, flush=True)
    met = [lv["sessions"] for lv in levels if lv["meets"]]
    report["capacity_sessions"] = max(met) if met else 0
    print("| sessions (per process) | partial P50 / P99 ms | last → final P50 / P95 ms "
          "| errors | worker cores | meets |")
    print("|---|---|---|---|---|---|")
    for lv in levels:
        p, f = lv["partial_ms"], lv["last_to_final_ms"]
        print(f"| {lv['sessions']} ({lv['capacity_per_process']}) "
              f"| {p.get('p50')} / {p.get('p99')} "
              f"| {f.get('p50')} / {f.get('p95')} | {lv['error_count']} "
              f"| {lv['cpu_cores']['workers']} | {'yes' if lv['meets'] else 'no'} |")
    e = engine
    print(f"\nengine alone: RTF {e['rtf']}, {e['sessions_per_core']} real-time sessions per core, "
          f"limit {e['engine_limit_sessions']} on {e['cores']} cores; chunk feed "
          f"P50 {e['chunk_feed_ms']['p50']} ms, P99 {e['chunk_feed_ms']['p99']} ms")
    print(f"largest level meeting the targets: {report['capacity_sessions']} sessions")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
