"""Reading WAV files into 16-bit mono PCM at a supported rate, and chunking it."""

from __future__ import annotations

import struct
import wave
from pathlib import Path

import numpy as np

from .protocol import SUPPORTED_RATES, chunk_bytes


class AudioFileError(ValueError):
    """An input file that cannot be read as audio; the message says why, in one line."""


# Names of the WAV encodings people meet, for the message that refuses them.
_WAV_FORMATS = {3: "32-bit float", 6: "A-law", 7: "mu-law", 0xFFFE: "extensible"}


def read_wav(path: str | Path) -> tuple[bytes, int]:
    """(pcm, rate): 16-bit little-endian mono PCM at a rate the service accepts.

    Reads integer PCM WAV of 8, 16, 24 or 32 bits, any channels, any rate: channels are
    averaged and rates the service does not accept are resampled to 16 kHz. Anything
    else raises AudioFileError.
    """
    try:
        with wave.open(str(path), "rb") as w:
            width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
            raw = w.readframes(w.getnframes())
    except OSError as exc:
        raise AudioFileError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except wave.Error as exc:
        raise AudioFileError(_wav_error(path, exc)) from exc
    except (EOFError, struct.error) as exc:
        raise AudioFileError(_short_file(path)) from exc
    if channels < 1 or rate < 1:
        raise AudioFileError(f"{path}: a WAV header with {channels} channels at {rate} Hz")
    x = _samples(raw, width)
    x = x[:len(x) - len(x) % channels].reshape(-1, channels).mean(axis=1)
    if rate not in SUPPORTED_RATES:
        import soxr
        x = soxr.resample(x, rate, 16000)
        rate = 16000
    pcm = np.clip(np.round(x * 32768.0), -32768, 32767).astype("<i2").tobytes()
    return pcm, rate


def _samples(raw: bytes, width: int) -> np.ndarray:
    """Integer PCM samples of ``width`` bytes as floats in [-1, 1)."""
    if width == 1:
        return (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    if width == 3:  # 24-bit: widen each sample to 32 bits, sign in the top byte
        b = np.frombuffer(raw[:len(raw) - len(raw) % 3], dtype=np.uint8).reshape(-1, 3)
        wide = np.zeros((len(b), 4), dtype=np.uint8)
        wide[:, 1:] = b
        return wide.view("<i4").ravel().astype(np.float32) / 2**31
    dtype = {2: "<i2", 4: "<i4"}[width]
    return np.frombuffer(raw[:len(raw) - len(raw) % width], dtype=dtype).astype(np.float32) \
        / 2 ** (8 * width - 1)


def _short_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        riff = f.read(4) == b"RIFF"
    return f"{path}: a WAV file that ends inside its header" if riff \
        else f"{path} is not a WAV file"


def _wav_error(path: str | Path, exc: wave.Error) -> str:
    text = str(exc)
    if text.startswith("unknown format: "):
        code = int(text.rsplit(" ", 1)[1])
        name = _WAV_FORMATS.get(code, f"format {code}")
        return (f"{path}: {name} WAV is not supported; use integer PCM "
                f"(e.g. sox {path} -b 16 out.wav)")
    if "RIFF" in text or "WAVE" in text:
        return f"{path} is not a WAV file"
    return f"{path}: a damaged WAV file ({text})"


def split_chunks(pcm: bytes, rate: int, ms: int = 200) -> list[bytes]:
    """Cut PCM into chunks of ``ms`` milliseconds (the last may be shorter)."""
    size = chunk_bytes(rate, ms)
    return [pcm[i:i + size] for i in range(0, len(pcm), size)] or [b""]
