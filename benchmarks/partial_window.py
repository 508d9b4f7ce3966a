"""whisper-live's partial window: what each encoder-window floor costs and says.

Every single-sentence fixture (both groups) is decoded whole as a partial would be (greedy,
no prompt, a degenerate result dropped) with each floor in ``--floors``, in this process on
one thread: CPU per decode and corpus WER against the references (Whisper's English
normaliser on both sides). The encoder's cost grows with its window; below some floor
tiny.en starts repeating or dropping words. ``COSYVOICE_LIVE_PARTIAL_WINDOW_S`` is chosen
from this and a service run (docs/engines.md, "Partial window").

    python benchmarks/partial_window.py [--floors 10,7.5,6,5] [--json-out F]

Under a minute on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.stack import read_fixture  # noqa: E402
from tests.helpers import corpus_wer, fixture_texts, harvard_texts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--floors", default="10,7.5,6,5")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    from cosyvoice.asr.live_engine import LiveModel
    from cosyvoice.settings import Settings

    dec = LiveModel(Settings()).decoder
    refs = {**fixture_texts(), **harvard_texts()}
    names = sorted(refs)
    pcms = {n: read_fixture(n) for n in names}
    dec.decode(pcms[names[0]], beam_size=1, fallback=False)  # warm up
    out = {}
    print(f"{len(names)} files")
    print("| floor | CPU per decode | WER | empty |")
    print("|---|---|---|---|")
    for floor in (float(x) for x in args.floors.split(",")):
        t0 = time.process_time()
        hyps = [dec.decode(pcms[n], "", beam_size=1, floor_s=floor, fallback=False).text
                for n in names]
        cpu_ms = (time.process_time() - t0) / len(names) * 1000
        wer = corpus_wer([refs[n] for n in names], hyps)
        empty = sum(not h for h in hyps)
        out[floor] = {"cpu_ms": round(cpu_ms, 1), "wer": round(wer, 4), "empty": empty}
        print(f"| {floor:g} s | {cpu_ms:.1f} ms | {wer * 100:.1f} % | {empty} |", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
