"""Shared test helpers: fixture audio, word error rate, the test service's settings.

Starting and stopping processes is tests/launcher.py's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import struct
import subprocess
import sys
import wave
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jiwer
import pocketsphinx
from hypothesis import strategies as st

from cosyvoice.asr import load_model
from cosyvoice.gateway.fastws import xor_mask
from cosyvoice.settings import Settings
from cosyvoice.store import bus as busmod
from cosyvoice.store import keys
from cosyvoice.wire.audio import split_chunks
from cosyvoice.wire.messages import kind
from cosyvoice.wire.protocol import encode_chunk

from .launcher import ROOT, wait_for

if TYPE_CHECKING:
    from cosyvoice.worker.loop import Worker

FIXTURES = ROOT / "tests" / "fixtures"
# Disconnected sessions expire after this in the test services (30 s in production).
TEST_GRACE_S = 2.0
# Every test service's settings, under the test's own.
TEST_ENV = {"COSYVOICE_SESSION_GRACE_S": str(TEST_GRACE_S)}


def _tsv(name: str) -> dict[str, str]:
    lines = (FIXTURES / name).read_text().splitlines()
    return dict(line.split("\t", 1) for line in lines if line.strip())


def fixture_texts() -> dict[str, str]:
    """name -> reference text of every single-sentence fixture."""
    return _tsv("sentences.tsv")


def harvard_texts() -> dict[str, str]:
    """name -> reference text of the Harvard sentence fixtures (harder for PocketSphinx)."""
    return _tsv("harvard.tsv")


def zh_texts() -> dict[str, str]:
    """name -> reference text (Simplified) of the Mandarin fixtures (``zh/zhNN``)."""
    return {f"zh/{name}": text for name, text in _tsv("zh/sentences.tsv").items()}


def joined(names: list[str], gap_s: float = 1.5) -> bytes:
    """Fixtures one after the other with ``gap_s`` of silence between (an endpoint each)."""
    gap = b"\0\0" * int(gap_s * 16000)
    return gap.join(read_pcm(name) for name in names)


def han(text: str) -> str:
    """The Chinese characters of ``text`` in Simplified script (OpenCC t2s), nothing else:
    what a character error rate compares."""
    import opencc

    simplified = opencc.OpenCC("t2s").convert(text)
    return "".join(c for c in simplified if "\u4e00" <= c <= "\u9fff")


def cer(references: list[str], hypotheses: list[str]) -> float:
    """Character error rate over the set, Chinese characters only, script aside."""
    return jiwer.cer([han(r) for r in references], [han(h) or "-" for h in hypotheses])


def reference_text(name: str) -> str:
    """The reference text beside fixture ``name`` (``name.txt``: the name, a tab, the text)."""
    return (FIXTURES / f"{name}.txt").read_text().split("\t", 1)[1].strip()


def read_pcm(name: str) -> bytes:
    with wave.open(str(FIXTURES / f"{name}.wav"), "rb") as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2)
        return w.readframes(w.getnframes())


def write_pcm_wav(path: Any, pcm: bytes, rate: int = 16000, channels: int = 1) -> None:
    """16-bit PCM (interleaved where ``channels`` > 1) as a WAV file (a fake microphone's,
    or a client's recording)."""
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)


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


# The engine of every test service that names none: the default.
ENGINE = Settings().engine
_MODELS: dict[str, Any] = {}


def engine_model(engine: str) -> Any:
    """The engine's model in this process, loaded once."""
    if engine not in _MODELS:
        _MODELS[engine] = load_model(engine, Settings(engine=engine))
    return _MODELS[engine]


def direct_decode(pcm: bytes, engine: str = ENGINE) -> str:
    """The engine's own transcript of a 16 kHz file without the service. PocketSphinx:
    the whole file decoded as one utterance. whisper-live: the file fed in this process as
    a session's stream (the same 200 ms chunks), which the service must match word for
    word."""
    if engine != "pocketsphinx":
        return " ".join(f["text"] for f in finals(run_stream(engine_model(engine), pcm)[0])
                        if f["text"])
    decoder = pocketsphinx.Decoder(loglevel="FATAL")
    decoder.start_utt()
    decoder.process_raw(pcm, full_utt=True)
    decoder.end_utt()
    hyp = decoder.hyp()
    return hyp.hypstr if hyp else ""


# Where a client's 200 ms chunk grid may fall against the audio: leading silence, ms.
PHASES_MS = (0, 40, 80, 120, 160)


def phase_bound(reference: str, pcm: bytes, engine: str = ENGINE) -> float:
    """The WER a transcript of ``pcm`` streamed by a client that does not start on the
    file's first sample (the page: its capture starts wherever the device is) may have:
    the engine's worst direct decode over ``PHASES_MS`` of leading silence, plus 0.01.
    Whisper's output can change with the phase (tiny.en writes "sea shore" at some)."""
    return max(wer(reference, direct_decode(b"\x00\x00" * (16 * ms) + pcm, engine))
               for ms in PHASES_MS) + 0.01


# ---- an engine driven in this process ---------------------------------------------------


def run_stream(model, pcm, rate=16000, chunk_ms=200, checkpoint=None, start=0, language=None,
               turn=None):
    """A session's results from ``model`` fed ``pcm`` in chunks from byte ``start`` (in
    ``language``: the engine's default where None; with the turn control ``turn``), and
    the checkpoint after each chunk that gave a final (keyed by the byte after it)."""
    stream = model.stream(rate, checkpoint, language=language, turn=turn)
    size = rate * chunk_ms // 1000 * 2
    results, checkpoints = [], {}
    for i in range(start, len(pcm), size):
        out = stream.feed(pcm[i:i + size])
        results += out
        if any(kind(r) == "final" for r in out):
            checkpoints[i + size] = stream.checkpoint
    results += stream.flush()
    stream.close()
    return results, checkpoints


