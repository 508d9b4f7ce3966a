"""Speaker labels: how right they are, live and for whole files, and what they cost.

Conversations of 2, 3 and 4 voices (festival's slt, kal and ked from
tests/fixtures/speakers, and the Mandarin voice of tests/fixtures/zh as the fourth) are
built from the fixtures: turns of one to three sentences of one voice (about 1.5 to 8 s),
0.3 to 1.5 s of silence between turns and one turn in five with none (the sentences'
own silence trimmed). A fresh stack (embedded Redis, gateway, ``--workers`` whisper-live
worker processes) serves each conversation twice at once, in real time: once with
``diarize: "file"`` and once without labels, ``--parallel`` conversations at a time.

Per conversation: the share of words whose label is their true voice after the best
mapping of labels to voices (live: as the labels came, ``relabel`` events applied; file:
``speakers.recluster`` on the whole session's voice vectors at its end), the diarization
error rate by time (10 ms frames of the reference speech: missed, false alarm and
confusion over the reference speech, each final's span labelled by its nearest word),
and the number of speakers found. Over all: the final latency P50/P95 of the labelled
sessions against their unlabelled twins (the chunk that ends a final's speech sent →
its text received), and the speaker embedder's CPU seconds per second of conversation
(the workers' ``cosyvoice_speaker_embed_cpu_seconds`` over the labelled audio).

    python benchmarks/speakers.py [--per-size 3] [--workers 2] [--parallel 3] [--seed 2026]
        [--embedder thread|inline] [--json-out F]

About 3 minutes with the defaults on a 2-core machine, 5 with ``--per-size 5``; every run
stays under 15 minutes (each conversation is about 50 s of real time).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import random
import sys
import threading
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.engines import CHUNK_S, _dist  # noqa: E402
from benchmarks.report import markdown, pair, save_json  # noqa: E402
from benchmarks.stack import Stack, percentile  # noqa: E402
from benchmarks.transport import machine  # noqa: E402
from cosyvoice.client import StreamingClient  # noqa: E402
from cosyvoice.text import speakers
from tests.helpers import attributed, read_pcm, speaker_texts, zh_texts  # noqa: E402
from tests.stack import scrape  # noqa: E402

RATE = 16000
FRAME_S = 0.01
TURN_GAP = (0.3, 1.5)  # silence between turns, seconds
NO_GAP = 0.2  # share of turns that follow the one before without a gap
IN_TURN_GAP_S = 0.15  # between the sentences of one turn (no endpoint)
TURNS = 10


def voices() -> dict[str, list[tuple[str, str]]]:
    """voice -> [(fixture, text)]"""
    out: dict[str, list[tuple[str, str]]] = {}
    for name, (voice, text) in speaker_texts().items():
        out.setdefault(voice, []).append((name, text))
    out["zh"] = list(zh_texts().items())
    return out


def trimmed(name: str) -> np.ndarray:
    """A fixture without the silence at its ends (30 ms kept)."""
    x = np.frombuffer(read_pcm(name), dtype="<i2")
    loud = np.flatnonzero(np.abs(x) > 150)
    keep = int(0.03 * RATE)
    return x[max(0, loud[0] - keep):loud[-1] + 1 + keep] if len(loud) else x


def conversation(who: list[str], rng: random.Random) -> tuple[bytes, list[tuple]]:
    """The PCM of a conversation among ``who`` and its truth, (voice, start, end, text)
    per turn."""
    pools = voices()
    order: list[str] = []
    for i in range(TURNS):
        choices = [v for v in who if not order or v != order[-1]]
        order.append(who[i] if i < len(who) else rng.choice(choices))
    parts = [np.zeros(int(0.5 * RATE), dtype="<i2")]
    at = len(parts[0])
    truth = []
    for i, voice in enumerate(order):
        picked = rng.sample(pools[voice], rng.randint(1, 3))
        start = at
        for k, (name, _) in enumerate(picked):
            if k:
                gap = np.zeros(int(IN_TURN_GAP_S * RATE), dtype="<i2")
                parts.append(gap)
                at += len(gap)
            x = trimmed(name)
            parts.append(x)
            at += len(x)
        sep = "" if voice == "zh" else " "
        truth.append((voice, start / RATE, at / RATE, sep.join(t for _, t in picked)))
        if i < len(order) - 1:
            gap_s = 0.0 if rng.random() < NO_GAP else rng.uniform(*TURN_GAP)
            gap = np.zeros(int(gap_s * RATE), dtype="<i2")
            parts.append(gap)
            at += len(gap)
    parts.append(np.zeros(RATE, dtype="<i2"))
    return np.concatenate(parts).tobytes(), truth


# ---- scoring (the words' share: tests.helpers.attributed, as the tests score) -----------

def der(finals: list[dict], truth: list[tuple]) -> float:
    """Diarization error rate by time over the reference speech (see the docstring)."""
    end = max(max(t[2] for t in truth), max((float(f["end"]) for f in finals), default=0))
    n = int(math.ceil(end / FRAME_S)) + 1
    ref = np.full(n, "", dtype=object)
    for voice, s, e, _ in truth:
        ref[int(s / FRAME_S):int(e / FRAME_S)] = voice
    hyp = np.full(n, "", dtype=object)
    for f in finals:
        words = [(float(w["start"]), float(w["end"]), w.get("speaker", ""))
                 for w in f.get("words") or []]
        if not words:
            continue
        for k in range(int(float(f["start"]) / FRAME_S), int(float(f["end"]) / FRAME_S)):
            t = k * FRAME_S
            hyp[k] = min(words, key=lambda w: 0 if w[0] <= t <= w[1]
                         else min(abs(t - w[0]), abs(t - w[1])))[2]
    both = (ref != "") & (hyp != "")
    mapping = speakers.best_mapping(list(ref[both]), list(hyp[both]))
    speech = int((ref != "").sum())
    missed = int(((ref != "") & (hyp == "")).sum())
    false_alarm = int(((ref == "") & (hyp != "")).sum())
    confused = int(sum(mapping.get(h) != r for r, h in zip(ref[both], hyp[both], strict=True)))
    return (missed + false_alarm + confused) / max(1, speech)


def final_ms(c: StreamingClient) -> dict[float, float]:
    """The chunk that ends each final's speech sent → the final received, in ms (as
    benchmarks/engines.py measures finals), by the final's end time."""
    out = {}
    for t, event, d in c.result.events:
        if event == "text" and d["type"] == "final":
            end_chunk = max(0, math.ceil(d["end"] / CHUNK_S) - 1)
            if end_chunk in c.sent_at and end_chunk <= d["seq"]:
                out[round(float(d["end"]), 2)] = (t - c.sent_at[end_chunk]) * 1000
    return out


