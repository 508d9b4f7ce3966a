"""Admission that follows the decode scheduler, against a fixed capacity, in one run.

Each scenario is a fresh stack (embedded Redis, gateway, ``--workers`` whisper-live worker
processes) offered more real-time clients than it can serve (``--offered``, replaying the
fixtures as benchmarks/engines.py's service level does, for ``--seconds``). A refused
client waits the ``retry_after_ms`` the refusal hints and tries again. Scenarios:

- ``fixed``: ``COSYVOICE_WORKER_CAPACITY`` = the engine's measured capacity (6 a process;
  ``fixed=N``: N);
- ``scheduler``: no ``COSYVOICE_WORKER_CAPACITY``, the capacity follows the scheduler
  (cosyvoice/asr/admission.py);

each on the quiet host and with ``--hog`` CPU-bound processes running beside the service
(a host whose cores are shared with other work: what a fixed capacity cannot know).

Per scenario: sessions decoding, the capacity the workers advertise (their heartbeats,
sampled every second: mean, and min/max after the first 10 s) and the schedulers' busy
fraction (added up), sessions refused, partial and final latency P50/P95 of the sessions
admitted, the same P95s for the sessions admitted after the first 20 s (the steady state:
a capacity learnt, not the one it started with) and whether final P95 < 800 ms and
partial P95 < 1.5 s hold for them, and the schedulers' queue waits (P95 from the pool's
``cosyvoice_decode_wait_seconds``) and the finals' times from hand-over to text (P95 from
``cosyvoice_decode_final_seconds``: the wait plus the decode).

    python benchmarks/admission.py [--offered 20] [--workers 2] [--seconds 60] [--hog 1]
        [--scenarios fixed,scheduler,fixed+hog,scheduler+hog] [--speech en|zh|mix]
        [--json-out F]

``--speech mix``: every other client speaks Mandarin (``auth.language: auto``), whose
sessions the multilingual model decodes at about twice the cost (docs/languages.md).

About 7 minutes with the defaults on a 2-core machine; every run stays under 15 minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
import urllib.request
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.engines import (  # noqa: E402
    CHUNK_S,
    Client,
    _dist,
    groups,
    meets,
)
from benchmarks.report import markdown, pair, save_json  # noqa: E402
from benchmarks.stack import Stack  # noqa: E402
from benchmarks.transport import machine  # noqa: E402
from cosyvoice.asr import ENGINES  # noqa: E402
from cosyvoice.client import Refused, StreamingClient  # noqa: E402
from cosyvoice.store import bus as busmod
from tests.helpers import hogs  # noqa: E402

WARMUP_S = 10.0  # capacity samples before this are left out of its min and max
STEADY_AFTER_S = 20.0  # latency of the sessions admitted from then on: the steady state


def connect_or_wait(c: StreamingClient) -> bool:
    """Open ``c``'s session; refused as overloaded, wait the ``retry_after_ms`` the refusal
    hints (at most 2 s) and say False."""
    try:
        c.connect(overload_retries=0)
    except Refused as exc:
        if exc.code != "overloaded":
            raise
        hint = c.result.refusals[-1] if c.result.refusals else {}
        time.sleep(min(2.0, hint.get("retry_after_ms", 1000) / 1000))
        return False
    return True


class OfferedClient(Client):
    """A microphone that keeps asking: refused, it waits as hinted and asks again."""

    def __init__(self, *args: Any, steady_after: float = 0.0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.refusals = 0
        self.steady_after = steady_after  # sessions admitted from then on are the steady state
        self.steady_partial_ms: list[float] = []
        self.steady_final_ms: list[float] = []
        self._steady = False

    def _connect(self, c: StreamingClient) -> bool:
        if not connect_or_wait(c):
            self.refusals += 1
            return False
        self._steady = time.monotonic() >= self.steady_after
        return True

    def _collect(self, c: StreamingClient, last_seq: int) -> None:
        n_partial, n_final = len(self.partial_ms), len(self.final_ms)
        super()._collect(c, last_seq)
        if self._steady:
            self.steady_partial_ms.extend(self.partial_ms[n_partial:])
            self.steady_final_ms.extend(self.final_ms[n_final:])


def samples(metrics_url: str, family: str) -> list:
    """The samples of one metric family on the pool's /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return [s for f in text_string_to_metric_families(text) if f.name == family
            for s in f.samples]


def waits_p95(metrics_url: str) -> dict[str, float | None]:
    """P95 (ms) of the schedulers' decode waits by kind, and of the finals' times from
    hand-over to text (``done``), from the pool's histograms (linear within a bucket)."""
    buckets: dict[str, list[tuple[float, float]]] = {"final": [], "partial": [], "done": []}
    for s in samples(metrics_url, "cosyvoice_decode_wait_seconds"):
        if s.name.endswith("_bucket") and s.labels.get("kind") in buckets:
            buckets[s.labels["kind"]].append((float(s.labels["le"]), s.value))
    for s in samples(metrics_url, "cosyvoice_decode_final_seconds"):
        if s.name.endswith("_bucket"):
            buckets["done"].append((float(s.labels["le"]), s.value))
    return {kind: histogram_p95(rows) for kind, rows in buckets.items()}


def histogram_p95(rows: list[tuple[float, float]]) -> float | None:
    """P95 (ms) of a histogram's cumulative (upper bound, count) rows."""
    rows.sort()
    total = rows[-1][1] if rows else 0
    if not total:
        return None
    want, low, below = 0.95 * total, 0.0, 0.0
    for le, count in rows:
        if count >= want:
            if math.isinf(le):
                return round(low * 1000)
            share = (want - below) / (count - below) if count > below else 1.0
            return round((low + share * (le - low)) * 1000)
        low, below = le, count
    return None


