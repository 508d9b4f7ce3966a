"""Reading audio files into 16-bit mono PCM at a supported rate, and chunking it.

``read_audio`` decodes any format FFmpeg reads (WAV of any layout, FLAC, MP3, Ogg/Opus,
M4A/AAC, WebM, ...) with PyAV, whose wheel carries FFmpeg and its codecs, and resamples it
to 16 kHz mono with FFmpeg's resampler (channels are mixed down).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import numpy as np

from .codecs import split_chunks

__all__ = ["AudioFileError", "off_the_loop", "read_audio", "read_channels", "split_chunks"]

T = TypeVar("T")

MAX_CHANNELS = 8  # the most channels read apart (a file's further channels are left out)


class AudioFileError(ValueError):
    """An input file that cannot be read as audio; the message says why, in one line."""


def read_audio(source: str | Path | BinaryIO) -> tuple[bytes, int]:
    """(pcm, 16000): the first audio stream of ``source`` (a path, or a binary file such as
    standard input's buffer), decoded, mixed down to mono and resampled to 16 kHz.
    Raises AudioFileError, with one line saying why, for anything that is not audio."""
    streams, rate = read_channels(source, split=False)
    return streams[0], rate


def read_channels(source: str | Path | BinaryIO | bytes, split: bool = True,
                  max_channels: int = MAX_CHANNELS) -> tuple[list[bytes], int]:
    """([pcm per channel], 16000): as ``read_audio``, each channel of the first audio
    stream on its own (``split``; at most ``max_channels``) or mixed down to one."""
    import av

    name, container = _open(source)
    try:
        if not container.streams.audio:
            raise AudioFileError(f"{name} is not an audio file: it holds no audio stream")
        stream = container.streams.audio[0]
        n = min(stream.codec_context.channels or 1, max_channels) if split else 1
        resampler = av.AudioResampler(format="s16", layout=f"{n}c" if n > 1 else "mono",
                                      rate=16000)
        parts: list[bytes] = []
        try:
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    parts.append(bytes(out.planes[0])[:out.samples * 2 * n])
            for out in resampler.resample(None):
                parts.append(bytes(out.planes[0])[:out.samples * 2 * n])
        except (av.FFmpegError, ValueError) as exc:
            if not parts:
                raise AudioFileError(_not_audio(name, exc)) from None
            # a damaged tail: keep what decoded, as players do
        return deinterleave(b"".join(parts), n, split=True), 16000
    finally:
        container.close()


def deinterleave(pcm: bytes, channels: int, split: bool) -> list[bytes]:
    """Interleaved 16-bit frames as one stream per channel (``split``) or mixed to one."""
    if channels == 1:
        return [pcm]
    samples = np.frombuffer(pcm, dtype="<i2").reshape(-1, channels)
    if split:
        return [np.ascontiguousarray(samples[:, c]).tobytes() for c in range(channels)]
    mixed = samples.astype(np.int32).sum(axis=1) // channels
    return [mixed.astype("<i2").tobytes()]


def _open(source: str | Path | BinaryIO | bytes):
    """(the name errors call it, the opened PyAV container)."""
    import av

    if isinstance(source, bytes):
        name: str | Path = "the upload"
        opened: str | BinaryIO = io.BytesIO(source)
    elif isinstance(source, (str, Path)):
        name, opened = source, str(source)
    else:
        name, opened = "standard input", io.BytesIO(source.read())  # FFmpeg seeks; a pipe cannot
    try:
        container = av.open(opened, "r")
    except FileNotFoundError:
        raise AudioFileError(f"cannot read {name}: no such file") from None
    except IsADirectoryError:
        raise AudioFileError(f"cannot read {name}: it is a directory") from None
    except PermissionError:
        raise AudioFileError(f"cannot read {name}: permission denied") from None
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise AudioFileError(_not_audio(name, exc)) from None
    return name, container


def _not_audio(name: str | Path, exc: Exception) -> str:
    return f"{name} is not an audio file this tool can decode ({exc.__class__.__name__})"


def off_the_loop(func: Callable[..., T], *args: Any) -> T:
    """``func(*args)`` in gevent's thread pool (PyAV releases the GIL: the gateway's other
    greenlets go on meanwhile). Its exception is raised here, in the caller, and only
    here: gevent's hub prints the traceback of a pool task that raises, so every upload
    that is not audio wrote one to the log."""
    import gevent

    def run() -> tuple[Any, BaseException | None]:
        try:
            return func(*args), None
        except Exception as exc:  # noqa: BLE001 - handed to the caller as it is
            return None, exc

    result, error = gevent.get_hub().threadpool.apply(run)
    if error is not None:
        raise error
    return result

