"""Reading WAV files into 16-bit mono PCM at a supported rate, and chunking it."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

from .protocol import SUPPORTED_RATES, chunk_bytes


def read_wav(path: str | Path) -> tuple[bytes, int]:
    """(pcm, rate): 16-bit little-endian mono PCM at a rate the service accepts.

    Other sample widths are converted, channels are averaged, and rates the service does
    not accept are resampled to 16 kHz.
    """
    with wave.open(str(path), "rb") as w:
        width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
        raw = w.readframes(w.getnframes())
    if width == 2:
        x = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    elif width == 1:
        x = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 4:
        x = np.frombuffer(raw, dtype="<i4").astype(np.float32) / 2**31
    else:
        raise ValueError(f"{path}: unsupported sample width {width}")
    if channels > 1:
        x = x.reshape(-1, channels).mean(axis=1)
    if rate not in SUPPORTED_RATES:
        import soxr
        x = soxr.resample(x, rate, 16000)
        rate = 16000
    pcm = np.clip(np.round(x * 32768.0), -32768, 32767).astype("<i2").tobytes()
    return pcm, rate


def split_chunks(pcm: bytes, rate: int, ms: int = 200) -> list[bytes]:
    """Cut PCM into chunks of ``ms`` milliseconds (the last may be shorter)."""
    size = chunk_bytes(rate, ms)
    return [pcm[i:i + size] for i in range(0, len(pcm), size)] or [b""]
