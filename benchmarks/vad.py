"""Which voice activity detector ends utterances: PocketSphinx's ``Vad`` or Silero VAD.

Both run over the same audio through the same endpoint rule (the project's ``Endpointer``:
a start when ``COSYVOICE_ENDPOINT_RATIO`` of the last ``COSYVOICE_ENDPOINT_WINDOW_S`` is
speech, an end when as much is not), frame by frame as a live session feeds them.

Audio: every single-sentence fixture followed by 1 s of silence (one utterance each),
``two_utterances`` (two), and the silence, pink-noise and tone fixtures (none). Counted
per detector: missed utterances (fewer segments than expected), false ones (more: a
sentence split in two, or speech found in noise), and CPU seconds per second of audio.

    python benchmarks/vad.py
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.stack import read_fixture  # noqa: E402
from cosyvoice.asr.endpointer import Endpointer, SileroVad, silero_session  # noqa: E402
from cosyvoice.settings import Settings  # noqa: E402
from tests.helpers import fixture_texts, harvard_texts  # noqa: E402

SILENCE_1S = b"\x00\x00" * 16000


def cases() -> list[tuple[str, bytes, int]]:
    out = [(name, read_fixture(name) + SILENCE_1S, 1)
           for name in [*fixture_texts(), *harvard_texts()]]
    out.append(("two_utterances", read_fixture("two_utterances") + SILENCE_1S, 2))
    out += [(n, read_fixture(n), 0) for n in ("silence", "noise", "tone")]
    return out


def pocketsphinx_segments(pcm: bytes, settings: Settings, vad=None) -> int:
    ep = Endpointer(window_s=settings.endpoint_window_s, ratio=settings.endpoint_ratio, vad=vad)
    found = 0
    for i in range(0, len(pcm) - ep.frame_bytes + 1, ep.frame_bytes):
        was = ep.in_speech
        ep.process(pcm[i:i + ep.frame_bytes])
        found += (not was) and ep.in_speech
    return found


_SESSION: list = []


def silero_segments(pcm: bytes, settings: Settings) -> int:
    if not _SESSION:
        _SESSION.append(silero_session())
    return pocketsphinx_segments(pcm, settings, SileroVad(_SESSION[0]))


def main() -> None:
    settings = Settings()
    report = {}
    all_cases = cases()
    audio_s = sum(len(pcm) / 32000 for _n, pcm, _e in all_cases)
    for name, detector in (("pocketsphinx", pocketsphinx_segments), ("silero", silero_segments)):
        detector(all_cases[0][1], settings)  # load and warm up
        missed = false = 0
        details = {}
        c0 = time.process_time()
        for case, pcm, expected in all_cases:
            found = detector(pcm, settings)
            missed += max(0, expected - found)
            false += max(0, found - expected)
            details[case] = found
        cpu = time.process_time() - c0
        report[name] = {"missed": missed, "false": false,
                        "cpu_per_audio_s": round(cpu / audio_s, 5), "found": details}
    print(json.dumps(report, indent=1), file=sys.stderr)
    print("| VAD | missed utterances | false utterances | CPU-s per audio-s |")
    print("|---|---|---|---|")
    for name, r in report.items():
        print(f"| {name} | {r['missed']} | {r['false']} | {r['cpu_per_audio_s']} |")
    print(f"\n{len(all_cases)} files, {sum(e for _n, _p, e in all_cases)} utterances, "
          f"{audio_s:.0f} s of audio")


if __name__ == "__main__":
    main()
