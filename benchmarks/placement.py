"""`last` → final latency as concurrent real-time sessions grow, and where they land.

On a fresh stack (embedded Redis, gateway, ``--workers`` worker processes of
``COSYVOICE_WORKER_CAPACITY`` sessions, 6 by default), for each level K in ``--levels``,
K clients run real-time PocketSphinx sessions back to back (one to three fixture
utterances, ``last``, ``end``, ``stop``; ``benchmarks/capacity.py``'s client) for
``--seconds``. ``--tail gap`` ends each session's audio with 0.5 s of silence, as the
capacity benchmark does (the endpointer often calls the final before ``last`` is sent);
``--tail none`` ends it with the speech, so ``last`` itself ends the utterance and the
final's decode is on the measured path, as for a user who stops recording when done
speaking. Measured: ``last`` sent → the final covering it (or ``end``), chunk →
partial, and every 0.25 s the sessions each worker process owns (the owners of the
leases of the open sessions), reported as the largest and the mean difference between
the busiest and the idlest process.

``--baseline DIR`` runs every level a second time, alternately, with the cosyvoice of
another checkout (e.g. ``git worktree add /tmp/base <commit>``), so both are measured on
the same machine in the same run and can be quoted as ratios.

``--cost`` measures instead what admission and placement cost Redis, per call, with
N live workers registered (heartbeats; no worker processes): ``admit`` per new session,
``place`` when it takes a session, when it finds nothing (most rounds) and when its
orphan check is due (once per worker per ``claim_interval_ms``), read from
``INFO commandstats`` (Redis CPU only, not the round trip).

    python benchmarks/placement.py [--levels 1,6,12] [--seconds 60] [--baseline DIR]
    python benchmarks/placement.py --cost [--workers-list 2,8,32,128]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis as redislib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.capacity import GAP, Client, _dist  # noqa: E402
from benchmarks.report import markdown, pair, save_json  # noqa: E402
from benchmarks.stack import POCKETSPHINX, ROOT, Stack  # noqa: E402
from benchmarks.transport import CpuMeter, machine  # noqa: E402
from cosyvoice.store import bus as busmod
from cosyvoice.store import keys
from tests import launcher  # noqa: E402


class PlacementSampler(threading.Thread):
    """Sessions per worker process over time, from the leases of the open sessions."""

    def __init__(self, client, processes: int, interval: float = 0.25):
        super().__init__(daemon=True)
        self.client = client
        self.processes = processes
        self.interval = interval
        self.spreads: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            sids = [f[b"sid"].decode() for _id, f in self.client.xrange(keys.SESSIONS)]
            owners = [o for o in self.client.mget([keys.lease_key(s) for s in sids]) if o] \
                if sids else []
            counts = Counter(owners)
            per_process = sorted(counts.values()) + [0] * (self.processes - len(counts))
            if per_process:
                self.spreads.append(max(per_process) - min(per_process))


def run_level(sessions: int, workers: int, seconds: float, root: Path,
              tail: str = "none") -> dict:
    env = {**POCKETSPHINX, "COSYVOICE_MAX_SESSIONS_PER_CLIENT": "0"}
    with Stack(processes=workers, env=env, root=root) as stack:
        meter = CpuMeter({"gateway": stack.gateway.proc.pid, "workers": stack.pool.proc.pid,
                          "redis": stack.redis_pid})
        sampler = PlacementSampler(stack.client, workers)
        before = meter.sample()
        sampler.start()
        deadline = time.monotonic() + seconds
        # "none": the audio ends with the speech, so `last` ends the utterance
        clients = [Client(stack.url, deadline, seed=k, tail=b"" if tail == "none" else GAP)
                   for k in range(sessions)]
        for client in clients:  # all at once, as in a burst
            client.start()
        for client in clients:
            client.join(seconds + 90)
        sampler.stop.set()
        sampler.join()
        after = meter.sample()
    wall = after["wall"] - before["wall"]
    errors = [e for c in clients for e in c.errors]
    spreads = sampler.spreads
    return {
        "code": "baseline" if root != ROOT else "this checkout", "sessions": sessions,
        "tail": tail,
        "completed_sessions": sum(c.sessions for c in clients),
        "last_to_final_ms": _dist([x for c in clients for x in c.final_ms]),
        "partial_ms": _dist([x for c in clients for x in c.partial_ms]),
        "placement_spread": {"max": max(spreads, default=0),
                             "mean": round(sum(spreads) / len(spreads), 2) if spreads else 0},
        "errors": sorted({e.get("code", "?") for e in errors}), "error_count": len(errors),
        "cpu_cores": {k: round((after[k] - before[k]) / wall, 2) for k in after if k != "wall"},
    }


def _script_usec(client) -> tuple[int, float]:
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), float(stats.get("usec", 0))


def _per_call(client, calls) -> float:
    """Redis-side µs per call of the scripts ``calls`` runs."""
    n0, u0 = _script_usec(client)
    calls()
    n1, u1 = _script_usec(client)
    return round((u1 - u0) / max(1, n1 - n0), 1)


def placement_cost(workers: int, capacity: int = 6) -> dict:
    with launcher.redis_server() as server:
        client = redislib.Redis.from_url(server.url)
        try:
            return _placement_cost(client, workers, capacity)
        finally:
            client.close()


def _placement_cost(client: redislib.Redis, workers: int, capacity: int) -> dict:
    bus = busmod.Bus(client)
    bus.ensure_group()
    ids = [f"bench-worker-{i}" for i in range(workers)]
    for wid in ids:
        bus.heartbeat(wid, capacity, 600_000)
    sessions = workers * capacity
    sids = [f"bench-session-{i}" for i in range(sessions)]
    for sid in sids:
        bus.create_session(sid, 16000)
    load: Counter[str] = Counter()

    def admit_all():
        for sid in sids:
            assert bus.admit(sid).admitted

    def place_all():  # the least loaded worker takes each one, as in the service
        for _ in sids:
            wid = min(ids, key=lambda w: load[w])
            _newest, got = bus.place(wid, capacity, capacity - load[wid], 0, 1000)
            load[wid] += len(got)

    admit = _per_call(client, admit_all)
    take = _per_call(client, place_all)
    assert sum(load.values()) == sessions
    idle = _per_call(client, lambda: [bus.place(w, capacity, 1, 0, 1000) for w in ids * 5])
    orphans = _per_call(client, lambda: [bus.place(w, capacity, 1, 5000, 1000)
                                         for w in ids * 5])
    return {"workers": workers, "sessions": sessions, "admit_us": admit,
            "place_taking_us": take, "place_nothing_us": idle,
            "place_orphan_check_us": orphans}


def main_cost(workers_list: list[int]) -> None:
    rows = [placement_cost(n) for n in workers_list]
    print(json.dumps({"machine": machine(), "cost": rows}), file=sys.stderr)
    print("| live workers | `admit` µs | `place` taking µs | `place` nothing new µs "
          "| `place` with orphan check µs |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workers']} | {r['admit_us']} | {r['place_taking_us']} "
              f"| {r['place_nothing_us']} | {r['place_orphan_check_us']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="1,6,12", help="concurrent sessions to run")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--baseline", type=Path, help="another checkout to measure alternately")
    ap.add_argument("--tail", default="none,gap",
                    help="how sessions end: none (with the speech), gap (0.5 s silence)")
    ap.add_argument("--json-out")
    ap.add_argument("--cost", action="store_true",
                    help="measure what admission and placement cost Redis per call")
    ap.add_argument("--workers-list", default="2,8,32,128")
    args = ap.parse_args()
    if args.cost:
        return main_cost([int(x) for x in args.workers_list.split(",")])
    roots = [ROOT] + ([args.baseline.resolve()] if args.baseline else [])
    levels: list[dict[str, Any]] = []
    report = {"machine": machine(), "args": {**vars(args), "baseline": str(args.baseline)},
              "levels": levels}
    for tail in args.tail.split(","):
        for k in (int(x) for x in args.levels.split(",")):
            for root in roots:
                level = run_level(k, args.workers, args.seconds, root, tail)
                levels.append(level)
                print(json.dumps(level), file=sys.stderr, flush=True)
    print(markdown(
        ["audio ends", "sessions", "code", "`last` → final P50 / P95 ms",
         "partial P50 / P99 ms", "spread max / mean", "errors", "worker cores"],
        (["with speech" if lv["tail"] == "none" else "0.5 s silence", lv["sessions"],
          lv["code"], pair(lv["last_to_final_ms"]), pair(lv["partial_ms"], "p50", "p99"),
          pair(lv["placement_spread"], "max", "mean"), lv["error_count"],
          lv["cpu_cores"]["workers"]] for lv in levels)))
    if args.json_out:
        save_json(args.json_out, report)


if __name__ == "__main__":
    main()
