"""The decode scheduler against one session at a time, in one run.

Each level N is a fresh stack (embedded Redis, gateway, ``--workers`` worker processes
admitting N sessions between them) serving N real-time clients replaying the fixtures
(benchmarks/engines.py's service level: 1-3 sentences a session, 0.5 s of silence between,
back to back for ``--seconds``). Two variants of whisper-live at every level:

- ``scheduled``: the worker process's decode scheduler (finals first, partials coalesced,
  up to ``--batch`` partials a batch; ``COSYVOICE_DECODE_BATCH``);
- ``inline``: ``COSYVOICE_DECODE_BATCH=0``, every decode in the worker's loop, one session
  after the other (the engine before the scheduler).

Per level: partial and final latency P50/P95, ``last`` → final, worker CPU per session,
WER, errors, and whether final P95 < 800 ms and partial P95 < 1.5 s hold. The summary gives
each variant's largest level that holds them and the ratio of the two.

    python benchmarks/batching.py [--levels 10,20,30,40] [--batch 4] [--workers 2]
        [--seconds 20] [--micro 1,2,4,8] [--json-out F]

First (``--micro``), in this process on one thread: the CPU per clip of tiny.en's encoder
pass and greedy ``generate`` at each batch size, and whether batching changed any clip's
tokens; this is what the scheduler's batch size and its one-clip-at-a-time encoder on the
CPU were chosen by.

About 6 minutes with the defaults on a 2-core machine (a level takes its seconds plus
the stack's start and the last sessions' end); every run stays under 15 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.engines import run_level  # noqa: E402
from benchmarks.stack import read_fixture  # noqa: E402
from benchmarks.transport import machine  # noqa: E402


def micro(sizes: list[int], repeat: int = 3) -> dict:
    """CPU seconds per clip of tiny.en's two steps at each batch size, in this process on
    one thread: ``encode`` of the sentence fixtures in their partial window and
    greedy ``generate`` after the same prompt; and whether any clip's tokens changed."""
    from cosyvoice.asr.live_engine import LiveModel
    from cosyvoice.settings import Settings
    from tests.helpers import fixture_texts

    dec = LiveModel(Settings()).decoder
    dec.load()
    names = sorted(fixture_texts())
    names = [names[i % len(names)] for i in range(max(sizes))]  # as many as the largest
    clips = [dec.clip(read_fixture(n), Settings().live_partial_window_s) for n in names]
    head = dec._prompt_tokens("The meeting starts at ten.")
    alone = [dec._generate(dec._encode([c]), [c], [head], 1, ["en"])[0].tokens for c in clips]
    out = {}
    for size in sizes:
        enc = gen = 0.0
        changed = 0
        for _ in range(repeat):
            for k in range(0, len(clips) - size + 1, size):
                batch = clips[k:k + size]
                t0 = time.process_time()
                encoded = dec._encode(batch, to_cpu=True)
                t1 = time.process_time()
                res = dec._generate(encoded, batch, [head] * size, 1, ["en"] * size)
                gen += time.process_time() - t1
                enc += t1 - t0
                changed += sum(r.tokens != a for r, a in zip(res, alone[k:k + size],
                                                              strict=True))
        n = repeat * (len(clips) // size) * size
        out[size] = {"encode_ms": round(enc / n * 1000, 1), "generate_ms": round(gen / n * 1000, 1),
                     "changed": changed}
        print(f"batch {size}: encode {out[size]['encode_ms']} ms, generate "
              f"{out[size]['generate_ms']} ms of CPU per clip; clips changed: {changed}",
              flush=True)
    return out


def variants(batch: int) -> dict[str, str]:
    return {"scheduled": f"whisper-live/decode_batch={batch}",
            "inline": "whisper-live/decode_batch=0"}


def row(name: str, level: dict) -> str:
    p, f, last = level["partial_ms"], level["final_ms"], level["last_to_final_ms"]
    return (f"| {name} | {level['sessions']} | {level['wer'] * 100:.1f} % | "
            f"{p.get('p50', '-')} / {p.get('p95', '-')} | {f.get('p50', '-')} / "
            f"{f.get('p95', '-')} | {last.get('p50', '-')} / {last.get('p95', '-')} | "
            f"{level['cpu_per_session']} | {level['error_count']} | "
            f"{'yes' if level['meets'] else 'no'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="10,20,30,40")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--micro", default="1,2,4,8",
                    help="batch sizes of the per-clip step costs measured first ('' skips)")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",") if x]
    out: dict = {"machine": machine(), "batch": args.batch, "workers": args.workers,
                 "seconds": args.seconds, "levels": {}}
    if args.micro:
        out["micro"] = micro([int(x) for x in args.micro.split(",")])
    print("| variant | sessions | service WER | partial P50 / P95 ms | final P50 / P95 ms | "
          "last → final P50 / P95 ms | worker CPU per session | errors | meets |")
    print("|---|---|---|---|---|---|---|---|---|")
    best: dict[str, int] = {}
    for n in levels:  # both variants at one level, one after the other
        for name, label in variants(args.batch).items():
            level = run_level(label, n, args.workers, args.seconds)
            out["levels"].setdefault(name, []).append(level)
            print(row(name, level), flush=True)
            if level["meets"]:
                best[name] = max(best.get(name, 0), n)
    out["largest_meeting"] = best
    sched, inline = best.get("scheduled", 0), best.get("inline", 0)
    out["ratio"] = round(sched / inline, 2) if inline else None
    print(f"largest level meeting the targets: scheduled {sched}, inline {inline}"
          + (f" ({sched / inline:.2f}x)" if inline else ""))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
