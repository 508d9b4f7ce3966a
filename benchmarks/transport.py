"""Transport throughput: gateway + Redis + the ``null`` engine under many real-time streams.

For each level (default 100, 200, 400 and 800 concurrent streams) the lean load
generator (``benchmarks/sioload.py``) opens that many Socket.IO connections, each
sending one 200 ms chunk of real speech every 200 ms; after a warm-up it records for
``--seconds``: chunks sent, acknowledged and lost (sent, never acked), ack latency, the
latency to the ``null`` engine's partial result for each chunk, error events, and the
CPU time of every process (gateway, Redis, workers, the generator itself).

In the same run and at the same levels it drives a bare Flask-SocketIO echo app on the
same server stack (``benchmarks/echo_server.py``), and reports the gateway's CPU per
chunk as a multiple of that floor.

    python benchmarks/transport.py [--levels 100,200,400,800] [--seconds 60]
        [--warmup 5] [--workers 1] [--gateway-processes N] [--no-echo] [--stock-echo]
        [--json-out FILE]

A level "holds" when every stream connected, no chunk was lost, no error event came and
ack P99 < 100 ms; the report names the first level that does not.

The gateway is the production one: gunicorn with the shipped gunicorn.conf.py and
``--gateway-processes`` processes (1000 connections each, its ``worker_connections``);
``--gateway-processes 0`` runs one ``cosyvoice gateway`` process instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import markdown, pair  # noqa: E402
from benchmarks.sioload import ChunkSource, LoadGenerator  # noqa: E402
from benchmarks.stack import Stack, fixture_names, percentile, read_fixture  # noqa: E402
from cosyvoice.store.embedded_redis import free_port  # noqa: E402
from tests import launcher  # noqa: E402
from tests.launcher import wait_http  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ACK_P99_TARGET_MS = 100.0


class CpuMeter:
    """CPU seconds (user + system) of a set of processes, children included."""

    def __init__(self, pids: dict[str, int]):
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}

    def sample(self) -> dict[str, float]:
        out = {}
        for name, proc in self.procs.items():
            total = 0.0
            for p in [proc, *proc.children(recursive=True)]:
                try:
                    t = p.cpu_times()
                    total += t.user + t.system
                except psutil.NoSuchProcess:
                    pass
            out[name] = total
        t = os.times()
        out["generator"] = t.user + t.system
        out["wall"] = time.monotonic()
        return out


def speech() -> ChunkSource:
    silence = b"\x00\x00" * 8000
    return ChunkSource(b"".join(read_fixture(n) + silence for n in fixture_names()))


async def run_level(port: int, n: int, warmup: float, seconds: float, meter: CpuMeter,
                    source: ChunkSource) -> dict:
    gen = LoadGenerator("127.0.0.1", port, source)
    t0 = time.monotonic()
    connected = await gen.open(n)
    connect_s = time.monotonic() - t0
    gen.start()
    await asyncio.sleep(warmup)
    before = meter.sample()
    gen.record(True)
    await asyncio.sleep(seconds)
    gen.record(False)
    after = meter.sample()
    lost = await gen.halt()
    await gen.close()
    m = gen.measures
    wall = after["wall"] - before["wall"]
    cpu = {k: round((after[k] - before[k]) / wall, 3) for k in after if k != "wall"}
    chunks = max(1, m.sent)
    return {
        "streams": n, "connected": connected, "connect_s": round(connect_s, 2),
        "seconds": round(wall, 1), "sent": m.sent, "acked": m.acked, "lost": lost,
        "chunks_per_s": round(m.sent / wall, 1),
        "ack_ms": _dist(m.ack_ms), "partial_ms": _dist(m.partial_ms),
        "errors": dict(m.errors),
        "cpu_cores": cpu,
        "cpu_us_per_chunk": {k: round(v * wall / chunks * 1e6, 1) for k, v in cpu.items()},
        "generator_timer_lag_ms": _dist(m.timer_lag_ms),
    }


def _dist(values) -> dict:
    if not len(values):
        return {"n": 0}
    return {"n": len(values), "p50": round(percentile(values, 50), 2),
            "p99": round(percentile(values, 99), 2), "max": round(max(values), 2)}


def holds(r: dict) -> bool:
    return (r["connected"] == r["streams"] and r["lost"] == 0 and not r["errors"]
            and r["ack_ms"].get("p99", float("inf")) < ACK_P99_TARGET_MS)


def start_echo(stock: bool) -> tuple[subprocess.Popen, int]:
    port = free_port()
    args = [sys.executable, str(ROOT / "benchmarks" / "echo_server.py"), "--port", str(port)]
    if stock:
        args.append("--stock-unmask")
    proc = subprocess.Popen(args, cwd=ROOT, start_new_session=True)
    wait_http(f"http://127.0.0.1:{port}/healthz", proc, timeout=60)
    return proc, port


def machine() -> dict:
    import platform
    model = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "load_avg_at_start": [round(x, 2) for x in os.getloadavg()]}


def table(results: list[dict]) -> str:
    header = ["target", "streams", "chunks/s", "lost", "ack P50 / P99 ms",
              "partial P50 / P99 ms", "server CPU µs/chunk", "ratio to echo",
              "generator cores", "holds"]
    return markdown(header, (
        [r["target"], f"{r['connected']}/{r['streams']}", r["chunks_per_s"], r["lost"],
         pair(r["ack_ms"], "p50", "p99", "-"), pair(r["partial_ms"], "p50", "p99", "-"),
         r["cpu_us_per_chunk"].get("server", "-"),
         "" if r.get("ratio_to_echo") is None else r["ratio_to_echo"],
         r["cpu_cores"]["generator"], "yes" if holds(r) else "no"] for r in results))


async def main_async(args) -> dict:
    source = speech()
    levels = [int(x) for x in args.levels.split(",")]
    env = {"COSYVOICE_ENGINE": "null", "COSYVOICE_WORKER_CAPACITY": str(max(levels) + 100),
           "COSYVOICE_MAX_SESSIONS_PER_CLIENT": "0"}
    report = {"machine": machine(), "args": vars(args), "results": []}
    with Stack(processes=args.workers, env=env,
               gateway_processes=args.gateway_processes) as stack:
        gw_meter = CpuMeter({"server": stack.gateway.proc.pid, "redis": stack.redis_pid,
                             "workers": stack.pool.proc.pid})
        echo = start_echo(stock=False) if not args.no_echo else None
        stock = start_echo(stock=True) if args.stock_echo else None
        try:
            for n in levels:
                r = await run_level(stack.port, n, args.warmup, args.seconds, gw_meter, source)
                r["target"] = "gateway"
                report["results"].append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
                await asyncio.sleep(2)  # stopped sessions leave the workers
                for target, server in (("echo", echo), ("echo, stock unmask", stock)):
                    if server is None:
                        continue
                    e = await run_level(server[1], n, args.warmup, args.seconds,
                                        CpuMeter({"server": server[0].pid}), source)
                    e["target"] = target
                    if target == "echo":
                        floor = e["cpu_us_per_chunk"]["server"]
                        r["ratio_to_echo"] = round(r["cpu_us_per_chunk"]["server"] / floor, 2)
                    report["results"].append(e)
                    print(json.dumps(e), file=sys.stderr, flush=True)
        finally:
            for server in (echo, stock):
                if server is not None:
                    launcher.stop(server[0])
    gateway = [r for r in report["results"] if r["target"] == "gateway"]
    broken = [r["streams"] for r in gateway if not holds(r)]
    report["breaks_at"] = broken[0] if broken else None
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="100,200,400,800")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--workers", type=int, default=1, help="null-engine worker processes")
    ap.add_argument("--gateway-processes", type=int, default=1,
                    help="gateway processes under gunicorn with the shipped gunicorn.conf.py "
                         "(0: one `cosyvoice gateway` process instead)")
    ap.add_argument("--no-echo", action="store_true", help="skip the echo comparison")
    ap.add_argument("--stock-echo", action="store_true",
                    help="also run the echo app with gevent-websocket's own unmasking")
    ap.add_argument("--json-out", help="write the full report here too")
    args = ap.parse_args()
    report = asyncio.run(main_async(args))
    print(table(report["results"]))
    print(f"\nfirst level that does not hold: {report['breaks_at'] or 'none'}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