def finals(results):
    return [r for r in results if kind(r) == "final"]


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
    return [json.loads(f[b"r"]) for _id, f in client.xrange(keys.text_key(sid))]


def open_sessions(rds) -> list[str]:
    """The sessions announced in ``rds`` (a client of the service's Redis), oldest first."""
    return [f[b"sid"].decode() for _id, f in rds.xrange(busmod.Bus(rds).k.sessions)]


def kill_owners(rds, killed: list[int]) -> None:
    """SIGKILL the worker process that holds each open session's lease (its id names its
    pid), adding each pid to ``killed``: a worker lost mid-session."""
    owners = [k for k in [rds.get(keys.lease_key(s)) for s in open_sessions(rds)] if k]
    for owner in owners:
        pid = int(owner.decode().split("-")[-2])
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)


def rounds_until(worker: Worker, done: Callable[[], object], timeout: float) -> None:
    """Runs the worker's decode loop in this thread, a round at a time, until ``done()``."""
    def step() -> object:
        worker._round()
        return done()

    wait_for(step, timeout=timeout)


def speaker_texts() -> dict[str, tuple[str, str]]:
    """name -> (voice, text) of the speaker fixtures (``speakers/<name>``: slt, kal, ked)."""
    lines = (FIXTURES / "speakers" / "sentences.tsv").read_text().splitlines()
    out = {}
    for line in lines:
        if line.strip():
            voice, name, text = line.split("\t")
            out[f"speakers/{name}"] = (voice, text)
    return out


def conversation(turns: list[str], gaps: list[float] | None = None,
                 lead_s: float = 0.5) -> tuple[bytes, list[tuple[str, float, float, str]]]:
    """Fixtures spoken one after the other (``turns``: fixture names) with ``gaps`` of
    silence between them (1.0 s each by default; 0: back to back), after ``lead_s`` of
    silence: the 16 kHz PCM and the truth, (voice, start, end, text) per turn. A fixture's
    voice is its speaker fixture's, or ``zh`` for the Mandarin ones and ``slt`` for the
    rest (festival's slt made them)."""
    texts = speaker_texts()
    zh = zh_texts()
    gaps = gaps if gaps is not None else [1.0] * (len(turns) - 1)
    pieces = [b"\0\0" * int(lead_s * 16000)]
    truth = []
    at = len(pieces[0]) // 2
    for i, name in enumerate(turns):
        pcm = read_pcm(name)
        if name in texts:
            voice, text = texts[name]
        elif name in zh:
            voice, text = "zh", zh[name]
        else:
            voice, text = "slt", fixture_texts().get(name) or harvard_texts()[name]
        truth.append((voice, at / 16000, (at + len(pcm) // 2) / 16000, text))
        pieces.append(pcm)
        at += len(pcm) // 2
        if i < len(turns) - 1:
            gap = b"\0\0" * int(gaps[i] * 16000)
            pieces.append(gap)
            at += len(gap) // 2
    pieces.append(b"\0\0" * 16000)
    return b"".join(pieces), truth


def word_speakers(finals: Sequence[Mapping[str, Any]], truth: list[tuple[str, float, float, str]]
                  ) -> tuple[list[str], list[str]]:
    """Each word's true voice (the turn its middle falls in, or the nearest) and its
    label, over the finals' words."""
    true, found = [], []
    for final in finals:
        for word in final.get("words") or []:
            mid = (word["start"] + word["end"]) / 2
            voice = min(truth, key=lambda t: 0 if t[1] <= mid <= t[2]
                        else min(abs(mid - t[1]), abs(mid - t[2])))[0]
            true.append(voice)
            found.append(word.get("speaker", ""))
    return true, found


def attributed(finals: Sequence[Mapping[str, Any]],
               truth: list[tuple[str, float, float, str]]) -> float:
    """The share of words whose label is their true voice, after the best mapping of
    labels to voices."""
    from cosyvoice.text.speakers import best_mapping

    true, found = word_speakers(finals, truth)
    mapping = best_mapping(true, found)
    return sum(mapping.get(f) == t for t, f in zip(true, found, strict=True)) / max(1, len(true))


@contextlib.contextmanager
def hogs(n: int) -> Iterator[None]:
    """``n`` CPU-bound processes beside the service while the block runs (a host whose
    cores are shared with other work)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def ws_frame(opcode: int, payload: bytes = b"", fin: bool = True, rsv: int = 0,
             length: int | None = None) -> bytes:
    """A client's WebSocket frame, masked, as bytes for the socket; ``length`` (the length
    its header announces) may lie about the payload: a header alone announces a frame that
    never comes."""
    n = len(payload) if length is None else length
    first = (0x80 if fin else 0) | (rsv << 4) | opcode
    if n < 126:
        head = struct.pack("!BB", first, 0x80 | n)
    elif n < 1 << 16:
        head = struct.pack("!BBH", first, 0x80 | 126, n)
    else:
        head = struct.pack("!BBQ", first, 0x80 | 127, n)
    key = os.urandom(4)
    return head + key + bytes(xor_mask(payload, key, len(payload)))


# Any JSON value, for the fuzzers of what clients send (auth, events, control messages)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
              st.text(max_size=30)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=10)

