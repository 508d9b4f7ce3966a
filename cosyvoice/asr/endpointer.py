"""Utterance endpointing on PocketSphinx's voice activity detector.

PocketSphinx ships an ``Endpointer`` too, but each one leaks its C buffers when it is
garbage-collected (about 19 KB; a stream needs a fresh one after every utterance, so a
worker grew by megabytes an hour), and it holds every frame back by a whole window. This
one keeps the same rule — a speech start when ``ratio`` of the last ``window_s`` of
frames is speech, an end when ``ratio`` of them is not — on a ``Vad`` (which frees
cleanly), hands the window over at the start and every later frame at once.
"""

from __future__ import annotations

import math
from collections import deque

from pocketsphinx import Vad

FRAME_S = 0.03


class Endpointer:
    def __init__(self, window_s: float = 0.3, ratio: float = 0.9, sample_rate: int = 16000,
                 mode: int = Vad.LOOSE):
        self._vad = Vad(mode, sample_rate, FRAME_S)
        self.frame_bytes = self._vad.frame_bytes
        self.frame_length = self._vad.frame_length
        self.sample_rate = sample_rate
        self._size = max(2, round(window_s / self.frame_length))
        self._needed = max(1, math.ceil(ratio * self._size))
        self._window: deque[tuple[bool, bytes]] = deque()
        self._speech_in_window = 0
        self._frames = 0  # frames seen so far
        self.in_speech = False
        self.speech_start = 0.0  # seconds from the first frame
        self.speech_end = 0.0

    def process(self, frame: bytes) -> bytes | None:
        """Audio to decode for this frame (the whole window at a start), or None."""
        speech = self._vad.is_speech(frame)
        self._frames += 1
        self._window.append((speech, frame))
        self._speech_in_window += speech
        if len(self._window) > self._size:
            self._speech_in_window -= self._window.popleft()[0]
        full = len(self._window) == self._size
        first = self._frames - len(self._window)  # index of the window's oldest frame
        if not self.in_speech:
            if full and self._speech_in_window >= self._needed:
                self.in_speech = True
                self.speech_start = first * self.frame_length
                return b"".join(f for _s, f in self._window)
            return None
        if full and self._size - self._speech_in_window >= self._needed:
            self.in_speech = False
            last = max((i for i, (s, _f) in enumerate(self._window) if s), default=-1)
            self.speech_end = (first + last + 1) * self.frame_length
        return frame

    def end_stream(self, frame: bytes) -> bytes | None:
        """The stream's last (possibly short) frame: ends speech in progress."""
        if not self.in_speech:
            return None
        self.in_speech = False
        self.speech_end = self._frames * self.frame_length + len(frame) / 2 / self.sample_rate
        return frame
