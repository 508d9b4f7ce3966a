"""Whisper's encoder window: word error rate, runaway outputs and CPU per final by floor.

The torch backend decodes each final in the smallest encoder window that holds the
utterance plus 1 s, never below a floor (``COSYVOICE_WHISPER_WINDOW_FLOOR_S``). This
measures what each floor costs and breaks, on 40 read sentences (Harvard lists 1-4,
1.5-3.5 s) spoken by festival's ``cmu_us_slt_arctic_hts`` voice, synthesized on first
use into ``--speech-dir`` (needs ``text2wave`` and ``sox``):

* **stock**: openai-whisper's greedy decode in the floor's window with no safety net (its
  default cap of 224 tokens): WER, how many finals are degenerate (Whisper's compression
  ratio rule, or more tokens than the cap the service would set), CPU per final;
* **service**: ``TorchWhisper.decode`` as a worker runs it with that floor, safety nets
  on (token cap from the duration, a degenerate final decoded again in the full window):
  WER, finals decoded again, CPU per final.

Floor 0 is the full 30 s window (the baseline of the same run). One process, one
thread, bf16 arithmetic where the CPU has it, as a worker process runs it.

    python benchmarks/window.py [--floors 0,6,8,10,12,15,20] [--variant torch-window]
        [--json out.json]
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
import wave
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.finals import corpus_wer, load_backend  # noqa: E402
from benchmarks.report import markdown  # noqa: E402
from cosyvoice.asr import whisper_engine as we

SENTENCES = [
    # Harvard sentences, lists 1-4 (IEEE 1969), public domain
    "The birch canoe slid on the smooth planks.",
    "Glue the sheet to the dark blue background.",
    "It's easy to tell the depth of a well.",
    "These days a chicken leg is a rare dish.",
    "Rice is often served in round bowls.",
    "The juice of lemons makes fine punch.",
    "The box was thrown beside the parked truck.",
    "The hogs were fed chopped corn and garbage.",
    "Four hours of steady work faced us.",
    "A large size in stockings is hard to sell.",
    "The boy was there when the sun rose.",
    "A rod is used to catch pink salmon.",
    "The source of the huge river is the clear spring.",
    "Kick the ball straight and follow through.",
    "Help the woman get back to her feet.",
    "A pot of tea helps to pass the evening.",
    "Smoky fires lack flame and heat.",
    "The soft cushion broke the man's fall.",
    "The salt breeze came across from the sea.",
    "The girl at the booth sold fifty bonds.",
    "The small pup gnawed a hole in the sock.",
    "The fish twisted and turned on the bent hook.",
    "Press the pants and sew a button on the vest.",
    "The swan dive was far short of perfect.",
    "The beauty of the view stunned the young boy.",
    "Two blue fish swam in the tank.",
    "Her purse was full of useless trash.",
    "The colt reared and threw the tall rider.",
    "It snowed, rained, and hailed the same morning.",
    "Read verse out loud for pleasure.",
    "Hoist the load to your left shoulder.",
    "Take the winding path to reach the lake.",
    "Note closely the size of the gas tank.",
    "Wipe the grease off his dirty face.",
    "Mend the coat before you go out.",
    "The wrist was badly strained and hung limp.",
    "The stray cat gave birth to kittens.",
    "The young girl gave no clear response.",
    "The meal was cooked before the bell rang.",
    "What joy there is in living.",
]


def speak(text: str, wav: Path, pause_s: float = 0.0) -> None:
    """``text`` read by festival's cmu_us_slt_arctic_hts voice into ``wav`` (16 kHz mono
    16-bit), followed by ``pause_s`` of silence."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "x.wav"
        subprocess.run(["text2wave", "-eval", "(voice_cmu_us_slt_arctic_hts)", "-o", str(raw)],
                       input=text.encode(), check=True, capture_output=True)
        pad = ["pad", "0", str(pause_s)] if pause_s else []
        subprocess.run(["sox", str(raw), "-r", "16000", "-c", "1", "-b", "16", str(wav), *pad],
                       check=True, capture_output=True)


