"""PocketSphinx engine with the US English model its PyPI wheel ships.

An endpointer on PocketSphinx's voice activity detector (``endpointer.py``) splits the stream into
utterances; the decoder sees only speech. Partials are sent when the hypothesis changes,
a final at each endpoint, at ``flush`` and when an utterance reaches the length cap.

Reproducibility: PocketSphinx carries its cepstral-mean estimate from one utterance to
the next inside a decoder, and other feature state besides. Every utterance therefore
starts from ``reinit_feat()`` plus the session's own saved CMN string, so a transcript
never depends on which decoder served it, and a stream rebuilt from a checkpoint continues
exactly like the original. After each final the front end (endpointer, resampler, frame
buffer) is reset at the chunk boundary; that reset point is the checkpoint.
"""

from __future__ import annotations

import logging
import re

import pocketsphinx

from ..settings import Settings
from ..wire.messages import Result, Word
from ..wire.resample import ModelRateInput
from .endpointer import Endpointer, Turn, next_frame

log = logging.getLogger(__name__)

MODEL_RATE = 16000
FRAMES_PER_S = 100
_VARIANT = re.compile(r"\(\d+\)$")
# Where a session that starts at 8 kHz starts its cepstral mean: the wideband prior is
# far from band-limited speech. Made by scripts/narrowband_cmn.py.
NARROWBAND_INITIAL_CMN = ("38.6821,29.1372,-28.0221,36.0803,-20.1765,-3.99816,14.8727,"
                          "-20.1449,24.395,-2.97567,-0.589402,14.102,-6.66626")


def _is_filler(word: str) -> bool:
    return word.startswith(("<", "[", "++")) or word.endswith("++")


def clean_word(word: str) -> str | None:
    """A decoder word as users see it, or None for silence and fillers."""
    if _is_filler(word):
        return None
    return _VARIANT.sub("", word)


class PocketSphinxModel:
    """Decoders for one worker process; create them before forking so pages are shared."""

    name = "pocketsphinx"

    def __init__(self, settings: Settings):
        self.settings = settings
        self._free: list[pocketsphinx.Decoder] = []
        first = self._new_decoder()
        # The CMN a fresh decoder starts from: every session starts from it.
        self.initial_cmn = first.get_cmn()
        self._free.append(first)

    @staticmethod
    def _new_decoder() -> pocketsphinx.Decoder:
        return pocketsphinx.Decoder(loglevel="FATAL", samprate=MODEL_RATE)

    def preload(self, n: int) -> None:
        while len(self._free) < n:
            self._free.append(self._new_decoder())

    def after_fork(self) -> None:
        pass  # the decoders made before the fork serve this process as they are

    def start_stage(self, process: bool = True) -> None:
        return None  # every result is decoded in the worker's loop

    def _take(self) -> pocketsphinx.Decoder:
        if self._free:
            return self._free.pop()
        log.warning("decoder pool empty; creating a decoder after fork (memory not shared)")
        return self._new_decoder()

    def _give_back(self, decoder: pocketsphinx.Decoder) -> None:
        self._free.append(decoder)

    def stream(self, sample_rate: int, checkpoint: dict | None = None,
               mode: str | None = None, language: str | None = None,
               prompt: str = "", turn: Turn | None = None) -> "PocketSphinxStream":
        if checkpoint is None:
            cmn = NARROWBAND_INITIAL_CMN if sample_rate <= 8000 else self.initial_cmn
            checkpoint = {"cmn": cmn, "offset": 0, "utterance": 0, "rate": sample_rate}
        cp = checkpoint
        return PocketSphinxStream(self, self._take(), cp)


