"""Whisper finals: the torch backend against faster-whisper int8, same run, same audio.

For each backend (``torch``: openai-whisper on the memory-mapped fp32 checkpoint;
``ctranslate2``: faster-whisper, int8), in this order:

* **CPU per utterance.** In a fresh child process with one thread (as a worker runs it),
  for each of ``--cpu-variants`` (``VARIANTS``: ``torch-full``, the full 30 s window and
  fp32 decoder weights; ``torch-window``, the encoder window; ``torch``, the service's
  default, window and int8 text decoder; ``ctranslate2``; ``torch-fp32``, no bf16 math):
  CPU seconds to decode the first 3 s and the first 20 s of
  ``tests/fixtures/harvard_long.wav``, median of ``--repeats`` runs after one warm-up.
  ``--batch`` also decodes two 3 s clips as one batch (torch) against one after another.
* **Through the service, 2-pass mode.** A fresh stack (embedded Redis, gateway,
  ``--workers`` worker processes, engine ``2pass``, default capacity) serves every
  single-utterance fixture (1.7-2.6 s) and ``two_utterances`` (5.3 s) in real time,
  ``--concurrency`` sessions at once, ``--rounds`` times. Measured: ``last`` → final (from
  sending the ``last`` chunk to the final that covers it), and the finals' word error
  rate against the references (both through Whisper's English normaliser). The same
  sessions in ``pocketsphinx`` mode give PocketSphinx's WER on the same audio.
* **Memory.** A pool of 4 worker processes (``cosyvoice worker --processes 4``), each
  given one session so that it has touched every weight; total PSS of the pool's
  processes (parent included), read from ``/proc/<pid>/smaps_rollup``.

    python benchmarks/finals.py [--workers 2] [--concurrency 2] [--rounds 3] [--batch]
        [--cpu-variants torch-full,torch-window,torch,ctranslate2] [--cpu-only]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import wave
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.memory import pss_kb  # noqa: E402
from benchmarks.stack import FIXTURES, Stack, percentile, read_fixture  # noqa: E402
from benchmarks.transport import machine  # noqa: E402
from cosyvoice.asr import WHISPER_BACKENDS as BACKENDS  # noqa: E402
from cosyvoice.client import StreamingClient  # noqa: E402

RATE = 16000


def texts() -> dict[str, str]:
    out = {}
    for tsv in ("sentences.tsv", "harvard.tsv"):
        for line in (FIXTURES / tsv).read_text().splitlines():
            if line.strip():
                name, text = line.split("\t", 1)
                out[name] = text
    out["two_utterances"] = (FIXTURES / "two_utterances.txt").read_text().split("\t", 1)[1].strip()
    return out


def normalizer():
    import warnings

    from whisper.normalizers import EnglishTextNormalizer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        return EnglishTextNormalizer()


def corpus_wer(refs: list[str], hyps: list[str]) -> float:
    import jiwer
    norm = normalizer()
    return jiwer.wer([norm(r) for r in refs], [norm(h) for h in hyps])


# What each name measures (on top of the service's defaults: bf16 arithmetic where the CPU
# has it, encoder window floor 10 s, int8 text decoder).
VARIANTS: dict[str, dict[str, Any]] = {
    "torch-full": {"whisper_window_floor_s": 0, "whisper_int8_decoder": False},
    "torch-window": {"whisper_int8_decoder": False},
    "torch": {},
    "torch-fp32": {"whisper_cpu_bf16": False, "whisper_window_floor_s": 0,
                   "whisper_int8_decoder": False},
    "ctranslate2": {},
}
CPU_VARIANTS = "torch-full,torch-window,torch,ctranslate2"


def load_backend(name: str, model_dir: str):
    """A backend as a worker process loads it, with the settings VARIANTS names."""
    from cosyvoice.asr.whisper_engine import load_backend as load
    from cosyvoice.settings import Settings
    backend = load(Settings(whisper_backend=name.split("-")[0], whisper_threads=1,
                            model_dir=model_dir, **VARIANTS[name]))
    backend.after_fork()
    return backend


# ---- CPU per utterance ---------------------------------------------------------------------


def _cpu_child(name: str, model_dir: str, repeats: int, batch: bool, out) -> None:
    from cosyvoice.asr.whisper_engine import _float_audio
    with wave.open(str(FIXTURES / "harvard_long.wav"), "rb") as w:
        pcm = w.readframes(w.getnframes())
    backend = load_backend(name, model_dir)
    result: dict[str, Any] = {}
    clips = {"3s": pcm[:3 * RATE * 2], "20s": pcm[:20 * RATE * 2]}
    for label, clip in clips.items():
        audio = _float_audio(clip)
        backend.decode([audio])  # warm-up
        cpu = []
        for _ in range(repeats):
            c0 = time.process_time()
            text = backend.decode([audio])[0][0]
            cpu.append(time.process_time() - c0)
        result[label] = {"cpu_s": round(statistics.median(cpu), 3),
                         "runs": [round(c, 3) for c in cpu], "text": text}
    if batch and name == "torch":
        a = _float_audio(clips["3s"])
        c0 = time.process_time()
        for _ in range(repeats):
            backend.decode([a, a])
        together = (time.process_time() - c0) / repeats
        result["batch_of_two_3s_cpu_s"] = round(together, 3)
        result["two_3s_one_by_one_cpu_s"] = round(2 * result["3s"]["cpu_s"], 3)
    out.put(result)


def cpu_per_utterance(name: str, model_dir: str, repeats: int, batch: bool) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_cpu_child, args=(name, model_dir, repeats, batch, q))
    p.start()
    result = q.get(timeout=1800)
    p.join()
    return result


# ---- through the service -------------------------------------------------------------------


def one_session(url: str, name: str, mode: str) -> dict:
    c = StreamingClient(url, mode=mode)
    try:
        c.connect()
        c.stream_pcm(read_fixture(name), RATE, pace="realtime")
        if not c.wait_end(60):
            return {"name": name, "error": "no end"}
        last_seq = max(c.sent_at)
        sent = c.sent_at[last_seq]
        finals = [(t, d) for t, e, d in c.result.events
                  if e == "text" and d["type"] == "final" and d.get("seq") == last_seq]
        c.stop()
        return {"name": name, "text": c.result.text, "errors": c.result.errors,
                "last_to_final_ms": (finals[-1][0] - sent) * 1000 if finals else None,
                "engines": sorted({f.get("engine", "") for f in c.result.finals})}
    finally:
        c.close()


def service_run(url: str, names: list[str], mode: str, concurrency: int, rounds: int) -> list[dict]:
    jobs = [n for _ in range(rounds) for n in names]
    results: list[dict] = []
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                if not jobs:
                    return
                name = jobs.pop(0)
            r = one_session(url, name, mode)
            with lock:
                results.append(r)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def summarize(results: list[dict], refs: dict[str, str]) -> dict:
    lat = [r["last_to_final_ms"] for r in results if r.get("last_to_final_ms") is not None]
    ok = [r for r in results if "text" in r]
    return {
        "sessions": len(results),
        "errors": sum(1 for r in results if r.get("error") or r.get("errors")),
        "wer": round(corpus_wer([refs[r["name"]] for r in ok], [r["text"] for r in ok]), 4),
        "last_to_final_ms": {"p50": round(percentile(lat, 50)), "p95": round(percentile(lat, 95)),
                             "max": round(max(lat)) if lat else None, "n": len(lat)},
        "engines": sorted({e for r in ok for e in r["engines"]}),
    }


# ---- memory ---------------------------------------------------------------------------------


def pool_pss(backend: str, model_dir: str) -> dict:
    import psutil
    env = {"COSYVOICE_ENGINE": "2pass", "COSYVOICE_WHISPER_BACKEND": backend,
           "COSYVOICE_TWOPASS_PARTIALS": "pocketsphinx",  # the figures' partials
           "COSYVOICE_MODEL_DIR": model_dir, "COSYVOICE_MAX_SESSIONS_PER_CLIENT": "0"}
    with Stack(processes=4, env=env) as stack:
        threads = [threading.Thread(target=one_session, args=(stack.url, n, "2pass"))
                   for n in ("door", "call", "coffee", "weather")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        parent = psutil.Process(stack.pool.proc.pid)
        children = parent.children(recursive=True)  # workers and their finals processes
        kids = [pss_kb(c.pid) for c in children]
        return {"parent_mb": round(pss_kb(parent.pid) / 1024, 1),
                "children_mb": [round(k / 1024, 1) for k in kids],
                "total_mb": round((pss_kb(parent.pid) + sum(kids)) / 1024, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", action="store_true")
    ap.add_argument("--cpu-variants", default=CPU_VARIANTS,
                    help="backends (VARIANTS) whose CPU per utterance is measured")
    ap.add_argument("--cpu-only", action="store_true", help="skip the service and memory")
    ap.add_argument("--backends", default=",".join(BACKENDS),
                    help="backends measured through the service")
    ap.add_argument("--no-memory", action="store_true", help="skip the pool's PSS")
    ap.add_argument("--model-dir", default=os.environ.get("COSYVOICE_MODEL_DIR", ""))
    ap.add_argument("--json-out")
    args = ap.parse_args()

    from cosyvoice.asr import model_data
    model_dir = str(model_data.default_model_dir() if not args.model_dir else args.model_dir)
    model_data.convert(model_dir)
    refs = texts()
    names = sorted(refs)
    report: dict[str, Any] = {"machine": machine(), "args": vars(args), "cpu": {},
                              "backends": {}}
    for variant in [v for v in args.cpu_variants.split(",") if v]:
        report["cpu"][variant] = cpu_per_utterance(variant, model_dir, args.repeats,
                                                   args.batch)
        print(variant, "cpu", json.dumps(report["cpu"][variant]), flush=True)
    base = report["cpu"].get("torch-full")
    if base:
        print("\n| backend | CPU per 3 s final | CPU per 20 s final |\n|---|---|---|")
        for variant, r in report["cpu"].items():
            print(f"| {variant} | {r['3s']['cpu_s']:.2f} s "
                  f"({r['3s']['cpu_s'] / base['3s']['cpu_s']:.2f}×) | {r['20s']['cpu_s']:.2f} s "
                  f"({r['20s']['cpu_s'] / base['20s']['cpu_s']:.2f}×) |", flush=True)
    for backend in [] if args.cpu_only else args.backends.split(","):
        entry: dict[str, Any] = {}
        env = {"COSYVOICE_ENGINE": "2pass", "COSYVOICE_WHISPER_BACKEND": backend,
               "COSYVOICE_TWOPASS_PARTIALS": "pocketsphinx",  # the figures' partials
               "COSYVOICE_MODEL_DIR": model_dir, "COSYVOICE_MAX_SESSIONS_PER_CLIENT": "0"}
        with Stack(processes=args.workers, env=env) as stack:
            for mode in ("2pass", "pocketsphinx"):
                runs = service_run(stack.url, names, mode, args.concurrency, args.rounds)
                entry[mode] = summarize(runs, refs)
                print(backend, mode, json.dumps(entry[mode]), flush=True)
        if args.no_memory:
            report["backends"][backend] = entry
            continue
        entry["pool_pss_4_workers"] = pool_pss(backend, model_dir)
        print(backend, "pss", json.dumps(entry["pool_pss_4_workers"]), flush=True)
        report["backends"][backend] = entry
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
