"""Sessions per GPU: the whole service on one host, its workers decoding on the GPU, under
many real-time sessions of real speech.

For each model (``en``: English speech, ``language: en``, decoded by tiny.en; ``zh``:
Mandarin speech, ``language: zh``, decoded by the multilingual model), each decode batch
size of ``--batches`` and each level of ``--levels``, a fresh stack (embedded Redis, the
gunicorn gateway, a pool of ``--workers`` worker processes with ``COSYVOICE_DEVICE``
set to ``--device`` and a capacity that admits the largest level) serves that many
sessions from the lean load generator (``benchmarks/sioload.py``, the transport
benchmark's: one asyncio loop, raw WebSocket frames, a 200 ms chunk every 200 ms a
session). After ``--warmup`` it records for ``--seconds``:

- final latency (from the send of the chunk holding a final's end to the final, as
  benchmarks/engines.py measures it) and partial latency, P50/P95;
- the GPU's utilisation and memory in use (``nvidia-smi``, sampled each second; none
  where there is no NVIDIA GPU);
- the host's CPU per session (gateway, Redis and workers, in cores), and the load
  generator's own;
- errors (a refusal, a lost chunk) and sessions that did not connect.

A level holds when every session connected, no error came, final P95 < 800 ms and partial
P95 < 1.5 s (the service's targets); the levels of a batch size stop at the first that
does not. The report names, per model, the largest level that held and the batch size
that held it.

    python benchmarks/gpu.py [--device cuda] [--models en,zh]
        [--levels 50,100,200,400,800] [--batches 4,16,32] [--workers 4]
        [--seconds 30] [--warmup 10] [--json-out FILE]

Without a GPU it runs the same path on the CPU with a tiny load, which checks the
benchmark itself (about 3 minutes on a 2-core machine):

    python benchmarks/gpu.py --device cpu --models en --levels 2,4 --batches 4 --seconds 15

The GPU path needs CTranslate2 with CUDA (the ``Dockerfile.cuda`` image has it); every
run stays under 15 minutes with the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.engines import _dist  # noqa: E402
from benchmarks.report import markdown, pair  # noqa: E402
from benchmarks.sioload import ChunkSource, LoadGenerator  # noqa: E402
from benchmarks.stack import Stack, read_fixture  # noqa: E402
from benchmarks.transport import CpuMeter, machine  # noqa: E402
from tests.helpers import fixture_texts, zh_texts  # noqa: E402

FINAL_P95_MS = 800.0
PARTIAL_P95_MS = 1500.0
# model -> (the session's language, the speech's fixtures)
MODELS = {"en": ("en", lambda: sorted(fixture_texts())),
          "zh": ("zh", lambda: sorted(zh_texts()))}


def speech(model: str) -> ChunkSource:
    """The model's fixtures back to back, each followed by 0.5 s of silence (an endpoint
    between sentences), looped by the generator."""
    silence = b"\x00\x00" * 8000
    return ChunkSource(b"".join(read_fixture(n) + silence for n in MODELS[model][1]()))


class GpuSampler(threading.Thread):
    """``nvidia-smi``'s utilisation (%) and memory used (MiB) each second while it runs;
    nothing where there is no ``nvidia-smi`` or it answers nothing."""

    def __init__(self):
        super().__init__(daemon=True)
        self.util: list[float] = []
        self.memory_mib: list[float] = []
        self.name = ""
        self._done = threading.Event()
        self.smi = shutil.which("nvidia-smi")

    def query(self) -> list[str] | None:
        if not self.smi:
            return None
        try:
            out = subprocess.run([self.smi, "--query-gpu=name,utilization.gpu,memory.used",
                                  "--format=csv,noheader,nounits"], capture_output=True,
                                 text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        line = out.strip().splitlines()[0] if out.strip() else ""
        fields = [f.strip() for f in line.split(",")]
        return fields if len(fields) == 3 else None

    def run(self) -> None:
        while not self._done.wait(1.0):
            fields = self.query()
            if fields:
                self.name = fields[0]
                self.util.append(float(fields[1]))
                self.memory_mib.append(float(fields[2]))

    def stop(self) -> dict:
        self._done.set()
        self.join(10)
        if not self.util:
            return {}
        return {"name": self.name, "util_mean": round(sum(self.util) / len(self.util), 1),
                "util_max": max(self.util), "memory_max_mib": max(self.memory_mib)}


def holds(r: dict) -> bool:
    return (r["connected"] == r["sessions"] and not r["errors"]
            and r["final_ms"].get("p95", math.inf) < FINAL_P95_MS
            and r["partial_ms"].get("p95", math.inf) < PARTIAL_P95_MS)


async def run_level(stack: Stack, n: int, model: str, source: ChunkSource, warmup: float,
                    seconds: float) -> dict:
    gen = LoadGenerator("127.0.0.1", stack.port, source,
                        auth={"sample_rate": source.rate, "language": MODELS[model][0]})
    meter = CpuMeter({"gateway": stack.gateway.proc.pid, "redis": stack.redis_pid,
                      "workers": stack.pool.proc.pid})
    connected = await gen.open(n)
    gen.start()
    await asyncio.sleep(warmup)
    gpu = GpuSampler()
    gpu.start()
    before = meter.sample()
    gen.record(True)
    await asyncio.sleep(seconds)
    gen.record(False)
    after = meter.sample()
    lost = await gen.halt()
    gpu_stats = gpu.stop()
    await gen.close()
    m = gen.measures
    wall = after["wall"] - before["wall"]
    cores = {k: (after[k] - before[k]) / wall for k in after if k != "wall"}
    host = cores["gateway"] + cores["redis"] + cores["workers"]
    errors = dict(m.errors)
    if lost:
        errors["lost chunks"] = lost
    return {"sessions": n, "connected": connected, "seconds": round(wall, 1),
            "final_ms": _dist(list(m.final_ms)), "partial_ms": _dist(list(m.partial_ms)),
            "errors": errors, "gpu": gpu_stats,
            "host_cores": round(host, 3),
            "host_cores_per_session": round(host / max(1, connected), 4),
            "workers_cores": round(cores["workers"], 3),
            "generator_cores": round(cores["generator"], 3)}


async def run_model(model: str, batch: int, levels: list[int], args) -> list[dict]:
    env = {"COSYVOICE_DEVICE": args.device, "COSYVOICE_DECODE_BATCH": str(batch),
           "COSYVOICE_WORKER_CAPACITY": str(math.ceil(max(levels) / args.workers) + 1),
           "COSYVOICE_MAX_SESSIONS_PER_CLIENT": "0"}
    source = speech(model)
    results = []
    with Stack(processes=args.workers, env=env) as stack:
        for n in levels:
            r = await run_level(stack, n, model, source, args.warmup, args.seconds)
            r.update(model=model, batch=batch, holds=holds(r))
            results.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
            if not r["holds"]:
                break
            await asyncio.sleep(3)  # the stopped sessions leave the workers
    return results


def table(results: list[dict]) -> str:
    header = ["model", "batch", "sessions", "final P50 / P95 ms", "partial P50 / P95 ms",
              "GPU util mean / max %", "GPU memory MiB", "host cores per session",
              "errors", "holds"]
    return markdown(header, (
        [r["model"], r["batch"], f"{r['connected']}/{r['sessions']}",
         pair(r["final_ms"], "p50", "p95", "-"), pair(r["partial_ms"], "p50", "p95", "-"),
         f"{r['gpu']['util_mean']} / {r['gpu']['util_max']}" if r["gpu"] else "-",
         r["gpu"].get("memory_max_mib", "-") if r["gpu"] else "-",
         r["host_cores_per_session"], sum(r["errors"].values()),
         "yes" if r["holds"] else "no"] for r in results))


def best(results: list[dict]) -> dict[str, dict | None]:
    """Per model, the largest level that held and the batch size that held it."""
    out: dict[str, dict | None] = {}
    for model in dict.fromkeys(r["model"] for r in results):
        held = [r for r in results if r["model"] == model and r["holds"]]
        top = max(held, key=lambda r: (r["sessions"], -r["final_ms"]["p95"]), default=None)
        out[model] = None if top is None else {"sessions": top["sessions"],
                                               "batch": top["batch"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="COSYVOICE_DEVICE of the workers")
    ap.add_argument("--models", default="en,zh", help="en (tiny.en), zh (multilingual)")
    ap.add_argument("--levels", default="50,100,200,400,800")
    ap.add_argument("--batches", default="4,16,32",
                    help="COSYVOICE_DECODE_BATCH values, each its own run of the levels")
    ap.add_argument("--workers", type=int, default=4, help="worker processes")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    results: list[dict] = []
    started = time.monotonic()
    for model in args.models.split(","):
        if model not in MODELS:
            ap.error(f"--models: {model!r} is not one of {', '.join(MODELS)}")
        for batch in (int(x) for x in args.batches.split(",")):
            results += asyncio.run(run_model(model, batch, levels, args))
    report = {"machine": machine(), "args": vars(args), "results": results,
              "best": best(results), "minutes": round((time.monotonic() - started) / 60, 1)}
    gpu = next((r["gpu"]["name"] for r in results if r["gpu"]), None)
    print(table(results))
    print(f"\ndevice {args.device} ({gpu or 'no NVIDIA GPU seen'}); the largest level that "
          f"held, per model: {json.dumps(report['best'])}; {report['minutes']} min")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
