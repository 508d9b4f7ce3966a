"""The gateway's operational endpoints: readiness (``/readyz``), load (``/load``,
cosyvoice/gateway/load.py) and metrics (``/metrics``).

``/healthz`` (in ``webui``) says only that the process answers: restart it when that
fails. ``/readyz`` says whether it can serve a session now — Redis answers and at least
one ASR worker's heartbeat is fresh: take the instance out of rotation while it fails.
"""

from __future__ import annotations

import gevent
import redis
from flask import Flask, Response, jsonify

from .. import metrics
from ..store import bus as busmod
from . import load

# How often each gateway process records its number of connected sessions.
SESSIONS_SAMPLE_S = 1.0


def readiness(bus: busmod.Bus) -> tuple[bool, dict]:
    """(ready, JSON body): Redis (on a cluster, every primary) answers and a worker's
    heartbeat is fresh."""
    try:
        bus.ping()
        workers, open_sessions, capacity = load.totals(bus)
    except redis.RedisError as exc:
        return False, {"status": "unavailable", "reason": f"redis unreachable: {exc}"}
    if not workers:
        return False, {"status": "unavailable",
                       "reason": "no ASR worker has sent a heartbeat recently"}
    return True, {"status": "ready", "workers": len(workers), "capacity": capacity,
                  "load": sum(w["load"] for w in workers), "open": open_sessions}


def install(app: Flask, gateway) -> None:
    """Adds ``/readyz`` and ``/metrics`` to the gateway's app and keeps the sessions gauge."""

    @app.get("/readyz")
    def readyz():
        ready, body = readiness(gateway.bus)
        return jsonify(body), 200 if ready else 503

    @app.get("/load")
    def load_endpoint():
        try:
            body = load.report(gateway.bus, gateway.settings.overload_retry_ms)
        except redis.RedisError as exc:
            return jsonify({"status": "unavailable", "reason": f"redis unreachable: {exc}"}), 503
        metrics.service_load(body["sessions"], body["capacity"])
        return jsonify(body)

    @app.get("/metrics")
    def metrics_endpoint():
        try:  # the service's load, as of this scrape
            _workers, sessions, capacity = load.totals(gateway.bus)
            metrics.service_load(sessions, capacity)
        except redis.RedisError:
            pass  # the gauges keep their last values; /readyz says Redis is gone
        body, content_type = metrics.exposition()
        return Response(body, content_type=content_type)

    gevent.spawn(_sample_sessions, gateway.held)


def _sample_sessions(held: set) -> None:
    while True:
        metrics.SESSIONS_ACTIVE.set(len(held))
        gevent.sleep(SESSIONS_SAMPLE_S)
