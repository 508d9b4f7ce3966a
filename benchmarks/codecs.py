"""PCM against Opus on the wire, every rung through the service with every engine, in one run.

For each engine in ``--engines`` (default: pocketsphinx, whisper-live, 2pass) one stack
(embedded Redis, a gunicorn gateway, ``--workers`` worker processes) serves every rung in
turn: PCM 16 kHz, then Opus at each bitrate of ``--bitrates``. Each rung streams the same
recordings (the single-sentence fixtures, the Harvard sentences and the two long
passages), ``--concurrency`` sessions at a time (default: what the engine's workers
admit, at most 8), in real time (``--pace fast``: as fast as acknowledged): the same
audio, so the rungs differ only in the codec. Measured per rung:

* **WER**: corpus WER of the finals against the references (Whisper's English
  normaliser on both sides), and its difference from PCM's in the same run;
* **bytes on the wire per audio second**: ``cosyvoice_audio_bytes_total`` over
  ``cosyvoice_audio_seconds_total`` from the gateway's ``/metrics`` (the ``audio_chunk``
  payloads it stored, protobuf envelope included), and the kbit/s that makes;
* **CPU per session**: CPU seconds of the gateway's and the workers' processes per
  second of audio streamed (a real-time session costs this many cores).

    python benchmarks/codecs.py [--engines pocketsphinx,whisper-live,2pass]
        [--bitrates 32000,24000,16000,12000] [--workers 2] [--pace realtime|fast]
        [--json-out F]

The whole table finishes within 15 minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import markdown  # noqa: E402
from benchmarks.stack import Stack, read_fixture  # noqa: E402
from benchmarks.transport import CpuMeter, machine  # noqa: E402
from cosyvoice.asr import capacity_of  # noqa: E402
from cosyvoice.client import transcribe_pcm  # noqa: E402
from cosyvoice.settings import Settings  # noqa: E402
from cosyvoice.wire import codecs
from tests.helpers import corpus_wer, fixture_texts, harvard_texts, reference_text  # noqa: E402
from tests.stack import scrape  # noqa: E402

LONG = ("harvard_long", "long_unbroken")


def recordings() -> dict[str, str]:
    """name -> reference of every recording each rung streams."""
    return {**fixture_texts(), **harvard_texts(), **{n: reference_text(n) for n in LONG}}


def gateway_audio(url: str) -> dict[str, tuple[float, float]]:
    """codec -> (payload bytes, audio seconds) the gateway has stored so far."""
    m = scrape(url + "/metrics")
    return {codec: (m[f'cosyvoice_audio_bytes_total{{codec="{codec}"}}'],
                    m[f'cosyvoice_audio_seconds_total{{codec="{codec}"}}'])
            for codec in codecs.CODECS}


def run_rung(stack: Stack, refs: dict[str, str], codec: str, bitrate: int,
             concurrency: int, pace: str) -> dict:
    meter = CpuMeter({"gateway": stack.gateway.proc.pid, "workers": stack.pool.proc.pid})
    before_audio, before = gateway_audio(stack.url), meter.sample()

    def one(name: str):
        return name, transcribe_pcm(stack.url, read_fixture(name), 16000, pace=pace,
                                    timeout=120, codec=codec, bitrate=bitrate)

    with ThreadPoolExecutor(concurrency) as pool:
        results = dict(pool.map(one, refs))
    after, after_audio = meter.sample(), gateway_audio(stack.url)
    errors = sum(len(r.errors) for r in results.values())
    b0, s0 = before_audio.get(codec, (0.0, 0.0))
    b1, s1 = after_audio.get(codec, (0.0, 0.0))
    audio_s = s1 - s0
    names = list(refs)
    return {
        "rung": codec if codec == codecs.PCM16 else f"opus {bitrate // 1000}k",
        "codec": codec, "bitrate": bitrate, "sessions": len(names), "errors": errors,
        "audio_s": round(audio_s, 1),
        "wer": corpus_wer([refs[n] for n in names], [results[n].text for n in names]),
        "bytes_per_audio_s": round((b1 - b0) / audio_s) if audio_s else None,
        "gateway_cpu_per_audio_s": (after["gateway"] - before["gateway"]) / audio_s,
        "workers_cpu_per_audio_s": (after["workers"] - before["workers"]) / audio_s,
        "wall_s": round(after["wall"] - before["wall"], 1),
    }


def run_engine(engine: str, bitrates: list[int], workers: int, concurrency: int | None,
               pace: str) -> list:
    capacity = capacity_of(Settings(engine=engine))
    sessions = concurrency or max(1, min(8, workers * capacity))
    refs = recordings()
    rows = []
    with Stack(processes=workers, env={"COSYVOICE_ENGINE": engine,
                                       "COSYVOICE_RATE_LIMIT_FACTOR": "0",
                                       "COSYVOICE_MAX_SESSIONS_PER_CLIENT": "0",
                                       "COSYVOICE_OPUS_BITRATES": ",".join(map(str, bitrates))}
               ) as stack:
        # one session first: models loaded and caches warm before anything is measured
        transcribe_pcm(stack.url, read_fixture("weather"), 16000, pace="fast", timeout=120)
        for codec, bitrate in [(codecs.PCM16, 0)] + [(codecs.OPUS, b) for b in bitrates]:
            row = run_rung(stack, refs, codec, bitrate, sessions, pace)
            row.update(engine=engine, concurrency=sessions)
            rows.append(row)
            print(json.dumps(row), flush=True)
    pcm = rows[0]
    for row in rows:
        row["wer_delta"] = row["wer"] - pcm["wer"]
        row["bytes_ratio"] = (row["bytes_per_audio_s"] / pcm["bytes_per_audio_s"]
                              if row["bytes_per_audio_s"] and pcm["bytes_per_audio_s"]
                              else None)
    return rows


def table(rows: list[dict]) -> str:
    header = ["engine", "rung", "sessions", "errors", "WER", "Δ WER vs PCM", "bytes / audio s",
              "kbit/s", "× PCM bytes", "gateway CPU ms / audio s", "workers CPU ms / audio s"]
    return markdown(header, (
        [r["engine"], r["rung"], r["sessions"], r["errors"], f"{100 * r['wer']:.1f} %",
         f"{100 * r['wer_delta']:+.1f}", r["bytes_per_audio_s"],
         f"{8 * r['bytes_per_audio_s'] / 1000:.1f}", f"{r['bytes_ratio']:.3f}",
         f"{1000 * r['gateway_cpu_per_audio_s']:.1f}",
         f"{1000 * r['workers_cpu_per_audio_s']:.0f}"] for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="pocketsphinx,whisper-live,2pass")
    parser.add_argument("--bitrates", default="32000,24000,16000,12000")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=None,
                        help="sessions at a time (default: what the workers admit, at most 8)")
    parser.add_argument("--pace", choices=("realtime", "fast"), default="realtime")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    bitrates = [int(b) for b in args.bitrates.split(",")]
    started = time.monotonic()
    rows: list[dict] = []
    for engine in args.engines.split(","):
        rows += run_engine(engine, bitrates, args.workers, args.concurrency, args.pace)
    print(table(rows))
    print(f"\n{time.monotonic() - started:.0f} s, {machine()}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"machine": machine(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
