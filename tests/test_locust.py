"""The Locust load test runs against the real service and measures every kind of latency."""

from __future__ import annotations

import csv
import subprocess
import sys

from .helpers import ROOT


def test_locust_headless_run_reports_real_latencies_without_failures(service, artifacts):
    prefix = artifacts / "locust"
    run = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfile.py"), "--headless",
         "--host", service.url, "-u", "3", "-r", "3", "-t", "8s", "--stop-timeout", "30",
         "--utterances", "2", "--csv", str(prefix), "--only-summary"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    with open(f"{prefix}_stats.csv", newline="") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    for name in ("connect", "ack", "chunk->partial", "last->final"):
        assert name in rows, f"no {name} requests in {sorted(rows)}"
        assert int(rows[name]["Request Count"]) > 0
    assert int(rows["Aggregated"]["Failure Count"]) == 0, rows
    assert not any(name.startswith("error") or name == "session" for name in rows), rows
    # Three users streaming at 5 chunks a second for several seconds.
    assert int(rows["ack"]["Request Count"]) >= 3 * 5 * 4
