"""The engines side by side: accuracy, latency, cost and real-time capacity, in one run.

For each engine in ``--engines`` (default: pocketsphinx, whisper-live, 2pass):

* **Direct decode.** The engine alone in this process decodes every single-sentence fixture
  chunk by chunk (200 ms) as a session would: corpus WER per fixture group (the sentences
  written for PocketSphinx; the Harvard sentences; Whisper's English normaliser on both
  sides), and CPU seconds per second of audio. For ``2pass`` the Whisper final of each
  utterance is decoded by the model's ``transcribe`` in this process, as the finals
  process would.
* **Through the service.** For each level N in the engine's ``--levels``, a fresh stack
  (embedded Redis, gateway, ``--workers`` worker processes admitting N sessions between
  them) serves N clients at once, each replaying the fixtures in real time, one to three
  utterances per session with 0.5 s of silence between, for ``--seconds``. Measured:

  - WER of every session's transcript against its references;
  - partial latency: for every chunk of an utterance, from when it was sent to the first
    text (partial or final) that covers it;
  - final latency: from the send of the chunk holding the utterance's end to its final;
    ``last`` → final: from the send of the ``last`` chunk to the session's last final;
  - CPU of the worker processes per session (cores / N).

  A level meets the targets when final P95 < 800 ms and partial P95 < 1500 ms with no
  error; the engine's capacity is the largest level that does.
* **One session.** ``last`` → final with one session at a time, each fixture streamed in
  real time with nothing after its speech (the final waits for no endpoint).

    python benchmarks/engines.py [--engines pocketsphinx,whisper-live,2pass]
        [--levels whisper-live=4,8,12,16] [--workers 2] [--seconds 40] [--json-out F]

An engine may be a variant, ``ENGINE/SETTING=VALUE/...``: ``whisper-live/live_beam_size=1``
is whisper-live with greedy finals (its levels: ``--levels whisper-live/live_beam_size=1=8``
or, when not given, the engine's).

Each run finishes within 15 minutes with the defaults on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.stack import Stack, percentile, read_fixture  # noqa: E402
from benchmarks.transport import CpuMeter, machine  # noqa: E402
from cosyvoice.client import StreamingClient  # noqa: E402
from cosyvoice.wire.audio import split_chunks  # noqa: E402
from tests.helpers import (  # noqa: E402
    corpus_wer,
    finals,
    fixture_texts,
    harvard_texts,
    run_stream,
)

FINAL_P95_TARGET_MS = 800.0
PARTIAL_P95_TARGET_MS = 1500.0
GAP = b"\x00\x00" * 8000  # 0.5 s of silence
CHUNK_S = 0.2
DEFAULT_LEVELS = {"pocketsphinx": "4,8,12,16", "whisper-live": "4,8,12,16", "2pass": "2,4"}


def groups() -> dict[str, dict[str, str]]:
    return {"sentences": fixture_texts(), "harvard": harvard_texts()}


# ---- direct decode ----------------------------------------------------------------------


def _decode(model, pcm: bytes) -> str:
    # 2-pass: each final decoded inline, after the text before it, as the finals process
    # would decode it
    return " ".join(r["text"] for r in finals(run_stream(model, pcm)[0]) if r["text"])


def variant(label: str) -> tuple[str, dict[str, str]]:
    """``engine`` or ``engine/KEY=VALUE/...`` (KEY: a setting, as in COSYVOICE_KEY): the
    engine and the settings that make the variant."""
    engine, *pairs = label.split("/")
    return engine, dict(pair.split("=", 1) for pair in pairs)


def direct(label: str) -> dict:
    from cosyvoice.asr.calibrate import load_here
    from cosyvoice.settings import Settings

    engine, overrides = variant(label)
    env = {f"COSYVOICE_{k.upper()}": v for k, v in overrides.items()}
    model = load_here(Settings.from_env(env, engine=engine))
    _decode(model, read_fixture("weather"))  # warm up
    out: dict[str, Any] = {}
    cpu = audio = 0.0
    for group, texts in groups().items():
        names = sorted(texts)
        c0 = time.process_time()
        hyps = [_decode(model, read_fixture(n)) for n in names]
        cpu += time.process_time() - c0
        audio += sum(len(read_fixture(n)) / 32000 for n in names)
        out[f"wer_{group}"] = round(corpus_wer([texts[n] for n in names], hyps), 4)
    out["cpu_per_audio_s"] = round(cpu / audio, 4)
    return out


# ---- through the service ----------------------------------------------------------------


class Client(threading.Thread):
    """One microphone: real-time sessions back to back until the deadline."""

    def __init__(self, url: str, deadline: float, seed: int, texts: dict[str, str],
                 language: str | None = None):
        super().__init__(daemon=True)
        self.url, self.deadline, self.texts = url, deadline, texts
        self.language = language  # auth.language (None: the server's default)
        self.rng = random.Random(seed)
        self.partial_ms: list[float] = []
        self.final_ms: list[float] = []
        self.last_ms: list[float] = []
        self.refs: list[str] = []
        self.hyps: list[str] = []
        self.errors: list[str] = []
        self.sessions = 0

    def run(self) -> None:
        while time.monotonic() < self.deadline:
            names = self.rng.sample(sorted(self.texts), self.rng.randint(1, 3))
            self._session(names)

    def _session(self, names: list[str]) -> None:
        pcm = GAP.join(read_fixture(n) for n in names) + GAP
        c = StreamingClient(self.url, language=self.language)
        try:
            if not self._connect(c):
                return
            c.stream_pcm(pcm, 16000, pace="realtime")
            c.wait_end(60)
            self._collect(c, len(split_chunks(pcm, 16000)) - 1)
            # Mandarin references (tests/fixtures/zh) join without spaces
            joiner = "" if names[0].startswith("zh/") else " "
            self.refs.append(joiner.join(self.texts[n] for n in names))
            self.hyps.append(c.result.text)
            c.stop()
        except Exception as exc:  # noqa: BLE001 - counted, the run goes on
            self.errors.append(f"client: {exc}")
        finally:
            c.close()

    def _connect(self, c: StreamingClient) -> bool:
        """Open the session; False: there is none to stream (benchmarks/admission.py)."""
        c.connect()
        return True

    def _collect(self, c: StreamingClient, last_seq: int) -> None:
        self.sessions += 1
        self.errors.extend(str(e.get("code")) for e in c.result.errors)
        texts = [(t, d) for t, e, d in c.result.events if e == "text"]
        covered = -1  # the last chunk a text so far covered
        for t, d in texts:
            first = max(covered + 1, int(d["start"] / CHUNK_S))
            for k in range(first, d["seq"] + 1):
                if k in c.sent_at:
                    self.partial_ms.append((t - c.sent_at[k]) * 1000)
            covered = max(covered, d["seq"])
            if d["type"] == "final":
                end_chunk = max(0, math.ceil(d["end"] / CHUNK_S) - 1)
                if end_chunk in c.sent_at and end_chunk <= d["seq"]:
                    self.final_ms.append((t - c.sent_at[end_chunk]) * 1000)
        finals = [t for t, d in texts if d["type"] == "final"]
        if finals and last_seq in c.sent_at:
            self.last_ms.append(max(0.0, finals[-1] - c.sent_at[last_seq]) * 1000)


def one_session(label: str, workers: int) -> dict:
    """``last`` → final for one session at a time: each sentence fixture streamed in real
    time with nothing after its speech, from the send of ``last`` to its final."""
    engine, overrides = variant(label)
    env = {"COSYVOICE_ENGINE": engine,
           **{f"COSYVOICE_{k.upper()}": v for k, v in overrides.items()}}
    out: list[float] = []
    with Stack(processes=workers, env=env) as stack:
        for group in groups().values():
            for name in sorted(group):
                c = StreamingClient(stack.url)
                try:
                    c.connect()
                    c.stream_pcm(read_fixture(name), 16000, pace="realtime")
                    c.wait_end(30)
                    last = max(c.sent_at)
                    finals = [t for t, e, d in c.result.events
                              if e == "text" and d["type"] == "final"]
                    if finals:
                        out.append(max(0.0, finals[-1] - c.sent_at[last]) * 1000)
                    c.stop()
                finally:
                    c.close()
    return _dist(out)


def _dist(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": round(percentile(values, 50)),
            "p95": round(percentile(values, 95))}


def run_level(label: str, sessions: int, workers: int, seconds: float) -> dict:
    engine, overrides = variant(label)
    per_process = max(1, math.ceil(sessions / workers))
    env = {"COSYVOICE_ENGINE": engine, "COSYVOICE_WORKER_CAPACITY": str(per_process),
           "COSYVOICE_MAX_SESSIONS_PER_CLIENT": "0",
           **{f"COSYVOICE_{k.upper()}": v for k, v in overrides.items()}}
    texts = {k: v for group in groups().values() for k, v in group.items()}
    with Stack(processes=workers, env=env) as stack:
        meter = CpuMeter({"gateway": stack.gateway.proc.pid, "workers": stack.pool.proc.pid,
                          "redis": stack.redis_pid})
        before = meter.sample()
        deadline = time.monotonic() + seconds
        clients = [Client(stack.url, deadline, seed=k, texts=texts) for k in range(sessions)]
        for client in clients:
            client.start()
            time.sleep(CHUNK_S / sessions)  # spread the chunk phases over the period
        for client in clients:
            client.join(seconds + 120)
        after = meter.sample()
    wall = after["wall"] - before["wall"]
    errors = [e for c in clients for e in c.errors]
    worker_cores = (after["workers"] - before["workers"]) / wall
    level: dict[str, Any] = {
        "engine": label, "sessions": sessions, "per_process": per_process,
        "completed_sessions": sum(c.sessions for c in clients),
        "wer": round(corpus_wer([r for c in clients for r in c.refs],
                                [h for c in clients for h in c.hyps]), 4),
        "partial_ms": _dist([x for c in clients for x in c.partial_ms]),
        "final_ms": _dist([x for c in clients for x in c.final_ms]),
        "last_to_final_ms": _dist([x for c in clients for x in c.last_ms]),
        "errors": sorted(set(errors)), "error_count": len(errors),
        "worker_cores": round(worker_cores, 2),
        "cpu_per_session": round(worker_cores / sessions, 3),
    }
    level["meets"] = meets(errors, level["partial_ms"], level["final_ms"])
    return level


def meets(errors: list, partial: dict, final: dict) -> bool:
    """No errors, and partial and final P95 within the targets."""
    return (not errors and partial["n"] > 0 and final["n"] > 0
            and partial["p95"] < PARTIAL_P95_TARGET_MS and final["p95"] < FINAL_P95_TARGET_MS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="pocketsphinx,whisper-live,2pass")
    ap.add_argument("--levels", action="append", default=[],
                    help="ENGINE=N,N,...: concurrent sessions to try (repeatable)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    levels_of = dict(DEFAULT_LEVELS)
    levels_of.update(dict(item.rsplit("=", 1) for item in args.levels))
    report: dict[str, Any] = {"machine": machine(), "args": vars(args), "engines": {}}
    for engine in args.engines.split(","):
        entry: dict[str, Any] = {"direct": direct(engine), "levels": []}
        report["engines"][engine] = entry
        entry["one_session_last_to_final_ms"] = one_session(engine, args.workers)
        print(json.dumps({engine: entry["direct"],
                          "one_session_last_to_final_ms": entry["one_session_last_to_final_ms"]}),
              file=sys.stderr, flush=True)
        levels = levels_of.get(engine) or levels_of[variant(engine)[0]]
        for n in (int(x) for x in levels.split(",")):
            level = run_level(engine, n, args.workers, args.seconds)
            entry["levels"].append(level)
            print(json.dumps(level), file=sys.stderr, flush=True)
            if not level["meets"]:
                break  # the next level would not meet them either
        met = [lv["sessions"] for lv in entry["levels"] if lv["meets"]]
        entry["capacity_sessions"] = max(met) if met else 0
    print("| engine | direct WER sentences / Harvard | CPU-s per audio-s | sessions "
          "| service WER | partial P50 / P95 ms | final P50 / P95 ms | last → final P50 / P95 ms "
          "| worker CPU per session | meets |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for engine, entry in report["engines"].items():
        d = entry["direct"]
        for lv in entry["levels"]:
            p, f, last = lv["partial_ms"], lv["final_ms"], lv["last_to_final_ms"]
            print(f"| {engine} | {d['wer_sentences']:.1%} / {d['wer_harvard']:.1%} "
                  f"| {d['cpu_per_audio_s']} | {lv['sessions']} | {lv['wer']:.1%} "
                  f"| {p.get('p50')} / {p.get('p95')} | {f.get('p50')} / {f.get('p95')} "
                  f"| {last.get('p50')} / {last.get('p95')} | {lv['cpu_per_session']} "
                  f"| {'yes' if lv['meets'] else 'no'} |")
    for engine, entry in report["engines"].items():
        one = entry["one_session_last_to_final_ms"]
        print(f"{engine}: largest level meeting the targets: {entry['capacity_sessions']}; "
              f"one session alone, last → final P50 {one.get('p50')} / P95 {one.get('p95')} ms")
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
