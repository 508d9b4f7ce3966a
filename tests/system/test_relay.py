"""The gateway's result subscriber outlives its connections being killed while sessions
subscribe and unsubscribe on them, on one Redis and on a Redis Cluster: every session
still subscribed gets its results afterwards, and no greenlet of the relay dies
(``tests/relay_storm.py``, a gevent process as the gateway is)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.system


@pytest.mark.parametrize("store", ["redis", "cluster"])
def test_the_result_subscriber_survives_kills_while_sessions_come_and_go(
        store, redis_server, request):
    url = request.getfixturevalue("cluster").url if store == "cluster" else redis_server.url
    run = subprocess.run([sys.executable, "-m", "tests.relay_storm", url]
                         + (["cluster"] if store == "cluster" else []),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    outcome = json.loads(run.stdout.strip().splitlines()[-1])
    assert outcome["errors"] == [], run.stderr[-3000:]
    assert outcome["missing"] == []
