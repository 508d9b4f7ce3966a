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
