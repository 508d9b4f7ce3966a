"""How busy the service is: ``GET /load``, the load metrics, and how long a refused client
is told to wait.

Admission (``lua/admit.lua``) admits a session while the open sessions are fewer than the
live workers' capacity; each worker's capacity counts its finals and its partials at the
floor cadence (cosyvoice/asr/admission.py, cosyvoice/asr/cadence.py). ``GET /load`` says
where the service stands against that, for a load balancer or an autoscaler:

- ``sessions`` (open: admitted and not ended), ``capacity``, their ratio ``load`` and
  ``full`` (a new session would be refused now);
- the decode queues: the highest P95 of the workers' recent final and partial waits and
  the longest partial interval they set (``partial_interval_ms``: over the base cadence,
  partials are being spaced out);
- ``drain_per_s``: sessions that ended per second lately, and ``retry_after_ms``: what a
  refused client is told now.

The gateway's ``/metrics`` has the same as gauges (``cosyvoice_service_sessions``,
``cosyvoice_service_capacity``, ``cosyvoice_service_load_ratio``), read from Redis at
each scrape: the metric a Kubernetes HorizontalPodAutoscaler scales the workers on
(docs/operations.md, "Load and autoscaling").
"""

from __future__ import annotations

import math
from typing import Any

from ..store import bus as busmod

# The longest a refused client is told to wait.
MAX_RETRY_MS = 60_000


def retry_after_ms(drain_per_s: float | None, ahead: int, default_ms: int) -> int:
    """How long a refused client should wait: the places it is behind (``ahead``: the
    open sessions beyond the capacity, and its own) at the rate sessions ended lately
    (``drain_per_s``), and at least ``default_ms`` (``COSYVOICE_OVERLOAD_RETRY_MS``):
    a service that drains fast does not call every refused client back at once, and a
    client that tries a fixed number of times keeps its patience."""
    if not drain_per_s or drain_per_s <= 0:
        return default_ms
    wait = 1000 * max(1, ahead) / drain_per_s
    return int(min(max(MAX_RETRY_MS, default_ms), max(default_ms, math.ceil(wait))))


def totals(bus: busmod.Bus) -> tuple[list[dict], int, int]:
    """(live workers, open sessions, their capacity in all): what admission compares, a new
    session admitted while open < capacity (``/readyz``, ``GET /load``, the gauges)."""
    workers = bus.live_workers()
    return workers, bus.open_sessions(), sum(w["capacity"] for w in workers)


def report(bus: busmod.Bus, default_retry_ms: int) -> dict[str, Any]:
    """The body of ``GET /load`` (raises ``redis.RedisError`` where Redis does not answer)."""
    workers, sessions, capacity = totals(bus)
    loads = bus.worker_loads([w["id"] for w in workers])
    drain = bus.drain_rate()
    rows = []
    for w in workers:
        queue = loads.get(w["id"], {})
        rows.append({"id": w["id"], "sessions": w["load"], "capacity": w["capacity"],
                     **{k: queue.get(k) for k in ("busy", "final_wait_p95_ms",
                                                  "partial_wait_p95_ms", "partial_interval_ms")}})

    def highest(key: str) -> int | None:
        values = [r[key] for r in rows if r[key] is not None]
        return max(values) if values else None

    full = sessions >= capacity
    return {
        "sessions": sessions, "capacity": capacity,
        "load": round(sessions / capacity, 3) if capacity else None, "full": full,
        "final_wait_p95_ms": highest("final_wait_p95_ms"),
        "partial_wait_p95_ms": highest("partial_wait_p95_ms"),
        "partial_interval_ms": highest("partial_interval_ms"),
        "drain_per_s": round(drain, 3) if drain else None,
        "retry_after_ms": retry_after_ms(drain, sessions - capacity + 1, default_retry_ms)
        if full else None,
        "workers": rows,
    }
