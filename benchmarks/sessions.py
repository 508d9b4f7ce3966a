"""Sessions on two cores: partials that yield under load against a fixed partial cadence,
in one run.

Each level is a fresh stack (embedded Redis, gunicorn gateway, ``--workers`` whisper-live
worker processes, admission following the schedulers) offered ``N`` real-time sessions of
continuous speech: the longest recordings there are (``harvard_long``, 21 s, and
``long_unbroken``, 26 s, one after the other, every other client in the other order), the
clients' starts staggered over ``STAGGER_S``. A refused client waits the
``retry_after_ms`` it is told (at most 2 s) and asks again until the level's deadline.
Scenarios:

- ``before``: the code of another checkout (``--baseline``: the release before partials
  yielded) with its defaults;
- ``fixed``: partials at the base cadence whatever the load
  (``COSYVOICE_LIVE_PARTIAL_FLOOR_S`` = ``COSYVOICE_LIVE_PARTIAL_INTERVAL_S``: what the
  service did before partials yielded; its admission then counts the partials at that
  cadence, as before);
- ``yield``: the defaults: partials spaced out under load, down to the floor; admission
  counts the partials at the floor (``yield=S``: a floor of S seconds);

each ``+all`` with a fixed capacity that admits every session (the cadence's effect alone,
at the same load) and ``+hog`` with ``--hog`` CPU-bound processes beside the service (a
core taken).

Per level and scenario: sessions that ran and refusals; final latency P50/P95 (the chunk
that ends a final's audio sent, to the final); partial interval P50/P95 (seconds between
two partials of one utterance) and the latency of live text (each chunk sent, to the first
result that covers it); WER over the sessions that ran (Whisper's normaliser); the
service's CPU (gateway, workers and Redis, in cores); ``load`` events.

    git worktree add /tmp/before de14d30
    python benchmarks/sessions.py --baseline /tmp/before [--levels 12,16,20]
        [--scenarios before,yield] [--workers 2] [--hog 1] [--json-out F]

Each level and scenario takes about 85 s on a 2-core machine: the defaults about 9
minutes, ``--levels 24,28`` about 6, the core taken (``--levels 24 --scenarios
before+hog,yield+hog``) about 3; every run stays under 15 minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.admission import connect_or_wait, waits_p95  # noqa: E402
from benchmarks.engines import CHUNK_S, _dist  # noqa: E402
from benchmarks.report import markdown, pair, save_json  # noqa: E402
from benchmarks.stack import ROOT, Stack, read_fixture  # noqa: E402
from benchmarks.transport import machine  # noqa: E402
from cosyvoice.client import StreamingClient  # noqa: E402
from cosyvoice.store import bus as busmod
from tests.helpers import FIXTURES, corpus_wer, hogs  # noqa: E402

RECORDINGS = ("harvard_long", "long_unbroken")
PAUSE = b"\0\0" * 16000  # 1 s between the recordings
STAGGER_S = 6.0  # the clients' starts spread over this long
FINAL_P95_TARGET_MS = 800
PARTIAL_INTERVAL_TARGET_S = 2.0


def recording(name: str) -> tuple[bytes, str]:
    text = (FIXTURES / f"{name}.txt").read_text().split("\t", 1)[1].strip()
    return read_fixture(name), text


class LongClient(threading.Thread):
    """One microphone: one session of the recordings in real time, once admitted."""

    def __init__(self, url: str, k: int, start_at: float, deadline: float):
        super().__init__(daemon=True)
        self.url, self.start_at, self.deadline = url, start_at, deadline
        order = RECORDINGS if k % 2 == 0 else RECORDINGS[::-1]
        parts = [recording(n) for n in order]
        self.pcm = b"".join(p + PAUSE for p, _ in parts)
        self.ref = " ".join(t for _, t in parts)
        self.refusals = 0
        self.ran = False
        self.hyp = ""
        self.errors: list[str] = []
        self.final_ms: list[float] = []
        self.live_ms: list[float] = []
        self.gaps_s: list[float] = []
        self.loads: list[dict] = []

    def run(self) -> None:
        time.sleep(max(0.0, self.start_at - time.monotonic()))
        while time.monotonic() < self.deadline:
            c = StreamingClient(self.url)
            try:
                if not connect_or_wait(c):
                    self.refusals += 1
                    continue
                c.stream_pcm(self.pcm, 16000, pace="realtime")
                c.wait_end(60)
                self._collect(c)
                return
            except Exception as exc:  # noqa: BLE001 - counted, the run goes on
                self.errors.append(f"client: {exc}")
                return
            finally:
                c.close()

    def _collect(self, c: StreamingClient) -> None:
        self.ran = True
        self.hyp = c.result.text
        self.loads = list(c.result.loads)
        self.errors.extend(str(e.get("code")) for e in c.result.errors)
        covered = -1
        last_partial: dict[int, float] = {}
        for t, event, d in c.result.events:
            if event != "text":
                continue
            for k in range(max(covered + 1, int(d["start"] / CHUNK_S)), d["seq"] + 1):
                if k in c.sent_at:
                    self.live_ms.append((t - c.sent_at[k]) * 1000)
            covered = max(covered, d["seq"])
            if d["type"] == "partial":
                if d["utterance"] in last_partial:
                    self.gaps_s.append(t - last_partial[d["utterance"]])
                last_partial[d["utterance"]] = t
            else:
                end_chunk = max(0, math.ceil(d["end"] / CHUNK_S) - 1)
                if end_chunk in c.sent_at and end_chunk <= d["seq"]:
                    self.final_ms.append((t - c.sent_at[end_chunk]) * 1000)


def cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.NoSuchProcess:
            pass
    return total


def service_procs(stack: Stack) -> list[psutil.Process]:
    roots = [psutil.Process(stack.gateway.proc.pid), psutil.Process(stack.pool.proc.pid),
             psutil.Process(stack.redis_pid)]
    return roots + [c for r in roots for c in r.children(recursive=True)]


def run(scenario: str, offered: int, workers: int, n_hogs: int,
        baseline: Path | None = None) -> dict:
    kind, *mods = scenario.split("+")
    kind, _, floor = kind.partition("=")
    env = {"COSYVOICE_ENGINE": "whisper-live", "COSYVOICE_MAX_SESSIONS_PER_CLIENT": "0"}
    if floor:  # "yield=S": another floor
        env["COSYVOICE_LIVE_PARTIAL_FLOOR_S"] = floor
    if kind == "fixed":
        env["COSYVOICE_LIVE_PARTIAL_FLOOR_S"] = env["COSYVOICE_LIVE_PARTIAL_INTERVAL_S"] = "1.0"
    if "all" in mods:  # every session admitted: the cadence's effect alone
        env["COSYVOICE_WORKER_CAPACITY"] = str(math.ceil(offered / workers))
    if kind == "before" and baseline is None:
        raise SystemExit("the before scenario needs --baseline")
    root = baseline if kind == "before" and baseline is not None else ROOT
    with hogs(n_hogs if "hog" in mods else 0), \
            Stack(processes=workers, env=env, metrics=True, root=root) as stack:
        procs = service_procs(stack)
        bus = busmod.Bus(stack.client, 1000)
        seen: list[tuple[int, int]] = []  # (sessions decoding, capacity) each second
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(1.0):
                live = bus.live_workers()
                seen.append((sum(w["load"] for w in live),
                             sum(w["capacity"] for w in live)))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        length_s = len(LongClient(stack.url, 0, 0, 0).pcm) / 32000
        start = time.monotonic()
        deadline = start + STAGGER_S + length_s  # a client admitted later runs past it
        cpu0 = cpu_s(procs)
        clients = [LongClient(stack.url, k, start + STAGGER_S * k / offered, deadline)
                   for k in range(offered)]
        for c in clients:
            c.start()
        for c in clients:
            c.join(STAGGER_S + 2 * length_s + 120)
        wall = time.monotonic() - start
        cores = (cpu_s(procs) - cpu0) / wall
        stop.set()
        sampler.join(5)
        assert stack.pool.metrics_url is not None
        waits = waits_p95(stack.pool.metrics_url)
    ran = [c for c in clients if c.ran]
    errors = [e for c in clients for e in c.errors]
    intervals = [ld["partial_interval_ms"] for c in clients for ld in c.loads]
    final = _dist([x for c in clients for x in c.final_ms])
    gaps = _dist([1000 * x for c in clients for x in c.gaps_s])
    level: dict[str, Any] = {
        "scenario": scenario, "offered": offered, "ran": len(ran),
        "refusals": sum(c.refusals for c in clients),
        "final_ms": final, "partial_gap_ms": gaps,
        "live_ms": _dist([x for c in clients for x in c.live_ms]),
        "wer": round(corpus_wer([c.ref for c in ran], [c.hyp for c in ran]), 4) if ran else None,
        "cpu_cores": round(cores, 2), "load_events": len(intervals),
        "decoding_max": max((s for s, _ in seen), default=0),
        "capacity_min_max": [min((c for _, c in seen), default=0),
                             max((c for _, c in seen), default=0)],
        "scheduler_wait_p95_ms": waits,
        "longest_interval_ms": max(intervals, default=None),
        "errors": sorted(set(errors)), "error_count": len(errors),
    }
    level["meets"] = (not errors and final.get("n", 0) > 0
                      and final["p95"] < FINAL_P95_TARGET_MS and gaps.get("n", 0) > 0
                      and gaps["p95"] <= 1000 * PARTIAL_INTERVAL_TARGET_S
                      and level["refusals"] == 0)
    return level


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="12,16,20")
    ap.add_argument("--scenarios", default="before,yield")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--hog", type=int, default=1)
    ap.add_argument("--baseline", type=Path,
                    help="a checkout of the code before (the before scenario runs it)")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    given = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report: dict[str, Any] = {"machine": machine(), "args": given, "levels": []}
    for n in (int(x) for x in args.levels.split(",")):
        for scenario in args.scenarios.split(","):
            level = run(scenario, n, args.workers, args.hog, args.baseline)
            report["levels"].append(level)
            print(json.dumps(level), file=sys.stderr, flush=True)
    print(markdown(
        ["sessions", "scenario", "ran / refusals", "decoding at most",
         "capacity [min, max]", "final P50 / P95 ms",
         "partial interval P50 / P95 ms", "live text P50 / P95 ms", "WER", "CPU (cores)",
         "load events (longest interval ms)",
         "queue wait P95 final / partial ms", "final hand-over to text P95 ms",
         "targets met"],
        ([r["offered"], r["scenario"], f"{r['ran']} / {r['refusals']}", r["decoding_max"],
          r["capacity_min_max"], pair(r["final_ms"]),
          pair(r["partial_gap_ms"]), pair(r["live_ms"]),
          f"{100 * r['wer']:.1f} %" if r["wer"] is not None else "–", r["cpu_cores"],
          f"{r['load_events']} ({r['longest_interval_ms']})",
          pair(r["scheduler_wait_p95_ms"], "final", "partial"),
          r["scheduler_wait_p95_ms"].get("done"), "yes" if r["meets"] else "no"]
         for r in report["levels"])))
    if args.json_out:
        save_json(args.json_out, report, indent=1)


if __name__ == "__main__":
    main()
