"""Audio as a live face receives it, made into what sessions take: 16-bit mono PCM per
channel at a rate a session accepts (cosyvoice/wire/protocol.py, ``SUPPORTED_RATES``).

Deepgram's ``/v1/listen`` (cosyvoice/faces/deepgram/listen.py) takes binary frames of any size in
one of three shapes:

- ``linear16``: interleaved little-endian 16-bit samples (``RawInput``); frames may split a
  sample or a sample frame anywhere, the rest waits for the next frame. A rate sessions
  do not take (44.1 kHz, 22.05 kHz, ...) is resampled to 16 kHz with soxr, as the engines'
  front end does.
- ``mulaw``/``alaw``: G.711 bytes, decoded by FFmpeg's codecs through PyAV, then as above.
- a container (no ``encoding``, or ``opus``/``ogg-opus``/``flac``...): WAV, Ogg/Opus,
  WebM, FLAC, MP3... as a stream (``ContainerInput``). FFmpeg's demuxer blocks until it has
  the bytes it reads, so it runs on its own thread (not the gevent hub's) behind two pipes:
  frames go in through one, decoded 16 kHz PCM comes back through the other.

``split`` (several channels, each its own session) keeps the channels apart; otherwise
they are mixed down to one. An input that cannot be decoded raises ``BadAudio``.
"""

from __future__ import annotations

import os
import struct
from typing import Any, Protocol

from .audio import deinterleave
from .protocol import SUPPORTED_RATES
from .resample import StreamingResampler

MODEL_RATE = 16000
MAX_CHANNELS = 8
RAW_ENCODINGS = ("linear16", "mulaw", "alaw")
_G711 = {"mulaw": "pcm_mulaw", "alaw": "pcm_alaw"}
# a decoded block's header on the container thread's pipe: channels (0: the input is not
# audio), then the bytes that follow
_HEADER = struct.Struct("<II")
# How much of a stream FFmpeg reads before it knows the format and its streams: small, so a
# live stream's first words are not held back (a WAV or Ogg header is a few hundred bytes),
# and a stream that is not audio is told so after 32 KB, not at its end.
_PROBE = {"probesize": "4096", "analyzeduration": "100000", "formatprobesize": "32768"}


class BadAudio(ValueError):
    """The bytes are not audio in the announced encoding."""


class Input(Protocol):
    channels: int  # how many PCM streams ``feed`` gives (1 where mixed down)
    rate: int  # their sample rate

    def feed(self, data: bytes) -> list[bytes]: ...

    def flush(self) -> list[bytes]: ...

    def close(self) -> None: ...


class RawInput:
    """``linear16``, ``mulaw`` or ``alaw`` frames at ``rate`` with ``channels``."""

    def __init__(self, encoding: str, rate: int, channels: int, split: bool):
        self.encoding = encoding
        self.in_rate = rate
        self.in_channels = channels
        self.split = split
        self.channels = channels if split else 1
        self.rate = rate if rate in SUPPORTED_RATES else MODEL_RATE
        self._resamplers = ([StreamingResampler(rate, MODEL_RATE) for _ in range(self.channels)]
                            if self.rate != rate else [])
        self._carry = b""
        self._codec: Any = None
        if encoding in _G711:
            import av

            self._codec = av.CodecContext.create(_G711[encoding], "r")
            self._codec.sample_rate = rate
            self._codec.layout = av.AudioLayout(f"{channels}c")

    def _pcm(self, data: bytes) -> bytes:
        if self._codec is None or not data:
            # an empty packet would tell the G.711 decoder the stream ended: its next
            # packet then raised EOFError (a Finalize, or a frame shorter than one sample of
            # every channel, then more audio, broke a mulaw/alaw connection)
            return data
        import av

        out = []
        for frame in self._codec.decode(av.Packet(data)):
            out.append(frame.to_ndarray().astype("<i2").T.tobytes()
                       if frame.format.is_planar else frame.to_ndarray().astype("<i2").tobytes())
        return b"".join(out)

    def feed(self, data: bytes) -> list[bytes]:
        width = self.in_channels * (1 if self._codec is not None else 2)
        data = self._carry + data
        whole = len(data) - len(data) % width
        self._carry = data[whole:]
        streams = deinterleave(self._pcm(data[:whole]), self.in_channels, self.split)
        if self._resamplers:
            streams = [r.feed(s) for r, s in zip(self._resamplers, streams, strict=True)]
        return streams

    def flush(self) -> list[bytes]:
        self._carry = b""
        if self._resamplers:
            return [r.flush() for r in self._resamplers]
        return [b""] * self.channels

    def close(self) -> None:
        self._carry = b""


