"""Languages: accuracy, language id, latency, cost and real-time capacity per language
mode of the whisper-live engine, in one run.

Modes: ``en`` (English speech, ``language: en``: tiny.en alone), ``zh`` (Mandarin speech,
``language: zh``: the multilingual model), ``auto-en`` (English speech, ``language: auto``)
and ``auto-zh`` (Mandarin speech, ``auto``). English speech is the single-sentence
fixtures (tests/fixtures/sentences.tsv, festival's slt voice), Mandarin the zh fixtures
(tests/fixtures/zh: a synthetic voice, clean speech).

* **Direct decode.** The engine alone in this process, each mode's fixtures as one session
  each (200 ms chunks, decodes inline): WER (Whisper's English normaliser) or CER (Chinese
  characters only, script aside), language id (finals of 2 s or more whose ``language``
  is the spoken one), whether the finals are written in Simplified characters, and CPU
  seconds per audio second.
* **One session through the service.** A fresh stack (embedded Redis, gateway,
  ``--workers`` worker processes) serves one real-time client of the mode for
  ``--seconds`` (sessions of one to three sentences back to back): the same accuracy
  figures, final and partial latency P50/P95 (as benchmarks/engines.py measures them),
  and the workers' CPU per audio second.
* **Capacity.** For each mix (``en``: English on ``auto``, ``zh``: Mandarin on ``auto``,
  ``mix``: half of each) and each level N of ``--levels``, N clients at once with the
  workers admitting N between them: the largest N whose final P95 < 800 ms and partial
  P95 < 1.5 s with no error.

    python benchmarks/languages.py [--workers 2] [--seconds 30]
        [--levels en=10,14,18 --levels zh=4,6,8 --levels mix=6,10,14] [--json-out F]

About 9 minutes with the defaults on a 2-core machine; every run stays under 15 minutes.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.engines import CHUNK_S, GAP, Client, _dist, meets  # noqa: E402
from benchmarks.report import markdown, pair, save_json  # noqa: E402
from benchmarks.stack import Stack, read_fixture  # noqa: E402
from benchmarks.transport import CpuMeter, machine  # noqa: E402
from cosyvoice.client import StreamingClient  # noqa: E402
from cosyvoice.text import script
from tests.helpers import (  # noqa: E402
    cer,
    corpus_wer,
    finals,
    fixture_texts,
    run_stream,
    zh_texts,
)

# mode -> (the session's language, the speech, the language spoken)
MODES = {"en": ("en", "en", "en"), "zh": ("zh", "zh", "zh"),
         "auto-en": ("auto", "en", "en"), "auto-zh": ("auto", "zh", "zh")}
DEFAULT_LEVELS = {"en": "10,14,18", "zh": "4,6,8", "mix": "6,10,14"}
MIN_ID_S = 2.0  # language id is scored on finals at least this long


def speech(which: str) -> dict[str, str]:
    return fixture_texts() if which == "en" else zh_texts()


def error_rate(which: str, refs: list[str], hyps: list[str]) -> float:
    if which == "zh":
        return round(cer(["".join(refs)], ["".join(hyps)]), 4)
    return round(corpus_wer(refs, hyps), 4)


def simplified(texts: list[str]) -> float:
    """Share of Chinese finals with no Traditional character."""
    zh = [t for t in texts if any("\u4e00" <= c <= "\u9fff" for c in t)]
    return round(sum(script.convert(t, "hans") == t for t in zh) / len(zh), 3) if zh else 1.0


class LanguageClient(Client):
    """engines.Client that keeps each final's language, span and text."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.ids: list[tuple[float, str]] = []  # (duration, language) of each final
        self.final_texts: list[str] = []

    def _collect(self, c: StreamingClient, last_seq: int) -> None:
        super()._collect(c, last_seq)
        for f in c.result.finals:
            if f["text"]:
                self.ids.append((f["end"] - f["start"], str(f.get("language"))))
                self.final_texts.append(f["text"])


def language_id(ids: list[tuple[float, str]], spoken: str) -> float | None:
    long = [lang for duration, lang in ids if duration >= MIN_ID_S]
    return round(sum(lang == spoken for lang in long) / len(long), 3) if long else None


def direct(mode: str) -> dict:
    from cosyvoice.asr import load_model
    from cosyvoice.settings import Settings

    language, which, spoken = MODES[mode]
    model = load_model("whisper-live", Settings(decode_batch=0))
    texts = speech(which)
    refs, hyps, ids, shown = [], [], [], []
    cpu = audio = 0.0
    for name, ref in sorted(texts.items()):
        pcm = read_fixture(name) + GAP
        c0 = time.process_time()
        results, _ = run_stream(model, pcm, language=language)
        cpu += time.process_time() - c0
        audio += len(pcm) / 32000
        got = [f for f in finals(results) if f["text"]]
        refs.append(ref)
        hyps.append(("" if which == "zh" else " ").join(f["text"] for f in got))
        ids += [(f["end"] - f["start"], f.get("language", "")) for f in got]
        shown += [f["text"] for f in got]
    return {"mode": mode, "error_rate": error_rate(which, refs, hyps),
            "language_id": language_id(ids, spoken),
            "cpu_per_audio_s": round(cpu / audio, 3), "sentences": len(texts),
            # the engine's own text: Simplified comes from the worker's script stage
            "simplified_before_stage": simplified(shown) if which == "zh" else None}