# ---- the run ----------------------------------------------------------------------------

def stream(url: str, pcm: bytes, language: str, out: dict, key: str, **options) -> None:
    shown: list[dict] = []  # each final as it came, before any relabel

    def seen(event: str, data: Any) -> None:
        if event == "text" and data["type"] == "final":
            shown.append(copy.deepcopy(dict(data)))
    c = StreamingClient(url, language=language, on_event=seen, **options)
    try:
        c.connect()
        c.stream_pcm(pcm, RATE, pace="realtime")
        c.wait_end(120)
        out[key] = {"finals": [dict(f) for f in c.result.finals], "shown": shown,
                    "relabels": len(c.result.relabels), "final_ms": final_ms(c),
                    "errors": [str(e.get("code")) for e in c.result.errors]}
        c.stop()
    except Exception as exc:  # noqa: BLE001 - counted, the run goes on
        out[key] = {"finals": [], "shown": [], "relabels": 0, "final_ms": {},
                    "errors": [f"client: {exc}"]}
    finally:
        c.close()


def speaker_counters(url: str) -> tuple[float, float]:
    m = scrape(url)
    return (m.get("cosyvoice_speaker_embed_cpu_seconds_total", 0.0),
            m.get("cosyvoice_speaker_embed_audio_seconds_total", 0.0))