def busy_now(metrics_url: str) -> float:
    """The pool's schedulers' busy fraction, added up over its processes."""
    return sum(s.value for s in samples(metrics_url, "cosyvoice_decode_busy_ratio"))


def speech_of(speech: str, k: int) -> tuple[dict[str, str], str | None]:
    """Client ``k``'s sentences and session language: ``en`` the English fixtures on the
    server's default language, ``zh`` the Mandarin ones on ``auto``, ``mix`` every other
    client Mandarin."""
    if speech == "zh" or (speech == "mix" and k % 2):
        from tests.helpers import zh_texts

        return zh_texts(), "auto"
    return {k: v for group in groups().values() for k, v in group.items()}, None


def run(scenario: str, offered: int, workers: int, seconds: float, n_hogs: int,
        speech: str = "en") -> dict:
    kind = scenario.split("+")[0]
    env = {"COSYVOICE_ENGINE": "whisper-live", "COSYVOICE_MAX_SESSIONS_PER_CLIENT": "0"}
    if kind.startswith("fixed"):  # "fixed" or "fixed=N" (N a process)
        _, _, n = kind.partition("=")
        env["COSYVOICE_WORKER_CAPACITY"] = n or str(ENGINES["whisper-live"].capacity)
    seen: list[tuple[float, int, int, float]] = []  # (t, sessions, capacity, busy)
    with hogs(n_hogs if scenario.endswith("+hog") else 0), \
            Stack(processes=workers, env=env, metrics=True) as stack:
        bus = busmod.Bus(stack.client, 1000)
        start = time.monotonic()
        deadline = start + seconds
        stop = threading.Event()

        def sample() -> None:
            assert stack.pool.metrics_url is not None
            while not stop.wait(1.0):
                live = bus.live_workers()
                seen.append((time.monotonic() - start, sum(w["load"] for w in live),
                             sum(w["capacity"] for w in live),
                             busy_now(stack.pool.metrics_url)))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        clients = [OfferedClient(stack.url, deadline, k, *speech_of(speech, k),
                                 steady_after=start + STEADY_AFTER_S)
                   for k in range(offered)]
        for client in clients:
            client.start()
            time.sleep(CHUNK_S / offered)
        for client in clients:
            client.join(seconds + 120)
        stop.set()
        sampler.join(5)
        assert stack.pool.metrics_url is not None
        waits = waits_p95(stack.pool.metrics_url)
    steady = [s for s in seen if WARMUP_S <= s[0] <= seconds] or seen
    errors = [e for c in clients for e in c.errors]
    level: dict[str, Any] = {
        "scenario": scenario, "speech": speech, "offered": offered,
        "completed_sessions": sum(c.sessions for c in clients),
        "refusals": sum(c.refusals for c in clients),
        "decoding_mean": round(sum(s[1] for s in steady) / max(1, len(steady)), 1),
        "capacity_mean": round(sum(s[2] for s in steady) / max(1, len(steady)), 1),
        "busy_mean": round(sum(s[3] for s in steady) / max(1, len(steady)), 2),
        "capacity_min_max": [min((s[2] for s in steady), default=0),
                             max((s[2] for s in steady), default=0)],
        "partial_ms": _dist([x for c in clients for x in c.partial_ms]),
        "final_ms": _dist([x for c in clients for x in c.final_ms]),
        "steady_partial_ms": _dist([x for c in clients for x in c.steady_partial_ms]),
        "steady_final_ms": _dist([x for c in clients for x in c.steady_final_ms]),
        "scheduler_wait_p95_ms": waits,
        "errors": sorted(set(errors)), "error_count": len(errors),
    }
    level["meets"] = meets(errors, level["steady_partial_ms"], level["steady_final_ms"])
    return level


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--offered", type=int, default=20)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--hog", type=int, default=1)
    ap.add_argument("--scenarios", default="fixed,scheduler,fixed+hog,scheduler+hog")
    ap.add_argument("--speech", default="en", choices=("en", "zh", "mix"),
                    help="what the clients say: English (the server's default language), "
                         "Mandarin on auto, or every other client Mandarin")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    report: dict[str, Any] = {"machine": machine(), "args": vars(args), "scenarios": []}
    for scenario in args.scenarios.split(","):
        level = run(scenario, args.offered, args.workers, args.seconds, args.hog, args.speech)
        report["scenarios"].append(level)
        print(json.dumps(level), file=sys.stderr, flush=True)
    print(markdown(
        ["scenario", "decoding (mean)", "capacity mean [min, max]", "schedulers busy",
         "refusals", "partial P50 / P95 ms", "final P50 / P95 ms",
         "steady partial / final P95 ms", "queue wait P95 final / partial ms",
         "final hand-over to text P95 ms", "meets (steady)"],
        ([r["scenario"], r["decoding_mean"], f"{r['capacity_mean']} {r['capacity_min_max']}",
          r["busy_mean"], r["refusals"], pair(r["partial_ms"]), pair(r["final_ms"]),
          f"{r['steady_partial_ms'].get('p95')} / {r['steady_final_ms'].get('p95')}",
          pair(r["scheduler_wait_p95_ms"], "final", "partial"),
          r["scheduler_wait_p95_ms"].get("done"),
          "yes" if r["meets"] else "no"] for r in report["scenarios"])))
    if args.json_out:
        save_json(args.json_out, report, indent=1)


if __name__ == "__main__":
    main()