def read_wav(wav: Path) -> bytes:
    with wave.open(str(wav), "rb") as w:
        return w.readframes(w.getnframes())


def synthesize(directory: Path) -> list[tuple[str, bytes]]:
    """(reference, 16 kHz PCM) of every sentence, made with festival once."""
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for i, text in enumerate(SENTENCES):
        wav = directory / f"h{i:02d}.wav"
        if not wav.is_file():
            speak(text, wav)
        out.append((text, read_wav(wav)))
    return out


def stock(backend, audios, floor: int) -> dict:
    hyps, cpu, runaway = [], [], 0
    for audio in audios:
        duration = len(audio) / we.MODEL_RATE
        window = we.window_s(duration, floor)
        c0 = time.process_time()
        result = backend._decode([audio], window, 0)[0]
        cpu.append(time.process_time() - c0)
        runaway += we.degenerate(result.compression_ratio, len(result.tokens),
                                 we.token_cap(duration))
        hyps.append(we._text_of(result)[0])
    return {"hyps": hyps, "cpu_s": statistics.mean(cpu), "degenerate": runaway}


def service(backend, audios, floor: int) -> dict:
    backend.window_floor_s = floor
    backend.redecodes = 0
    hyps, cpu = [], []
    for audio in audios:
        c0 = time.process_time()
        hyps.append(backend.decode([audio])[0][0])
        cpu.append(time.process_time() - c0)
    return {"hyps": hyps, "cpu_s": statistics.mean(cpu), "redecoded": backend.redecodes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--floors", default="0,6,8,10,12,15,20")
    ap.add_argument("--speech-dir", default=str(Path.home() / ".cache" / "cosyvoice"
                                                / "bench-speech" / "harvard"))
    ap.add_argument("--model-dir", default="")
    ap.add_argument("--variant", default="torch-window",
                    help="benchmarks/finals.py VARIANTS: torch-window (fp32 decoder) or torch "
                         "(the service's default, int8 decoder)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    floors = [int(f) for f in args.floors.split(",")]
    speech = synthesize(Path(args.speech_dir))
    refs = [text for text, _ in speech]
    audios = [we._float_audio(pcm) for _, pcm in speech]
    durations = [len(a) / we.MODEL_RATE for a in audios]
    backend = load_backend(args.variant, args.model_dir)
    backend.decode([audios[0]])  # warm-up
    rows = []
    for floor in floors:
        s, v = stock(backend, audios, floor), service(backend, audios, floor)
        rows.append({"floor_s": floor,
                     "windows_s": sorted({we.window_s(d, floor) for d in durations}),
                     "stock_wer": round(corpus_wer(refs, s["hyps"]), 4),
                     "stock_degenerate": s["degenerate"],
                     "stock_cpu_s": round(s["cpu_s"], 3),
                     "service_wer": round(corpus_wer(refs, v["hyps"]), 4),
                     "service_redecoded": v["redecoded"],
                     "service_cpu_s": round(v["cpu_s"], 3)})
        print(json.dumps(rows[-1]), flush=True)
    base = next((r for r in rows if r["floor_s"] == 0), rows[0])
    print(f"\n{len(audios)} utterances, {min(durations):.1f}-{max(durations):.1f} s "
          "(padding included); CPU per final, ratio to the full window of this run\n")
    print(markdown(
        ["floor", "windows", "stock WER", "stock degenerate", "stock CPU", "service WER",
         "re-decoded", "service CPU"],
        ([f"{r['floor_s'] or 'full 30'} s", ", ".join(map(str, r["windows_s"])),
          f"{r['stock_wer']:.1%}", r["stock_degenerate"],
          f"{r['stock_cpu_s']:.2f} s ({r['stock_cpu_s'] / base['stock_cpu_s']:.2f}×)",
          f"{r['service_wer']:.1%}", r["service_redecoded"],
          f"{r['service_cpu_s']:.2f} s ({r['service_cpu_s'] / base['stock_cpu_s']:.2f}×)"]
         for r in rows)))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "durations_s": durations},
                                              indent=2))


if __name__ == "__main__":
    main()
