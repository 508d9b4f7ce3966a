"""Shared test helpers: fixture audio, word error rate, process management."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import wave
from pathlib import Path

import jiwer
import pocketsphinx
import requests

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).parent.parent


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


def wait_http(url: str, proc: subprocess.Popen | None = None, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            if requests.get(url, timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


def wait_for(predicate, timeout: float = 15.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError("condition not met in time")


def spawn(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "cosyvoice", *args],
                                env={**os.environ, **env}, stdout=log,
                                stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)


def terminate(proc: subprocess.Popen, timeout: float = 15.0) -> int:
    """SIGTERM, then SIGKILL of the whole process group if it does not exit."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode
