"""Shared test helpers: fixture audio, word error rate, the test service's settings.

Starting and stopping processes is tests/launcher.py's.
"""

from __future__ import annotations

import json
import re
import wave
from collections.abc import Callable
from typing import TYPE_CHECKING

import jiwer
import pocketsphinx

from cosyvoice import bus as busmod
from cosyvoice.audio import split_chunks
from cosyvoice.protocol import encode_chunk

from .launcher import ROOT, wait_for

if TYPE_CHECKING:
    from cosyvoice.worker import Worker

FIXTURES = ROOT / "tests" / "fixtures"
# Disconnected sessions expire after this in the test services (30 s in production).
TEST_GRACE_S = 2.0
# Every test service's settings, under the test's own.
TEST_ENV = {"COSYVOICE_SESSION_GRACE_S": str(TEST_GRACE_S)}


def fixture_texts() -> dict[str, str]:
    """name -> reference text of every single-sentence fixture."""
    lines = (FIXTURES / "sentences.tsv").read_text().splitlines()
    return dict(line.split("\t", 1) for line in lines if line.strip())


def read_pcm(name: str) -> bytes:
    with wave.open(str(FIXTURES / f"{name}.wav"), "rb") as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2)
        return w.readframes(w.getnframes())


def normalize(text: str) -> str:
    return " ".join(re.sub(r"[^a-z' ]", " ", text.lower()).split())


def wer(reference: str, hypothesis: str) -> float:
    ref, hyp = normalize(reference), normalize(hypothesis)
    if not hyp:
        return 1.0
    return jiwer.wer(ref, hyp)


def _normalizer():
    import gc
    import warnings

    from whisper.normalizers import EnglishTextNormalizer
    # openai-whisper reads its spelling table with an open() it never closes.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        normalizer = EnglishTextNormalizer()
        gc.collect()
    return normalizer


_NORMALIZE: list = []


def whisper_normalize(text: str) -> str:
    """Whisper's English normaliser (numbers, spelling, punctuation): "ten o'clock" and
    "10 o'clock" agree."""
    if not _NORMALIZE:
        _NORMALIZE.append(_normalizer())
    return _NORMALIZE[0](text)


def corpus_wer(refs: list[str], hyps: list[str]) -> float:
    """Word error rate over the whole set, both sides through Whisper's English normaliser."""
    return jiwer.wer([whisper_normalize(r) for r in refs], [whisper_normalize(h) for h in hyps])


def direct_decode(pcm: bytes) -> str:
    """The recogniser's own transcript of the whole file in one utterance."""
    decoder = pocketsphinx.Decoder(loglevel="FATAL")
    decoder.start_utt()
    decoder.process_raw(pcm, full_utt=True)
    decoder.end_utt()
    hyp = decoder.hyp()
    return hyp.hypstr if hyp else ""


# ---- an engine driven in this process ---------------------------------------------------


def run_stream(model, pcm, rate=16000, chunk_ms=200, checkpoint=None, start=0):
    """A session's results from ``model`` fed ``pcm`` in chunks from byte ``start``, and
    the checkpoint after each chunk that gave a final (keyed by the byte after it)."""
    stream = model.stream(rate, checkpoint)
    size = rate * chunk_ms // 1000 * 2
    results, checkpoints = [], {}
    for i in range(start, len(pcm), size):
        out = stream.feed(pcm[i:i + size])
        results += out
        if any(r["type"] == "final" for r in out):
            checkpoints[i + size] = stream.checkpoint
    results += stream.flush()
    stream.close()
    return results, checkpoints


def finals(results):
    return [r for r in results if r["type"] == "final"]


# ---- a session written straight into Redis, a worker driven a round at a time ---------


def write_session(bus: busmod.Bus, sid: str, pcm: bytes, upto: int | None = None,
                  start: int = 0, last: bool = True) -> int:
    if start == 0:
        # Announced as a hand-over is, whatever the capacity: these tests control what
        # the workers see, admission has its own tests.
        bus.create_session(sid, 16000)
        bus.announce(sid)
    chunks = split_chunks(pcm, 16000)
    end = len(chunks) if upto is None else upto
    items = [(sid, seq, encode_chunk(chunks[seq], seq, last=last and seq == len(chunks) - 1),
              16000, last and seq == len(chunks) - 1) for seq in range(start, end)]
    replies = bus.append_chunks(items)
    assert all(r.status == busmod.AppendStatus.APPENDED for r in replies)
    return len(chunks)


def results(client, sid) -> list[dict]:
    return [json.loads(f[b"r"]) for _id, f in client.xrange(busmod.text_key(sid))]


def rounds_until(worker: Worker, done: Callable[[], object], timeout: float) -> None:
    """Runs the worker's decode loop in this thread, a round at a time, until ``done()``."""
    def step() -> object:
        worker._round()
        return done()

    wait_for(step, timeout=timeout)