def run(per_size: int, workers: int, parallel: int, seed: int,
        embedder: str = "thread") -> dict:
    rng = random.Random(seed)
    plans = []
    for size in (2, 3, 4):
        for _ in range(per_size):
            who = (rng.sample(["slt", "kal", "ked"], 2) if size == 2 else
                   ["slt", "kal", "ked"] if size == 3 else ["slt", "kal", "ked", "zh"])
            rng.shuffle(who)
            plans.append((size, who, *conversation(who, rng)))
    # a fixed capacity: this measures labels, not admission (a Mandarin-heavy batch would
    # otherwise be refused in part, benchmarks/admission.py measures that)
    env = {"COSYVOICE_ENGINE": "whisper-live", "COSYVOICE_MAX_SESSIONS_PER_CLIENT": "0",
           "COSYVOICE_SPEAKER_EMBEDDER": embedder,
           "COSYVOICE_WORKER_CAPACITY": str(math.ceil(2 * parallel / workers))}
    rows: list[dict] = []
    with Stack(processes=workers, env=env, metrics=True) as stack:
        metrics_url = stack.pool.metrics_url
        assert metrics_url is not None
        cpu0, embedded0 = speaker_counters(metrics_url)
        for i in range(0, len(plans), parallel):
            batch = plans[i:i + parallel]
            results: list[dict] = [{} for _ in batch]
            threads = []
            for (_, who, pcm, _), out in zip(batch, results, strict=True):
                language = "auto" if "zh" in who else "en"
                threads += [threading.Thread(target=stream, args=(stack.url, pcm, language,
                                                                  out, "labelled"),
                                             kwargs={"diarize": "file"}),
                            threading.Thread(target=stream, args=(stack.url, pcm, language,
                                                                  out, "plain"))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            for (size, who, pcm, truth), out in zip(batch, results, strict=True):
                live = out["labelled"]["finals"]
                began = time.process_time()
                whole = speakers.recluster(live) if live else []
                file_cpu_ms = (time.process_time() - began) * 1000
                rows.append({
                    "voices": size, "who": who, "seconds": round(len(pcm) / 2 / RATE, 1),
                    "turns": len(truth), "finals": len(live),
                    "shown_words": round(attributed(out["labelled"]["shown"], truth), 4),
                    "relabels": out["labelled"]["relabels"],
                    "live_words": round(attributed(live, truth), 4),
                    "file_words": round(attributed(whole, truth), 4),
                    "live_der": round(der(live, truth), 4),
                    "file_der": round(der(whole, truth), 4),
                    "live_found": len({f.get("speaker") for f in live if f.get("text")}),
                    "file_found": len({f.get("speaker") for f in whole if f.get("text")}),
                    "file_cpu_ms": round(file_cpu_ms, 1),
                    "labelled_ms": list(out["labelled"]["final_ms"].values()),
                    "plain_ms": list(out["plain"]["final_ms"].values()),
                    # the same final (same end) of the twin sessions: labelled - plain
                    "extra_ms": [out["labelled"]["final_ms"][k] - ms
                                 for k, ms in out["plain"]["final_ms"].items()
                                 if k in out["labelled"]["final_ms"]],
                    "errors": out["labelled"]["errors"] + out["plain"]["errors"]})
        cpu1, embedded1 = speaker_counters(metrics_url)
    audio_s = sum(r["seconds"] for r in rows)
    return {"rows": rows, "embed_cpu_s": round(cpu1 - cpu0, 2),
            "embedded_audio_s": round(embedded1 - embedded0, 1), "audio_s": round(audio_s, 1),
            "cpu_per_audio_s": round((cpu1 - cpu0) / audio_s, 4) if audio_s else None}


def mean_min(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows]
    return f"{100 * sum(values) / len(values):.1f} % (min {100 * min(values):.1f})"


def summary(report: dict) -> str:
    out = []
    rows = report["rows"]
    header = ["voices", "conversations", "words right as first shown",
              "words right, live (relabels applied)", "words right, file",
              "DER live", "DER file", "speakers right live / file"]
    table = []
    for size in (2, 3, 4):
        mine = [r for r in rows if r["voices"] == size]
        if not mine:
            continue
        table.append([size, len(mine), mean_min(mine, "shown_words"),
                      mean_min(mine, "live_words"),
                      mean_min(mine, "file_words"),
                      f"{100 * sum(r['live_der'] for r in mine) / len(mine):.1f} %",
                      f"{100 * sum(r['file_der'] for r in mine) / len(mine):.1f} %",
                      f"{sum(r['live_found'] == size for r in mine)} / "
                      f"{sum(r['file_found'] == size for r in mine)} of {len(mine)}"])
    out.append(markdown(header, table))
    labelled = _dist([ms for r in rows for ms in r["labelled_ms"]])
    plain = _dist([ms for r in rows for ms in r["plain_ms"]])
    extra = [ms for r in rows for ms in r["extra_ms"]]
    out.append("")
    out.append(markdown(["sessions", "final latency P50 / P95 (ms)", "finals"],
                        [["with labels", pair(labelled), labelled.get("n")],
                         ["without (the same audio, at the same time)", pair(plain),
                          plain.get("n")]]))
    if extra:
        out.append("")
        out.append(f"labels' extra latency, final by final against the twin session: P50 "
                   f"{percentile(extra, 50):.0f} ms, P95 {percentile(extra, 95):.0f} ms "
                   f"({len(extra)} pairs)")
    out.append("")
    out.append(f"embedder: {report['embed_cpu_s']} CPU-s for {report['audio_s']} s of "
               f"labelled conversation ({report['embedded_audio_s']} s of it embedded, "
               f"partial guesses included): {report['cpu_per_audio_s']} CPU-s per audio "
               f"second")
    out.append(f"whole-file clustering at the client: at most "
               f"{max(r['file_cpu_ms'] for r in rows)} ms of CPU a conversation")
    out.append(f"relabel events: {sum(r['relabels'] for r in rows)} over "
               f"{sum(r['finals'] for r in rows)} finals")
    errors = [e for r in rows for e in r["errors"]]
    out.append(f"errors: {errors or 'none'}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-size", type=int, default=3, help="conversations of each size")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=3,
                    help="conversations at once (each twice: with and without labels)")
    # the thresholds were chosen on the conversations of seeds 7 and 11: this one is new
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--embedder", choices=("thread", "inline"), default="thread",
                    help="COSYVOICE_SPEAKER_EMBEDDER: voice vectors on a thread of their own "
                         "while the text decodes, or in the worker's loop")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    began = time.monotonic()
    report = {"machine": machine(), "args": vars(args),
              **run(args.per_size, args.workers, args.parallel, args.seed, args.embedder)}
    report["wall_s"] = round(time.monotonic() - began, 1)
    print(summary(report))
    print(f"wall {report['wall_s']} s")
    if args.json_out:
        save_json(args.json_out, report)


if __name__ == "__main__":
    main()
