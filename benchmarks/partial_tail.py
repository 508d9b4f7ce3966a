"""Partials of long utterances that decode only the audio after their committed segments,
or the whole utterance with its stable prefix forced: what each would save, against
re-decoding the whole open utterance (what whisper-live does).

A partial re-decodes the open utterance in an encoder window of the utterance plus 2 s
(7.5 s at least), so on continuous speech a partial late in a 12 s utterance costs about
three times an early one. The alternative measured here (whisper_streaming's): decode with
Whisper's timestamps, and once the undecided tail is longer than ``COMMIT_AFTER_S``, commit
the segments that end at least ``COMMIT_MARGIN_S`` before the end of the audio; later
partials decode only the audio after the last committed segment and show the committed
text before theirs. The other (the issue's "forced prefix"): decode the whole utterance,
but start the decoder with the tokens the last two partials agreed on, so only the rest is
searched.

The utterances are the first and second 12 s of ``harvard_long`` and ``long_unbroken``
(the longest recordings in the fixtures: an utterance of continuous speech runs to the
12 s pause cut), a partial every 1.5 s of each (the partial floor), in this process on one
thread: CPU per partial decode (encoder and decoder), and the WER of each utterance's last
partial against the whole utterance decoded at once (how far the live text strays).

    python benchmarks/partial_tail.py [--json-out F]

About a minute on a 2-core machine.
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
from tests.helpers import corpus_wer  # noqa: E402

BYTES_PER_S = 32000  # 16 kHz, 16-bit
UTTERANCE_S = 12.0
STEP_S = 1.5
COMMIT_AFTER_S = 4.0
COMMIT_MARGIN_S = 1.0
TIMESTAMP_TOKENS = 40  # room for the timestamp tokens a decode with them adds


class Decoder:
    """tiny.en greedy decodes as a partial's (7.5 s window floor), with or without Whisper's
    timestamps; ``decode`` returns its CPU time, text and (with timestamps) segments."""

    def __init__(self):
        from cosyvoice.asr.live_engine import LiveModel
        from cosyvoice.settings import Settings

        self.settings = Settings()
        self.dec = LiveModel(self.settings).decoder
        self.dec.load()
        self.tok = self.dec.tokenizer("en")

    def decode(self, pcm: bytes, timestamps: bool, forced: list[int] | None = None):
        """CPU time, text, segments and the text's tokens; ``forced``: tokens the decode
        must start with (the stable prefix), after the start-of-transcript ones."""
        from cosyvoice.asr.tiny_whisper import PAD_S

        tok, dec = self.tok, self.dec
        clip = dec.clip(pcm, self.settings.live_partial_window_s)
        started = time.process_time()
        encoded = dec._encode([clip])
        head = list(tok.sot_sequence) + ([] if timestamps else [tok.no_timestamps])
        head += forced or []
        cap = clip.cap + (TIMESTAMP_TOKENS if timestamps else 0) - len(forced or [])
        out = dec._wm.model.generate(encoded, [head], beam_size=1, max_length=len(head) + cap,
                                     suppress_blank=True, suppress_tokens=[-1])
        cpu = time.process_time() - started
        # the result starts with the forced tokens
        ids = [i for i in out[0].sequences_ids[0] if i != tok.eot]
        segments, words, start = [], [], None
        for i in ids:
            if i < tok.timestamp_begin:
                words.append(i)
                continue
            at = (i - tok.timestamp_begin) * 0.02 - PAD_S
            if start is None:
                start = at
            else:
                segments.append((start, at, tok.decode(words).strip()))
                words, start = [], None
        tokens = [i for i in ids if i < tok.timestamp_begin]
        return cpu, tok.decode(tokens).strip(), segments, tokens


def agreed(a: list[int], b: list[int]) -> list[int]:
    """The longest common prefix of two token lists."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json-out")
    args = ap.parse_args()
    d = Decoder()
    cpu = {"whole": 0.0, "forced": 0.0, "tail": 0.0}
    last: dict[str, list[str]] = {"whole": [], "forced": [], "tail": []}
    wholes, partials, commits = [], 0, 0
    for name in ("harvard_long", "long_unbroken"):
        pcm = read_fixture(name)
        for first in (0.0, UTTERANCE_S):
            utt = pcm[int(first * BYTES_PER_S):int((first + UTTERANCE_S) * BYTES_PER_S)]
            committed_s, committed = 0.0, ""
            before: list[list[int]] = [[], []]  # the last two forced partials' tokens
            k = 1
            while k * STEP_S <= UTTERANCE_S + 1e-6:
                so_far = utt[:int(k * STEP_S * BYTES_PER_S)]
                c, whole_text, _, _ = d.decode(so_far, timestamps=False)
                cpu["whole"] += c
                # the tokens the last two partials agree on, forced (LocalAgreement)
                stable = agreed(before[0], before[1])
                c, forced_text, _, tokens = d.decode(so_far, timestamps=False, forced=stable)
                cpu["forced"] += c
                before = [before[1], tokens]
                tail = so_far[2 * (int(committed_s * BYTES_PER_S) // 2):]
                c, tail_text, segments, _ = d.decode(tail, timestamps=True)
                cpu["tail"] += c
                partials += 1
                shown = f"{committed} {tail_text}".strip()
                tail_s = len(tail) / BYTES_PER_S
                if tail_s > COMMIT_AFTER_S:
                    done = [s for s in segments[:-1] if s[1] <= tail_s - COMMIT_MARGIN_S]
                    if done:
                        commits += 1
                        committed_s += done[-1][1]
                        committed = f"{committed} {' '.join(s[2] for s in done)}".strip()
                k += 1
            last["whole"].append(whole_text)
            last["forced"].append(forced_text)
            last["tail"].append(shown)
            wholes.append(d.decode(utt, timestamps=False)[1])
    rows: list[dict[str, Any]] = []
    for label, key in (("the whole open utterance (now)", "whole"),
                       ("the whole, its stable prefix forced", "forced"),
                       ("after the committed segments", "tail")):
        rows.append({"partials decode": label,
                     "cpu_ms": round(1000 * cpu[key] / partials, 1),
                     "wer": round(corpus_wer(wholes, last[key]), 4)})
        print(json.dumps(rows[-1]), file=sys.stderr)
    print(markdown(["partials decode", "CPU per partial", "last partial's WER against the "
                    "whole utterance decoded once"],
                   ([r["partials decode"], f"{r['cpu_ms']} ms", f"{100 * r['wer']:.1f} %"]
                    for r in rows)))
    print(f"{partials} partials of {len(wholes)} utterances; segments committed "
          f"{commits} times")
    if args.json_out:
        save_json(args.json_out, {"rows": rows, "partials": partials, "commits": commits})


if __name__ == "__main__":
    main()
