"""Streaming resampling of 16-bit PCM to the model's rate."""

from __future__ import annotations

import numpy as np
import soxr


class StreamingResampler:
    """Resamples a chunked int16 stream; chunked output equals one-shot output.

    soxr is bit-exact chunked vs one-shot on float32 (not on int16), so samples are
    converted to float32 around it.
    """

    def __init__(self, in_rate: int, out_rate: int):
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._rs = soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality="HQ")

    def feed(self, pcm: bytes, last: bool = False) -> bytes:
        x = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
        y = self._rs.resample_chunk(x, last=last)
        return np.clip(np.round(y * 32768.0), -32768, 32767).astype("<i2").tobytes()

    def flush(self) -> bytes:
        return self.feed(b"", last=True)


class ModelRateInput:
    """A session's audio at its current rate in, the model's rate out. A chunk at another
    rate switches the session: the old resampler is drained first, so nothing is lost."""

    def __init__(self, rate: int, model_rate: int = 16000):
        self.rate = rate
        self.model_rate = model_rate
        self._resampler = self._make(rate)

    def _make(self, rate: int) -> StreamingResampler | None:
        return None if rate == self.model_rate else StreamingResampler(rate, self.model_rate)

    def convert(self, pcm: bytes, sample_rate: int | None = None) -> bytes:
        head = b""
        if sample_rate and sample_rate != self.rate:
            if self._resampler is not None:
                head = self._resampler.flush()
            self.rate = sample_rate
            self._resampler = self._make(sample_rate)
        if self._resampler is not None:
            pcm = self._resampler.feed(pcm)
        return head + pcm

    def flush(self) -> bytes:
        return self._resampler.flush() if self._resampler is not None else b""
