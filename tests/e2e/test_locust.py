"""The Locust load test runs against the real service and measures every kind of latency."""

from __future__ import annotations

import csv
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .. import launcher
from ..helpers import ROOT, TEST_ENV
from ..netfault import CuttableProxy

pytestmark = pytest.mark.e2e

MEASURES = ("connect", "ack", "chunk->partial", "last->final")
# The short utterances: a session of them ends well within a short run's stop timeout, so
# every user's first session counts. The default speech set also holds 21 s and 26 s
# recordings, and a run whose users all drew those ended with no session finished.
SHORT_SPEECH = ("weather", "coffee", "meeting", "call")


@pytest.fixture(scope="module")
def service(module_redis, artifacts):
    """The service under load, with a fixed capacity (``COSYVOICE_WORKER_CAPACITY``, the
    engine's): these tests are of Locust's reports, and admission that follows measured cost
    may refuse a third user as overloaded on a slow or busy host (a refusal Locust counts
    as a failure; tests/system/test_admission.py is where admission is tested)."""
    svc = launcher.start_service(module_redis.url, processes=2, capacity=6, env=TEST_ENV,
                                 logs=artifacts, name="locust")
    yield svc
    svc.stop()


def short_speech(directory: Path) -> str:
    """A ``--speech`` glob over copies of the short fixtures in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in SHORT_SPEECH:
        source = ROOT / "tests" / "fixtures" / f"{name}.wav"
        (directory / f"{name}.wav").write_bytes(source.read_bytes())
    return str(directory / "*.wav")


def locust(host: str, prefix: Path, seconds: int, users: int, utterances: int,
           python: str = sys.executable, env: dict | None = None, speech: str | None = None):
    """The headless command of docs/operations.md, from the checkout, with ``python``'s locust."""
    return subprocess.Popen(
        [python, "-m", "locust", "-f", str(ROOT / "locustfile.py"), "--headless",
         "--host", host, "-u", str(users), "-r", str(users), "-t", f"{seconds}s",
         "--stop-timeout", "30", "--utterances", str(utterances), "--csv", str(prefix),
         "--only-summary", *(["--speech", speech] if speech else [])],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def stats(prefix: Path) -> dict[str, dict]:
    try:
        with open(f"{prefix}_stats.csv", newline="") as f:
            return {row["Name"]: row for row in csv.DictReader(f)}
    except FileNotFoundError:
        return {}


def count(rows: dict, name: str) -> int:
    return int(rows[name]["Request Count"]) if name in rows else 0


def assert_clean(rows: dict) -> None:
    for name in MEASURES:
        assert count(rows, name) > 0, f"no {name} requests in {sorted(rows)}"
    assert int(rows["Aggregated"]["Failure Count"]) == 0, rows
    assert not any(name.startswith("error") or name == "session" for name in rows), rows


def test_locust_headless_run_reports_real_latencies_without_failures(service, artifacts,
                                                                     tmp_path):
    prefix = artifacts / "locust"
    run = locust(service.url, prefix, seconds=8, users=3, utterances=2,
                 speech=short_speech(tmp_path / "speech"))
    out, _ = run.communicate(timeout=120)
    assert run.returncode == 0, out
    rows = stats(prefix)
    assert_clean(rows)
    # Three users streaming at 5 chunks a second for several seconds.
    assert count(rows, "ack") >= 3 * 5 * 4


def test_locust_users_resume_after_their_connections_drop(service, artifacts):
    proxy = CuttableProxy(int(service.url.rsplit(":", 1)[1]))
    prefix = artifacts / "locust-drop"
    run = locust(proxy.url, prefix, seconds=14, users=2, utterances=3)
    try:
        # Cut once acks flow; again (a few times at most) if no user was mid-session.
        for _attempt in range(4):
            while count(stats(prefix), "ack") < 10 and run.poll() is None:
                time.sleep(0.2)
            proxy.cut()
            time.sleep(2.5)
            if count(stats(prefix), "reconnect") or run.poll() is not None:
                break
        out, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
        proxy.close()
    assert run.returncode == 0, out
    rows = stats(prefix)
    assert count(rows, "reconnect") >= 1, sorted(rows)
    assert_clean(rows)
