"""Shared test helpers: fixture audio, word error rate, the test service's settings.

Starting and stopping processes is tests/launcher.py's.
"""

from __future__ import annotations

import re
import wave

import jiwer
import pocketsphinx

from .launcher import ROOT

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


def direct_decode(pcm: bytes) -> str:
    """The recogniser's own transcript of the whole file in one utterance."""
    decoder = pocketsphinx.Decoder(loglevel="FATAL")
    decoder.start_utt()
    decoder.process_raw(pcm, full_utt=True)
    decoder.end_utt()
    hyp = decoder.hyp()
    return hyp.hypstr if hyp else ""