def serve(mixes: list[tuple[str, str]], workers: int, seconds: float) -> dict[str, Any]:
    """Clients at once, one per (session language, speech) of ``mixes``, for ``seconds``."""
    sessions = len(mixes)
    env = {"COSYVOICE_ENGINE": "whisper-live",
           "COSYVOICE_WORKER_CAPACITY": str(max(1, math.ceil(sessions / workers))),
           "COSYVOICE_MAX_SESSIONS_PER_CLIENT": "0"}
    with Stack(processes=workers, env=env) as stack:
        meter = CpuMeter({"workers": stack.pool.proc.pid})
        before = meter.sample()
        deadline = time.monotonic() + seconds
        clients = [LanguageClient(stack.url, deadline, k, speech(which), language)
                   for k, (language, which) in enumerate(mixes)]
        for client in clients:
            client.start()
            time.sleep(CHUNK_S / sessions)
        for client in clients:
            client.join(seconds + 120)
        after = meter.sample()
    wall = after["wall"] - before["wall"]
    errors = [e for c in clients for e in c.errors]
    out: dict[str, Any] = {
        "sessions": sessions,
        "completed_sessions": sum(c.sessions for c in clients),
        "partial_ms": _dist([x for c in clients for x in c.partial_ms]),
        "final_ms": _dist([x for c in clients for x in c.final_ms]),
        "errors": sorted(set(errors)),
        # every client streams in real time: the workers' cores per session are CPU
        # seconds per audio second
        "cpu_per_audio_s": round((after["workers"] - before["workers"]) / wall / sessions, 3),
    }
    out["meets"] = meets(errors, out["partial_ms"], out["final_ms"])
    out["clients"] = clients
    return out


def one_mode(mode: str, workers: int, seconds: float) -> dict:
    language, which, spoken = MODES[mode]
    run = serve([(language, which)], workers, seconds)
    (client,) = run.pop("clients")
    return {"mode": mode, "error_rate": error_rate(which, client.refs, client.hyps),
            "language_id": language_id(client.ids, spoken),
            "simplified": simplified(client.final_texts) if which == "zh" else None, **run}


def capacity(mix: str, levels: list[int], workers: int, seconds: float) -> dict:
    rows = []
    for n in levels:
        if mix == "mix":
            mixes = [("auto", "en" if k % 2 == 0 else "zh") for k in range(n)]
        else:
            mixes = [("auto", mix)] * n
        run = serve(mixes, workers, seconds)
        run.pop("clients")
        rows.append({"mix": mix, **run})
        print(f"capacity {mix} {n}: final {run['final_ms']} partial {run['partial_ms']} "
              f"meets {run['meets']}", flush=True)
    passing = [r["sessions"] for r in rows if r["meets"]]
    return {"mix": mix, "levels": rows, "capacity": max(passing) if passing else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--levels", action="append", default=[],
                    help="MIX=N,N,...: concurrent sessions to try (mixes: en, zh, mix)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    levels = dict(DEFAULT_LEVELS)
    for item in args.levels:
        mix, _, values = item.partition("=")
        levels[mix] = values
    started = time.monotonic()
    modes = [m for m in args.modes.split(",") if m]
    directs = [direct(m) for m in modes]
    print(markdown(["direct decode", "WER/CER", "language id", "CPU-s per audio-s",
                    "Simplified before the stage"],
                   [[d["mode"], d["error_rate"], d["language_id"], d["cpu_per_audio_s"],
                     d["simplified_before_stage"]] for d in directs]), flush=True)
    services = [one_mode(m, args.workers, args.seconds) for m in modes]
    print(markdown(["one session", "WER/CER", "language id", "Simplified",
                    "final P50/P95 ms", "partial P50/P95 ms", "CPU-s per audio-s", "sessions"],
                   [[s["mode"], s["error_rate"], s["language_id"], s["simplified"],
                     pair(s["final_ms"]), pair(s["partial_ms"]), s["cpu_per_audio_s"],
                     s["completed_sessions"]] for s in services]), flush=True)
    capacities = [capacity(mix, [int(x) for x in values.split(",") if x], args.workers,
                           args.seconds) for mix, values in levels.items() if values]
    print(markdown(["mix", "sessions", "final P50/P95 ms", "partial P50/P95 ms",
                    "CPU-s per audio-s", "meets"],
                   [[c["mix"], r["sessions"], pair(r["final_ms"]), pair(r["partial_ms"]),
                     r["cpu_per_audio_s"], r["meets"]] for c in capacities
                    for r in c["levels"]]))
    print(markdown(["mix", "capacity"], [[c["mix"], c["capacity"]] for c in capacities]))
    report = {"machine": machine(), "direct": directs, "service": services,
              "capacity": capacities, "seconds": round(time.monotonic() - started)}
    if args.json_out:
        save_json(args.json_out, report)
    print(f"done in {report['seconds']} s")


if __name__ == "__main__":
    main()