class ContainerInput:
    """A container stream (``format``: FFmpeg's name of it, or None to detect it), decoded
    on a thread of its own into 16 kHz PCM. ``channels`` is what the caller expects; the
    stream's own count is known once its header is read (``read`` gives it)."""

    rate = MODEL_RATE

    def __init__(self, split: bool, channels: int = 1, format: str | None = None):
        from gevent import monkey
        from gevent.os import make_nonblocking

        self.split = split
        self.channels = channels if split else 1
        self.format = format
        self._in_r, self._in_w = os.pipe()
        self._out_r, self._out_w = os.pipe()
        make_nonblocking(self._in_w)
        make_nonblocking(self._out_r)
        self._buffer = b""
        self.closed = False
        start = monkey.get_original("_thread", "start_new_thread")
        start(self._run, ())

    # ---- the hub's side ---------------------------------------------------------------

    def feed(self, data: bytes) -> list[bytes]:
        """Send ``data`` to the decoder; the PCM it has decoded so far (it runs behind)."""
        self.write(data)
        return self.read()

    def write(self, data: bytes) -> None:
        """Send ``data`` to the decoder (waits, cooperatively, while its pipe is full)."""
        from gevent.os import nb_write

        view = memoryview(data)
        while view and self._in_w >= 0:
            try:
                n = nb_write(self._in_w, view)
            except BrokenPipeError:
                # the decoder stopped (it read the stream's end, or found it is not audio
                # and said so: ``read`` raises that): what comes after is dropped. Before,
                # the broken pipe escaped to the connection (found by tests/system/
                # test_fuzz.py: garbage, then more frames)
                os.close(self._in_w)
                self._in_w = -1
                return
            view = view[n:]

    def wait(self, timeout: float | None = None) -> bool:
        """Wait (cooperatively) until the decoder has something to ``read``: decoded
        audio, its error, or its end. False: nothing within ``timeout``."""
        from gevent.socket import wait_read

        if self._out_r < 0:
            return False
        try:
            wait_read(self._out_r, timeout=timeout)
        except TimeoutError:
            return False
        except Exception:  # noqa: BLE001 - the pipe was closed meanwhile
            return False
        return True

    def read(self) -> list[bytes]:
        """The PCM decoded so far and not read yet (raises ``BadAudio`` once the decoder
        found that the input is not audio)."""
        while self._out_r >= 0:
            try:
                data = os.read(self._out_r, 65536)
            except BlockingIOError:
                break
            if not data:
                break
            self._buffer += data
        return self._blocks()

    def flush(self) -> list[bytes]:
        """The end of the input: everything it decodes to, once the decoder is done."""
        from gevent.os import nb_read

        if self._in_w >= 0:
            os.close(self._in_w)
            self._in_w = -1
        parts = []
        while True:
            data = nb_read(self._out_r, 65536)
            if not data:
                break
            parts.append(data)
        self._buffer += b"".join(parts)
        return self._blocks()

    def _blocks(self) -> list[bytes]:
        out: list[bytes] = [b""] * self.channels
        while len(self._buffer) >= _HEADER.size:
            channels, size = _HEADER.unpack_from(self._buffer)
            if len(self._buffer) < _HEADER.size + size:
                break
            body = self._buffer[_HEADER.size:_HEADER.size + size]
            self._buffer = self._buffer[_HEADER.size + size:]
            if channels == 0:
                raise BadAudio(body.decode("utf-8", "replace"))
            streams = deinterleave(body, channels, self.split)
            if self.split and channels != self.channels:
                raise BadAudio(f"the stream has {channels} channels, not {self.channels}")
            out = [a + b for a, b in zip(out, streams, strict=True)]
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for fd in (self._in_w, self._out_r):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._in_w = self._out_r = -1

    # ---- the decoder's thread ---------------------------------------------------------

    def _run(self) -> None:
        try:
            self._decode()
        except Exception as exc:  # noqa: BLE001 - the hub's side hears it as BadAudio
            try:
                self._write(0, f"not a stream FFmpeg decodes ({exc.__class__.__name__})"
                            .encode())
            except OSError:
                pass  # the hub's side is gone
        finally:
            for fd in (self._in_r, self._out_w):
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _write(self, channels: int, body: bytes) -> None:
        data = _HEADER.pack(channels, len(body)) + body
        view = memoryview(data)
        while view:
            view = view[os.write(self._out_w, view):]

    def _decode(self) -> None:
        import av

        reader = _PipeReader(self._in_r)
        container = av.open(reader, "r", format=self.format, options=_PROBE)
        try:
            if not container.streams.audio:
                raise BadAudio("no audio stream")
            stream = container.streams.audio[0]
            channels = min(stream.codec_context.channels or 1, MAX_CHANNELS)
            layout = av.AudioLayout(f"{channels}c" if self.split else "mono")
            n = channels if self.split else 1
            resampler = av.AudioResampler(format="s16", layout=layout, rate=MODEL_RATE)
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    self._write(n, bytes(out.planes[0])[:out.samples * 2 * n])
            for out in resampler.resample(None):
                self._write(n, bytes(out.planes[0])[:out.samples * 2 * n])
        finally:
            container.close()


class _PipeReader:
    """A pipe's read end as the file object PyAV reads (blocking, on the decoder's thread)."""

    def __init__(self, fd: int):
        self.fd = fd

    def read(self, n: int) -> bytes:
        return os.read(self.fd, n)


def open_input(encoding: str | None, rate: int | None, channels: int, split: bool) -> Input:
    """The decoder of a stream in ``encoding`` (None or a container name: detected)."""
    if encoding in RAW_ENCODINGS:
        assert rate is not None
        return RawInput(encoding, rate, channels, split)
    fmt = {"opus": "ogg", "ogg-opus": "ogg", "flac": "flac"}.get(encoding or "")
    return ContainerInput(split, channels, fmt)
