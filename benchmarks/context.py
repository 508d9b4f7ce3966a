"""Whisper finals with and without the session's previous text as their prompt.

A worker decodes each utterance the endpointer cuts on its own; on continuous speech that
costs Whisper the context the sentence before gives (names, the topic, where a sentence
that the endpointer cut in two goes on). The service gives each final after the first the
end of the session's finals so far as Whisper's prompt (``cosyvoice/text/finals.py``). This
measures what that buys and what it risks, on a passage of continuous speech read by
festival's ``cmu_us_slt_arctic_hts`` voice (synthesized on first use into ``--speech-dir``;
needs ``text2wave`` and ``sox``; a sentence at a time, with pauses of 0.2-0.8 s between
them), cut into utterances by the service's own endpointer (PocketSphinx, 200 ms chunks, as
a worker feeds them):

* WER of the whole passage (every final joined) against the text festival read;
* finals that repeat earlier text: a final holding four or more words in a row that an
  earlier final of the same run also holds (the passage itself repeats no four words);
* CPU per final.

Each backend is measured without and with the prompt in the same run.

    python benchmarks/context.py [--backends torch,ctranslate2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.finals import corpus_wer, load_backend, normalizer  # noqa: E402
from benchmarks.report import markdown  # noqa: E402
from benchmarks.window import read_wav, speak  # noqa: E402
from cosyvoice.asr import whisper_engine as we
from cosyvoice.text import finals

# Written for this benchmark: one speaker telling one story, with names and places that come
# back, sentences of different lengths, and commas where a reader pauses.
PASSAGE = (
    "Doctor Amelia Hartwell arrived in Ferncastle on a cold morning in early March. "
    "She had been sent by the county to find out why the river had turned brown, "
    "and she expected to stay for a week at most. "
    "The mayor, a tall man named Owen Pritchard, met her at the station with a folder of "
    "complaints. "
    "Farmers upstream blamed the paper mill, and the paper mill blamed the farmers. "
    "Hartwell listened to both sides before she said a word. "
    "Then she borrowed a boat, a pair of boots, and a box of sample jars. "
    "For three days she rowed from the mill to the old stone bridge and back again, "
    "filling jars at every bend. "
    "Pritchard came along on the second day, mostly to complain about the weather. "
    "By Friday the jars told a story that neither side wanted to hear. "
    "The brown water came from a collapsed drainage tunnel under the bridge itself, "
    "built a century ago and forgotten by everyone in Ferncastle. "
    "Hartwell wrote her report on the train home, and the mayor framed the first page."
)
N_GRAM = 4
# Pauses after each sentence, in turn (seconds).
PAUSES_S = (0.25, 0.6, 0.35, 0.8, 0.2, 0.5)


def synthesize(directory: Path) -> bytes:
    """The passage as 16 kHz PCM, made with festival once: each sentence read on its own,
    joined by the pauses of PAUSES_S in turn, as a reader breathes between sentences (the
    endpointer cuts at the longer ones, and at its length cap where none comes)."""
    directory.mkdir(parents=True, exist_ok=True)
    wav = directory / "passage.wav"
    if not wav.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            parts = []
            for i, sentence in enumerate(sentences(PASSAGE)):
                part = Path(tmp) / f"{i}.wav"
                speak(sentence, part, PAUSES_S[i % len(PAUSES_S)])
                parts.append(str(part))
            subprocess.run(["sox", *parts, str(wav)], check=True, capture_output=True)
    return read_wav(wav)


def sentences(text: str) -> list[str]:
    return [s.strip() + "." for s in text.split(". ") if s.strip(" .")]


def utterances(pcm: bytes) -> list[bytes]:
    """The passage cut by the service's endpointer, as a worker feeds it."""
    from cosyvoice.asr.whisper_engine import TwoPassModel
    from cosyvoice.settings import Settings
    from cosyvoice.text.finals import InlineFinals
    from cosyvoice.wire.audio import split_chunks

    model = TwoPassModel(Settings(engine="2pass", twopass_partials="pocketsphinx"),
                         backend=object())
    out: list[bytes] = []

    def keep(audio: bytes, prompt: str) -> str:  # each final's audio, not decoded
        out.append(audio)
        return ""

    model.finals = InlineFinals(keep)
    stream = model.stream(16000, mode="2pass")
    for chunk in split_chunks(pcm, 16000):
        stream.feed(chunk, 16000)
    stream.flush()
    return [a for a in out if a]


def repeats(hyps: list[str]) -> int:
    """Finals holding N_GRAM words in a row that an earlier final holds."""
    norm = normalizer()
    seen: set[tuple[str, ...]] = set()
    count = 0
    for hyp in hyps:
        words = norm(hyp).split()
        grams = {tuple(words[i:i + N_GRAM]) for i in range(len(words) - N_GRAM + 1)}
        count += bool(grams & seen)
        seen |= grams
    return count


def run(backend, audios: list, prompted: bool) -> dict:
    hyps, cpu, prompt = [], [], ""
    for audio in audios:
        c0 = time.process_time()
        text = backend.decode([we._float_audio(audio)], prompt if prompted else "")[0][0]
        cpu.append(time.process_time() - c0)
        hyps.append(text)
        prompt = finals.next_prompt(prompt, text)
    return {"hyps": hyps, "cpu_s": statistics.mean(cpu)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="torch,ctranslate2")
    ap.add_argument("--speech-dir", default=str(Path.home() / ".cache" / "cosyvoice"
                                                / "bench-speech" / "passage"))
    ap.add_argument("--model-dir", default="")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    audios = utterances(synthesize(Path(args.speech_dir)))
    durations = [len(a) / 2 / we.MODEL_RATE for a in audios]
    print(f"{len(audios)} utterances, {min(durations):.1f}-{max(durations):.1f} s, "
          f"{sum(durations):.0f} s of speech; the passage repeats "
          f"{repeats(sentences(PASSAGE))} runs of {N_GRAM} words", flush=True)
    rows = []
    for name in args.backends.split(","):
        backend = load_backend(name, args.model_dir)
        backend.decode([we._float_audio(audios[0])])  # warm-up
        for prompted in (False, True):
            r = run(backend, audios, prompted)
            rows.append({"backend": name, "prompt": prompted,
                         "wer": round(corpus_wer([PASSAGE], [" ".join(r["hyps"])]), 4),
                         "repeats": repeats(r["hyps"]), "cpu_s": round(r["cpu_s"], 3),
                         "hyps": r["hyps"]})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "hyps"}), flush=True)

    def cells(r: dict) -> list:
        base = next(b for b in rows if b["backend"] == r["backend"] and not b["prompt"])
        return [r["backend"], "previous finals" if r["prompt"] else "none", f"{r['wer']:.1%}",
                f"{r['repeats']} of {len(audios)}",
                f"{r['cpu_s']:.2f} s ({r['cpu_s'] / base['cpu_s']:.2f}×)"]

    print()
    print(markdown(["backend", "prompt", "WER", "finals repeating earlier text",
                    "CPU per final"], map(cells, rows)))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "durations_s": durations},
                                              indent=2))


if __name__ == "__main__":
    main()