class PocketSphinxStream:
    def __init__(self, model: PocketSphinxModel, decoder: pocketsphinx.Decoder, cp: dict):
        self._model = model
        self._dec = decoder
        s = model.settings
        self._window = s.endpoint_window_s
        self._ratio = s.endpoint_ratio
        self._max_utt_samples = int(s.max_utterance_s * MODEL_RATE)
        self._preroll = int(s.endpoint_preroll_s * MODEL_RATE)
        # A start is called once most of a window is speech: keep a window and more.
        self._history_bytes = 2 * (self._preroll + int((self._window + 0.2) * MODEL_RATE))
        self._cmn = cp["cmn"]
        self._offset = int(cp["offset"])  # model-rate samples received since session start
        self._utt = int(cp["utterance"])
        self._rate = int(cp["rate"])
        # 2-pass: keep each utterance's decoded audio for the second pass.
        self.keep_audio = False
        self._utt_pcm = bytearray()
        self._finished_audio: dict[int, bytes] = {}
        self._reset_front_end()

    # ---- state ------------------------------------------------------------------------

    @property
    def checkpoint(self) -> dict:
        return {"cmn": self._cmn, "offset": self._ep_base, "utterance": self._utt,
                "rate": self._rate}

    def _reset_front_end(self) -> None:
        self._ep = Endpointer(window_s=self._window, ratio=self._ratio, sample_rate=MODEL_RATE)
        self._ep_base = self._offset
        self._buf = bytearray()
        self._ep_pos = 0  # samples the endpointer has seen since the reset
        self._history = bytearray()  # the latest audio the endpointer saw, for pre-roll
        self._input = ModelRateInput(self._rate, MODEL_RATE)
        self._in_utt = False
        self._utt_start = 0
        self._last_partial = ""

    def _seconds(self, samples: int) -> float:
        return round(samples / MODEL_RATE, 3)

    # ---- input ------------------------------------------------------------------------

    def feed(self, pcm: bytes, sample_rate: int | None = None) -> list[Result]:
        # a rate switch drains the old resampler and keeps the decoder state
        data = self._input.convert(pcm, sample_rate)
        self._rate = self._input.rate
        self._offset += len(data) // 2
        self._buf += data
        speech = bytearray()
        final = self._consume_frames(speech)
        if final is not None:
            # The rest of this chunk follows an endpoint; the reset point is the chunk
            # boundary, where a rebuilt stream would start too.
            self._reset_front_end()
            return final
        if not self._in_utt:
            return []
        self._process(speech)
        if self._ep_base + self._ep_pos - self._utt_start >= self._max_utt_samples:
            final = self._finish(self._ep_base + self._ep_pos)
            self._reset_front_end()
            return final
        return self._partial()

    def finalize(self) -> list[Result]:
        """The utterance in progress ends at the audio received so far: its final now,
        and the stream goes on."""
        speech = bytearray()
        final = self._consume_frames(speech)
        if final is None and self._in_utt:
            self._process(speech)
            final = self._finish(self._ep_base + self._ep_pos)
        if final is None:
            return []
        self._reset_front_end()
        return final

    def _consume_frames(self, speech: bytearray) -> list[Result] | None:
        """Run whole frames through the endpointer; a list (maybe empty) at an endpoint."""
        fb = self._ep.frame_bytes
        while len(self._buf) >= fb:
            frame = next_frame(self._buf, self._history, fb, self._history_bytes)
            self._ep_pos += fb // 2
            final = self._frame(frame, speech)
            if final is not None:
                return final
        return None

    def _frame(self, frame: bytes, speech: bytearray) -> list[Result] | None:
        was_in_speech = self._ep.in_speech
        out = self._ep.process(frame)
        if out is None:
            return None
        if not was_in_speech:
            speech += self._start_utterance()
        speech += out
        if not self._ep.in_speech:
            self._process(speech)
            end = self._ep_base + int(round(self._ep.speech_end * MODEL_RATE))
            return self._finish(end)
        return None

    def _start_utterance(self) -> bytes:
        """Start decoding; returns the pre-roll audio just before the detected start.

        The endpointer needs most of a window of speech before it calls a start, so the
        onset of the first word (a soft "the") would be lost without some audio from
        before ``speech_start``.
        """
        self._dec.reinit_feat()
        self._dec.set_cmn(self._cmn)
        self._dec.start_utt()
        self._utt_pcm = bytearray()
        self._in_utt = True
        self._last_partial = ""
        start = int(round(self._ep.speech_start * MODEL_RATE))
        hist_start = self._ep_pos - len(self._history) // 2
        pre_from = max(hist_start, start - self._preroll, 0)
        self._utt_start = self._ep_base + pre_from
        return bytes(self._history[(pre_from - hist_start) * 2:(start - hist_start) * 2])

    def _process(self, speech: bytearray) -> None:
        if speech:
            self._dec.process_raw(bytes(speech))
            if self.keep_audio:
                self._utt_pcm += speech
            speech.clear()

    # ---- output -----------------------------------------------------------------------

    def _partial(self) -> list[Result]:
        hyp = self._dec.hyp()
        text = hyp.hypstr if hyp is not None else ""
        if not text or text == self._last_partial:
            return []
        self._last_partial = text
        return [{"type": "partial", "text": text, "utterance": self._utt,
                 "start": self._seconds(self._utt_start),
                 "end": self._seconds(self._offset)}]

    def _finish(self, end_sample: int) -> list[Result]:
        """End the utterance in progress and return its final (if it has anything)."""
        self._dec.end_utt()
        self._in_utt = False
        self._cmn = self._dec.get_cmn()
        words: list[Word] = []
        frame = MODEL_RATE // FRAMES_PER_S  # samples per frame
        # seg() is None when the decoder found no path (an utterance ended almost at once)
        for seg in self._dec.seg() or ():
            word = clean_word(seg.word)
            if word is None:
                continue
            words.append({
                "word": word,
                "start": self._seconds(self._utt_start + seg.start_frame * frame),
                "end": self._seconds(self._utt_start + (seg.end_frame + 1) * frame),
                "conf": round(float(getattr(seg, "prob", 1.0)), 3),
            })
        if not words and not self._last_partial:
            return []
        if self.keep_audio:
            self._finished_audio[self._utt] = bytes(self._utt_pcm)
        self._utt_pcm = bytearray()
        final: Result = {"type": "final", "text": " ".join(w["word"] for w in words),
                 "utterance": self._utt, "start": self._seconds(self._utt_start),
                 "end": self._seconds(end_sample), "words": words}
        self._utt += 1
        return [final]

    def take_utterance_audio(self, utterance: int) -> bytes:
        """The model-rate audio decoded for a finished utterance (``keep_audio``)."""
        return self._finished_audio.pop(utterance, b"")

    def flush(self) -> list[Result]:
        """End of stream: decode what is buffered and return the last final."""
        tail = self._input.flush()
        self._offset += len(tail) // 2
        self._buf += tail
        speech = bytearray()
        final = self._consume_frames(speech)
        if final is None and self._ep.in_speech:
            was_in_utt = self._in_utt
            tail = self._ep.end_stream(bytes(self._buf)) or b""
            if tail and not was_in_utt:
                speech += self._start_utterance()
            speech += tail
        self._buf.clear()
        if final is None and self._in_utt:
            self._process(speech)
            final = self._finish(self._offset)
        self._reset_front_end()
        return final or []

    def close(self) -> None:
        if self._in_utt:
            self._dec.end_utt()
            self._in_utt = False
        if self._dec is not None:
            self._model._give_back(self._dec)
            self._dec = None
