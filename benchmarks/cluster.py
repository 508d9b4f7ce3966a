"""The service on a Redis Cluster next to one Redis, in the same run.

For each Redis (one ``redis-server`` 7 node, then a cluster of three primaries from the
same binary, both started here on free loopback ports) it starts a gunicorn gateway and
a worker pool and drives them with the transport benchmark's load generator
(``benchmarks/sioload.py``): real-time streams of 200 ms chunks of real speech, with the
``null`` engine (transport only) and then with PocketSphinx (real recognition, fewer
streams). It reports, per level: chunks, lost chunks, ack and partial latency, CPU per
chunk of the gateway, of Redis (all nodes) and of the workers, and Redis's commands and
network bytes per chunk (from ``INFO commandstats`` and ``INFO stats`` of every node).

    python benchmarks/cluster.py [--levels 100,200] [--asr-levels 8] [--seconds 30]
        [--warmup 5] [--workers 2] [--json-out FILE]

Needs Debian's redis-server 7 (``/usr/bin/redis-server``; the tests install it too).
The paper estimate the report ends with scales the measured Redis cost per chunk to
cores: see ``estimate``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import redis

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import markdown, pair  # noqa: E402
from benchmarks.transport import CpuMeter, machine, run_level, speech  # noqa: E402
from tests import launcher  # noqa: E402
from tests.cluster import REDIS_SERVER, Cluster, Node, redis_cluster  # noqa: E402
from tests.cluster import _free_cluster_port as free_port  # noqa: E402

# A Redis core is taken as saturated at this fraction busy.
CORE_BUSY = 0.8
CHUNKS_PER_SESSION_S = 5  # 200 ms chunks


@contextmanager
def single_redis():
    """One redis-server 7 node, not in cluster mode, as a one-node ``Cluster``."""
    root = Path(tempfile.mkdtemp(prefix="cosyvoice-single-"))
    port = free_port()
    proc = subprocess.Popen([REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    node = Node(port, proc, root)
    try:
        launcher.wait_for(lambda: _pings(node), timeout=10)
        yield Cluster([node])
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(root, ignore_errors=True)


def _pings(node: Node) -> bool:
    try:
        return bool(node.client().ping())
    except redis.RedisError:
        return False


def redis_counters(nodes: list[Node]) -> dict[str, float]:
    """Commands run and network bytes, summed over the nodes."""
    calls = 0
    net = 0
    for n in nodes:
        c = n.client()
        calls += sum(int(v["calls"]) for k, v in c.info("commandstats").items()
                     if k.startswith("cmdstat_"))
        stats = c.info("stats")
        net += int(stats["total_net_input_bytes"]) + int(stats["total_net_output_bytes"])
    return {"calls": calls, "net_bytes": net}


async def measure(url: str, cluster: bool, nodes: list[Node], engine: str, levels: list[int],
                  args, source) -> list[dict]:
    env = {"COSYVOICE_ENGINE": engine, "COSYVOICE_MAX_SESSIONS_PER_CLIENT": "0",
           "COSYVOICE_WORKER_CAPACITY": str(max(levels) + 10), "COSYVOICE_LOG_LEVEL": "WARNING",
           "COSYVOICE_REDIS_CLUSTER": "true" if cluster else "false"}
    gateway = launcher.start_gateway(url, gunicorn=True, env=env)
    pool = launcher.start_worker_pool(url, processes=args.workers, env=env)
    out = []
    try:
        pids = {"gateway": gateway.proc.pid, "workers": pool.proc.pid}
        pids.update({f"redis{i}": n.proc.pid for i, n in enumerate(nodes)})
        meter = CpuMeter(pids)
        for n in levels:
            before = redis_counters(nodes)
            r = await run_level(gateway.port, n, args.warmup, args.seconds, meter, source)
            after = redis_counters(nodes)
            chunks = max(1, r["sent"])
            r["redis_us_per_chunk"] = round(sum(
                v for k, v in r["cpu_us_per_chunk"].items() if k.startswith("redis")), 1)
            # the counters also cover the warm-up: per chunk over all chunks sent then
            sent_total = chunks * (args.warmup + args.seconds) / args.seconds
            r["redis_calls_per_chunk"] = round((after["calls"] - before["calls"]) / sent_total, 2)
            r["redis_net_bytes_per_chunk"] = round(
                (after["net_bytes"] - before["net_bytes"]) / sent_total)
            r["target"] = f"{'cluster x' + str(len(nodes)) if cluster else 'one redis'} {engine}"
            out.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
            await asyncio.sleep(2)
    finally:
        launcher.stop(gateway.proc, pool.proc)
    return out


def estimate(results: list[dict], masters: int) -> dict:
    """Sessions a cluster of ``masters`` primaries serves before Redis is the limit: the
    Redis CPU per chunk measured on the cluster at the largest null-engine level, taken
    as spread evenly over the primaries (a session's keys hash to one slot, sessions to
    all of them); one core per primary, CORE_BUSY of it usable; 5 chunks a second per
    session. The node that holds the control keys also runs admission and placement, a
    few tens of µs per new session (docs/benchmarks.md, "Placement"), left out."""
    runs = [r for r in results if r["target"].startswith("cluster") and "null" in r["target"]]
    if not runs:
        return {}
    top = max(runs, key=lambda r: r["streams"])
    per_chunk_us = top["redis_us_per_chunk"]
    chunks_per_core = CORE_BUSY * 1e6 / per_chunk_us
    per_master = chunks_per_core / CHUNKS_PER_SESSION_S
    return {"redis_us_per_chunk": per_chunk_us, "sessions_per_master": round(per_master),
            **{f"sessions_{n}_masters": round(per_master * n) for n in (masters, 6, 12)}}


def table(results: list[dict]) -> str:
    header = ["target", "streams", "lost", "ack P50 / P99 ms", "partial P50 / P99 ms",
              "gateway µs/chunk", "redis µs/chunk", "workers µs/chunk", "redis calls/chunk",
              "redis net B/chunk"]
    return markdown(header, (
        [r["target"], f"{r['connected']}/{r['streams']}", r["lost"],
         pair(r["ack_ms"], "p50", "p99", "-"), pair(r["partial_ms"], "p50", "p99", "-"),
         r["cpu_us_per_chunk"].get("gateway"), r["redis_us_per_chunk"],
         r["cpu_us_per_chunk"].get("workers"), r["redis_calls_per_chunk"],
         r["redis_net_bytes_per_chunk"]] for r in results))


async def main_async(args) -> dict:
    source = speech()
    levels = [int(x) for x in args.levels.split(",") if x]
    asr_levels = [int(x) for x in args.asr_levels.split(",") if x]
    report: dict = {"machine": machine(), "args": vars(args), "results": []}
    for name in ("one redis", "cluster"):
        manager = redis_cluster(3) if name == "cluster" else single_redis()
        with manager as c:
            for engine, lv in (("null", levels), ("pocketsphinx", asr_levels)):
                if lv:
                    report["results"] += await measure(c.url, name == "cluster", c.nodes,
                                                       engine, lv, args, source)
    report["estimate"] = estimate(report["results"], 3)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="100,200")
    ap.add_argument("--asr-levels", default="8")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    t0 = time.monotonic()
    report = asyncio.run(main_async(args))
    report["wall_s"] = round(time.monotonic() - t0, 1)
    print(table(report["results"]))
    print(json.dumps(report["estimate"]))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
