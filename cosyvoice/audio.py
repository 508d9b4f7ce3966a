"""Reading audio files into 16-bit mono PCM at a supported rate, and chunking it.

``read_audio`` decodes any format FFmpeg reads (WAV of any layout, FLAC, MP3, Ogg/Opus,
M4A/AAC, WebM, ...) with PyAV, whose wheel carries FFmpeg and its codecs, and resamples it
to 16 kHz mono with FFmpeg's resampler (channels are mixed down).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import BinaryIO

from .codecs import split_chunks

__all__ = ["AudioFileError", "read_audio", "split_chunks"]


class AudioFileError(ValueError):
    """An input file that cannot be read as audio; the message says why, in one line."""


def read_audio(source: str | Path | BinaryIO) -> tuple[bytes, int]:
    """(pcm, 16000): the first audio stream of ``source`` (a path, or a binary file such as
    standard input's buffer), decoded, mixed down to mono and resampled to 16 kHz.
    Raises AudioFileError, with one line saying why, for anything that is not audio."""
    import av

    if isinstance(source, (str, Path)):
        name: str | Path = source
        opened: str | BinaryIO = str(source)
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
    try:
        if not container.streams.audio:
            raise AudioFileError(f"{name} is not an audio file: it holds no audio stream")
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="s16", layout="mono", rate=16000)
        parts: list[bytes] = []
        try:
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    parts.append(bytes(out.planes[0])[:out.samples * 2])
            for out in resampler.resample(None):
                parts.append(bytes(out.planes[0])[:out.samples * 2])
        except (av.FFmpegError, ValueError) as exc:
            if not parts:
                raise AudioFileError(_not_audio(name, exc)) from None
            # a damaged tail: keep what decoded, as players do
        return b"".join(parts), 16000
    finally:
        container.close()


def _not_audio(name: str | Path, exc: Exception) -> str:
    return f"{name} is not an audio file this tool can decode ({exc.__class__.__name__})"
