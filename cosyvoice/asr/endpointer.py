"""Utterance endpointing on a voice activity detector: PocketSphinx's ``Vad`` (the
PocketSphinx engines) or Silero VAD (``SileroVad``, the whisper-live engine; chosen by
benchmarks/vad.py, docs/engines.md).

PocketSphinx ships an ``Endpointer`` too, but each one leaks its C buffers when it is
garbage-collected (about 19 KB; a stream needs a fresh one after every utterance, so a
worker grew by megabytes an hour), and it holds every frame back by a whole window. This
one keeps the same rule — a speech start when ``ratio`` of the last ``window_s`` of
frames is speech, an end when ``ratio`` of them is not — on a detector that frees
cleanly, hands the window over at the start and every later frame at once.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from pocketsphinx import Vad

FRAME_S = 0.03


@dataclass(frozen=True)
class Turn:
    """A session's turn control, as it asked (``auth``; stored in its hash, carried in its
    checkpoint): ``endpoint_ms``, the silence that ends an utterance (0: the server's
    endpointer window), and ``speech_events``, a ``speech_started`` result at each start
    of speech."""
    endpoint_ms: int = 0
    speech_events: bool = False

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Turn:
        """From a session's hash (strings) or a checkpoint (JSON values)."""
        return cls(int(options.get("endpoint_ms") or 0),
                   options.get("speech_events") in ("1", True))

    def to_checkpoint(self) -> dict[str, Any]:
        return {"endpoint_ms": self.endpoint_ms, "speech_events": self.speech_events}

    @property
    def end_window_s(self) -> float | None:
        return self.endpoint_ms / 1000 if self.endpoint_ms else None


class FrameVad(Protocol):
    """A voice activity detector over fixed frames of 16-bit PCM."""
    frame_bytes: int
    frame_length: float  # seconds

    def is_speech(self, frame: bytes) -> bool: ...


class SileroVad:
    """Silero VAD v6, the ONNX model faster-whisper ships, on 32 ms frames at 16 kHz.

    The model is recurrent: each frame is scored with the 64 samples before it and the
    LSTM state the previous frame left, carried here, so scoring frame by frame gives the
    probabilities of scoring the whole stream at once. A new detector starts from silence,
    as the front end does after each final, so a stream rebuilt from a checkpoint scores
    the same frames the same way. ``session`` is one ``SileroVADModel`` per process (an
    ONNX Runtime session; stateless, shared by every stream of the process).
    """

    frame_samples = 512
    frame_bytes = 2 * frame_samples
    frame_length = frame_samples / 16000
    context_samples = 64

    def __init__(self, session: Any, threshold: float = 0.5):
        self._run = session.session.run
        self.threshold = threshold
        self._h = np.zeros((1, 1, 128), dtype=np.float32)
        self._c = np.zeros((1, 1, 128), dtype=np.float32)
        self._context = np.zeros(self.context_samples, dtype=np.float32)
        self.probability = 0.0  # of the latest frame

    def is_speech(self, frame: bytes) -> bool:
        x = np.frombuffer(frame, dtype="<i2").astype(np.float32) / 32768.0
        window = np.concatenate([self._context, x])[None]
        out, self._h, self._c = self._run(None, {"input": window, "h": self._h, "c": self._c})
        self._context = x[-self.context_samples:]
        self.probability = float(out.reshape(-1)[0])
        return self.probability >= self.threshold


def silero_session():
    """One Silero VAD model (ONNX Runtime, one thread) for the calling process."""
    from faster_whisper.utils import get_assets_path
    from faster_whisper.vad import SileroVADModel

    return SileroVADModel(os.path.join(get_assets_path(), "silero_vad_v6.onnx"))


class Endpointer:
    """Starts and ends of speech. ``end_window_s`` (None: ``window_s``) is the window an
    end is judged on: a session's endpointing silence (``auth.endpoint_ms``)."""

    def __init__(self, window_s: float = 0.3, ratio: float = 0.9, sample_rate: int = 16000,
                 mode: int = Vad.LOOSE, vad: FrameVad | None = None,
                 end_window_s: float | None = None):
        self._vad: FrameVad = vad if vad is not None else Vad(mode, sample_rate, FRAME_S)
        self.frame_bytes = self._vad.frame_bytes
        self.frame_length = self._vad.frame_length
        self.sample_rate = sample_rate
        self._size = max(2, round(window_s / self.frame_length))
        self._needed = max(1, math.ceil(ratio * self._size))
        self._window: deque[tuple[bool, bytes]] = deque()
        self._speech_in_window = 0
        # the latest frames' calls an end is judged on
        self._end_size = (self._size if end_window_s is None
                          else max(2, round(end_window_s / self.frame_length)))
        self._end_needed = max(1, math.ceil(ratio * self._end_size))
        self._recent: deque[bool] = deque()
        self._speech_recent = 0
        self._frames = 0  # frames seen so far
        self.in_speech = False
        self.speech_start = 0.0  # seconds from the first frame
        self.speech_end = 0.0
        self.last_speech = False  # the VAD's call on the latest frame

    def process(self, frame: bytes) -> bytes | None:
        """Audio to decode for this frame (the whole window at a start), or None."""
        speech = self._vad.is_speech(frame)
        self.last_speech = speech
        self._frames += 1
        self._window.append((speech, frame))
        self._speech_in_window += speech
        if len(self._window) > self._size:
            self._speech_in_window -= self._window.popleft()[0]
        self._recent.append(speech)
        self._speech_recent += speech
        if len(self._recent) > self._end_size:
            self._speech_recent -= self._recent.popleft()
        full = len(self._window) == self._size
        first = self._frames - len(self._window)  # index of the window's oldest frame
        if not self.in_speech:
            if full and self._speech_in_window >= self._needed:
                self.in_speech = True
                self.speech_start = first * self.frame_length
                return b"".join(f for _s, f in self._window)
            return None
        recent = len(self._recent)
        if recent == self._end_size and recent - self._speech_recent >= self._end_needed:
            self.in_speech = False
            last = max((i for i, s in enumerate(self._recent) if s), default=-1)
            self.speech_end = (self._frames - recent + last + 1) * self.frame_length
        return frame

    def end_stream(self, frame: bytes) -> bytes | None:
        """The stream's last (possibly short) frame: ends speech in progress."""
        if not self.in_speech:
            return None
        self.in_speech = False
        self.speech_end = self._frames * self.frame_length + len(frame) / 2 / self.sample_rate
        return frame


def next_frame(buf: bytearray, history: bytearray, frame_bytes: int, history_bytes: int) -> bytes:
    """Cut the next frame off the audio waiting for an endpointer (``buf``, which holds at
    least one), and keep it at the end of ``history``, the latest ``history_bytes`` the
    endpointer saw (an utterance's pre-roll comes from there)."""
    frame = bytes(buf[:frame_bytes])
    del buf[:frame_bytes]
    history += frame
    if len(history) > history_bytes:
        del history[:len(history) - history_bytes]
    return frame
