"""whisper-live's partials with and without the session's prompt: what each costs and says.

A session's finals are decoded with its previous finals as Whisper's prompt (their last
200 characters). Partials were decoded with it too. Here every single-sentence fixture
(both groups, in name order, as one session) is decoded whole as a partial would be
(greedy, the 7.5 s window floor, a degenerate result dropped), once with the prompt the
session would have by then (the sentences before it as its finals, ``next_prompt``; the
first sentence gets the long fixture's text) and once with none, in this process on one
thread: CPU per decode, corpus WER against the references (Whisper's English normaliser
on both sides) and the partials that came out empty (dropped: no live text).

    python benchmarks/partial_prompt.py [--json-out F]

Under a minute on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import markdown, save_json  # noqa: E402
from benchmarks.stack import read_fixture  # noqa: E402
from tests.helpers import FIXTURES, corpus_wer, fixture_texts, harvard_texts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json-out")
    args = ap.parse_args()
    from cosyvoice.asr.live_engine import LiveModel
    from cosyvoice.settings import Settings
    from cosyvoice.text.finals import next_prompt

    settings = Settings()
    dec = LiveModel(settings).decoder
    dec.load()
    refs = {**fixture_texts(), **harvard_texts()}
    names = sorted(refs)
    first = (FIXTURES / "long_unbroken.txt").read_text().split("\t", 1)[1].strip()
    prompts, prompt = [], next_prompt("", first)
    for n in names:
        prompts.append(prompt)
        prompt = next_prompt(prompt, refs[n])
    rows: list[dict[str, Any]] = []
    for label, use in (("session prompt", True), ("no prompt", False)):
        hyps, cpu = [], 0.0
        for n, p in zip(names, prompts, strict=True):
            clip = dec.clip(read_fixture(n), settings.live_partial_window_s)
            started = time.process_time()
            out = dec.decode_partials([clip], [p if use else ""])[0]
            cpu += time.process_time() - started
            hyps.append(out.text)
        rows.append({"partials": label, "cpu_ms": round(1000 * cpu / len(names), 1),
                     "wer": round(corpus_wer([refs[n] for n in names], hyps), 4),
                     "empty": sum(1 for h in hyps if not h.strip()), "decodes": len(names)})
        print(json.dumps(rows[-1]), file=sys.stderr)
    print(markdown(["partials", "CPU per decode", "WER", "empty"],
                   ([r["partials"], f"{r['cpu_ms']} ms", f"{100 * r['wer']:.1f} %",
                     f"{r['empty']} of {r['decodes']}"] for r in rows)))
    if args.json_out:
        save_json(args.json_out, {"rows": rows})


if __name__ == "__main__":
    main()
