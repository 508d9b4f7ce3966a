"""`last` → final latency as concurrent real-time sessions grow, and where they land.

On a fresh stack (embedded Redis, gateway, ``--workers`` worker processes of
``COSYVOICE_WORKER_CAPACITY`` sessions, 6 by default), for each level K in ``--levels``,
K clients run real-time PocketSphinx sessions back to back (one to three fixture
utterances, ``last``, ``end``, ``stop``; ``benchmarks/capacity.py``'s client) for
``--seconds``. Measured: ``last`` sent → the final covering it (or ``end``), chunk →
partial, and every 0.25 s the sessions each worker process owns (the owners of the
leases of the open sessions), reported as the largest and the mean difference between
the busiest and the idlest process.

``--baseline DIR`` runs every level a second time, alternately, with the cosyvoice of
another checkout (e.g. ``git worktree add /tmp/base <commit>``), so both are measured on
the same machine in the same run and can be quoted as ratios.

    python benchmarks/placement.py [--levels 1,6,12] [--seconds 60] [--baseline DIR]
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.capacity import Client, _dist  # noqa: E402
from benchmarks.stack import ROOT, Stack  # noqa: E402
from benchmarks.transport import CpuMeter, machine  # noqa: E402
from cosyvoice import bus as busmod  # noqa: E402


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
            sids = [f[b"sid"].decode() for _id, f in self.client.xrange(busmod.SESSIONS)]
            owners = [o for o in self.client.mget([busmod.lease_key(s) for s in sids]) if o] \
                if sids else []
            counts = Counter(owners)
            per_process = sorted(counts.values()) + [0] * (self.processes - len(counts))
            if per_process:
                self.spreads.append(max(per_process) - min(per_process))


def run_level(sessions: int, workers: int, seconds: float, root: Path) -> dict:
    env = {"COSYVOICE_MAX_SESSIONS_PER_CLIENT": "0"}
    with Stack(processes=workers, env=env, root=root) as stack:
        meter = CpuMeter({"gateway": stack.gateway.pid, "workers": stack.worker.pid,
                          "redis": stack.redis.proc.pid})
        sampler = PlacementSampler(stack.client, workers)
        before = meter.sample()
        sampler.start()
        deadline = time.monotonic() + seconds
        clients = [Client(stack.url, deadline, seed=k) for k in range(sessions)]
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
        "completed_sessions": sum(c.sessions for c in clients),
        "last_to_final_ms": _dist([x for c in clients for x in c.final_ms]),
        "partial_ms": _dist([x for c in clients for x in c.partial_ms]),
        "placement_spread": {"max": max(spreads, default=0),
                             "mean": round(sum(spreads) / len(spreads), 2) if spreads else 0},
        "errors": sorted({e.get("code", "?") for e in errors}), "error_count": len(errors),
        "cpu_cores": {k: round((after[k] - before[k]) / wall, 2) for k in after if k != "wall"},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="1,6,12", help="concurrent sessions to run")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--baseline", type=Path, help="another checkout to measure alternately")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    roots = [ROOT] + ([args.baseline.resolve()] if args.baseline else [])
    report = {"machine": machine(), "args": {**vars(args), "baseline": str(args.baseline)},
              "levels": []}
    for k in (int(x) for x in args.levels.split(",")):
        for root in roots:
            level = run_level(k, args.workers, args.seconds, root)
            report["levels"].append(level)
            print(json.dumps(level), file=sys.stderr, flush=True)
    print("| sessions | code | `last` → final P50 / P95 ms | partial P50 / P99 ms "
          "| spread max / mean | errors | worker cores |")
    print("|---|---|---|---|---|---|---|")
    for lv in report["levels"]:
        f, p, sp = lv["last_to_final_ms"], lv["partial_ms"], lv["placement_spread"]
        print(f"| {lv['sessions']} | {lv['code']} | {f.get('p50')} / {f.get('p95')} "
              f"| {p.get('p50')} / {p.get('p99')} | {sp['max']} / {sp['mean']} "
              f"| {lv['error_count']} | {lv['cpu_cores']['workers']} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
