"""The codecs a chunk's audio may travel in, and the one place that encodes and decodes
them.

- ``pcm16``: little-endian signed 16-bit mono PCM at 8, 16 or 48 kHz (``AudioChunkProto.pcm``).
- ``opus``: Opus packets of 20 ms of 16 kHz mono speech (``AudioChunkProto.opus``), at a
  bitrate from the server's list (``COSYVOICE_OPUS_BITRATES``).

Encoding and decoding go through PyAV, whose wheel carries its own libopus; nothing here
decodes an Opus frame's contents. ``packet_samples`` reads only the packet framing of
RFC 6716 section 3 (the table-of-contents byte, the frame count and frame lengths): enough
for the gateway to refuse a malformed packet and to know how much audio a chunk holds
(for the rate limiter and the chunk size limit) without decoding it. PyAV is imported
by the encoder and the decoder only: a gateway checks framing and never loads FFmpeg.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable
from fractions import Fraction
from typing import TYPE_CHECKING, Callable

import numpy as np

from .chunk_pb import AudioChunkProto, Codec

if TYPE_CHECKING:
    import av

log = logging.getLogger(__name__)

PCM16, OPUS = "pcm16", "opus"
CODECS = (PCM16, OPUS)
# Chunk framing: the wire's 200 ms chunks of 16-bit mono samples (cosyvoice/wire/protocol.py
# and cosyvoice/wire/audio.py use these; they live here, below both, so neither imports the other
# to cut audio into chunks).
CHUNK_MS = 200
SAMPLE_WIDTH = 2

RATE = 16000  # the rate Opus audio has on both sides of the wire
FRAME_MS = 20  # every packet this project's clients send holds one 20 ms frame
FRAME_SAMPLES = RATE * FRAME_MS // 1000
PACKETS_PER_CHUNK = 10  # 200 ms chunks of 20 ms packets
# The encoder's look-ahead that a decoder drops from the start of a stream (RFC 7845's
# pre-skip): libopus's 6.5 ms (2.5 ms of look-ahead, 4 ms of delay compensation) less the
# 48 -> 16 kHz resampler's own delay, in samples at 16 kHz: the shift at which decoded
# speech best matches the original (tests/unit/test_codecs.py). Without it every word comes
# 6.4 ms late, and PocketSphinx's endpointer, which places its windows by the sample,
# can hear another word.
PRE_SKIP = 102
DEFAULT_BITRATE = 24000  # a client's when neither it nor the server names one
# Opus audio decoded again before a checkpoint when a session is taken over (libopus
# converges within about a second: tests/unit/test_codecs.py)
WARMUP_MS = 2000
_DECODER_RATE = 48000  # libopus through PyAV always decodes at 48 kHz
_MAX_FRAME_BYTES = 1275  # RFC 6716 section 3.4, requirement R2
_MAX_PACKET_SAMPLES = 120 * 48  # at most 120 ms of audio per packet (R5), at 48 kHz

# Frame duration per TOC configuration (RFC 6716 table 2), in samples at 48 kHz:
# SILK-only 0-11 (10/20/40/60 ms per bandwidth), hybrid 12-15 (10/20 ms), CELT-only
# 16-31 (2.5/5/10/20 ms per bandwidth).
_FRAME_48K = ((480, 960, 1920, 2880) * 3 + (480, 960) * 2 + (120, 240, 480, 960) * 4)


def _av():
    """PyAV, imported on first use."""
    return importlib.import_module("av")


def _frame_length(packet: bytes, at: int) -> tuple[int, int]:
    """One frame length coded in one or two bytes (section 3.2.1): (length, next index)."""
    if at >= len(packet):
        raise ValueError("packet ends inside a frame length")
    first = packet[at]
    if first < 252:
        return first, at + 1
    if at + 1 >= len(packet):
        raise ValueError("packet ends inside a frame length")
    return packet[at + 1] * 4 + first, at + 2


def _code3_lengths(packet: bytes) -> tuple[int, list[int]]:
    """Frame count and lengths of a code 3 packet (section 3.2.5)."""
    if len(packet) < 2:
        raise ValueError("code 3 packet without its frame count byte")
    vbr, padded, count = packet[1] & 0x80, packet[1] & 0x40, packet[1] & 0x3F
    if count == 0:
        raise ValueError("code 3 packet with zero frames")
    at, padding = 2, 0
    while padded:
        if at >= len(packet):
            raise ValueError("packet ends inside its padding length")
        padding += 254 if packet[at] == 255 else packet[at]
        padded = packet[at] == 255
        at += 1
    if vbr:
        lengths = []
        for _ in range(count - 1):
            length, at = _frame_length(packet, at)
            lengths.append(length)
        rest = len(packet) - at - padding - sum(lengths)
        if rest < 0:
            raise ValueError("frame lengths exceed the packet")
        return count, lengths + [rest]
    rest = len(packet) - at - padding
    if rest < 0 or rest % count:
        raise ValueError("constant-bitrate frames do not divide the packet")
    return count, [rest // count] * count


def packet_samples(packet: bytes) -> int:
    """Audio in one Opus packet, in samples at 48 kHz; ``ValueError`` if its framing
    (RFC 6716 section 3.1-3.2) is malformed."""
    if not packet:
        raise ValueError("empty Opus packet")
    toc = packet[0]
    frame = _FRAME_48K[toc >> 3]
    code = toc & 0x3
    if code == 0:
        lengths = [len(packet) - 1]
    elif code == 1:
        if (len(packet) - 1) % 2:
            raise ValueError("code 1 packet with frames of unequal length")
        lengths = [(len(packet) - 1) // 2] * 2
    elif code == 2:
        first, at = _frame_length(packet, 1)
        second = len(packet) - at - first
        if second < 0:
            raise ValueError("first frame longer than the packet")
        lengths = [first, second]
    else:
        _, lengths = _code3_lengths(packet)
    if any(length > _MAX_FRAME_BYTES for length in lengths):
        raise ValueError(f"Opus frame over {_MAX_FRAME_BYTES} bytes")
    samples = frame * len(lengths)
    if samples > _MAX_PACKET_SAMPLES:
        raise ValueError("Opus packet over 120 ms")
    return samples


def packets_ms(packets: list[bytes]) -> float:
    """Milliseconds of audio in a list of packets (``ValueError`` on a malformed one)."""
    return sum(packet_samples(p) for p in packets) / (_DECODER_RATE / 1000)


class OpusEncoder:
    """16 kHz mono 16-bit PCM in, one Opus packet per 20 ms frame out.

    ``bitrate`` is the encoder's target in bit/s (``application=voip``: speech).
    """

    def __init__(self, bitrate: int):
        av = _av()
        self.bitrate = bitrate
        ctx = av.CodecContext.create("libopus", "w")
        assert isinstance(ctx, av.AudioCodecContext)
        ctx.sample_rate = RATE
        ctx.layout = "mono"
        ctx.format = "s16"
        ctx.bit_rate = bitrate
        ctx.time_base = Fraction(1, RATE)
        ctx.options = {"frame_duration": str(FRAME_MS), "application": "voip"}
        ctx.open()
        self._ctx = ctx
        self._pending = b""  # PCM short of a whole frame
        self._pts = 0

    def _encode_frame(self, pcm: bytes) -> list[bytes]:
        av = _av()
        samples = np.frombuffer(pcm, dtype="<i2").reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate = RATE
        frame.pts = self._pts
        self._pts += FRAME_SAMPLES
        return [bytes(p) for p in self._ctx.encode(frame)]

    def encode(self, pcm: bytes) -> list[bytes]:
        """Packets for every whole 20 ms frame now available; the rest waits."""
        data = self._pending + pcm
        whole = len(data) - len(data) % (FRAME_SAMPLES * 2)
        self._pending = data[whole:]
        packets: list[bytes] = []
        for at in range(0, whole, FRAME_SAMPLES * 2):
            packets += self._encode_frame(data[at:at + FRAME_SAMPLES * 2])
        return packets

    def flush(self) -> list[bytes]:
        """The end of the stream: the partial frame padded with silence, then every
        packet the encoder still holds (its look-ahead)."""
        packets: list[bytes] = []
        if self._pending:
            pad = FRAME_SAMPLES * 2 - len(self._pending)
            packets += self._encode_frame(self._pending + b"\0" * pad)
            self._pending = b""
        packets += [bytes(p) for p in self._ctx.encode(None)]
        return packets


class OpusDecoder:
    """Opus packets in, 16 kHz mono 16-bit PCM out, for one stretch of a session's
    stream. Decoder state runs from packet to packet, so one instance decodes one
    stretch in order; a worker taking a session over warms a fresh one up on the audio
    before its checkpoint (``SessionAudio.resumed``).

    A packet libopus refuses becomes silence of its length (logged and counted by the
    caller through ``errors``): a client's bad packet costs 20 ms, never the session.
    """

    def __init__(self) -> None:
        av = _av()
        self._ctx = av.codec.Codec("libopus", "r").create()
        # libswresample: a direct-form filter, so once its history is the same (16
        # samples after a start) its output is bit-exact whatever the starting point,
        # and it always holds back the same 16 samples: the warm-up of a takeover
        # lines up with the lost worker's output sample for sample.
        self._resampler = av.AudioResampler(format="s16", layout="mono", rate=RATE)
        self.errors = 0
        self._skip = PRE_SKIP  # samples still to drop from the start of the output

    def _frames(self, packet: bytes) -> list[av.AudioFrame]:
        av = _av()
        try:
            return list(self._ctx.decode(av.Packet(packet)))
        except (av.FFmpegError, ValueError) as exc:
            self.errors += 1
            log.warning("undecodable Opus packet of %d bytes: %s", len(packet), exc)
            try:
                samples = packet_samples(packet)
            except ValueError:
                samples = FRAME_SAMPLES * 3
            silence = av.AudioFrame.from_ndarray(np.zeros((1, samples), dtype=np.int16),
                                                 format="s16", layout="mono")
            silence.sample_rate = _DECODER_RATE
            return [silence]

    def _resample(self, frame: av.AudioFrame | None) -> bytes:
        if frame is not None:
            frame.pts = None  # no timestamps: the resampler must never stretch or drop
        return b"".join(bytes(out.to_ndarray().astype("<i2").tobytes())
                        for out in self._resampler.resample(frame))

    def decode(self, packets: list[bytes]) -> bytes:
        """PCM at 16 kHz for these packets (the resampler holds 16 samples back until
        the next call or ``flush``), the encoder's pre-skip dropped from the start."""
        return self._skipped(b"".join(self._resample(frame) for p in packets
                                      for frame in self._frames(p)))

    def flush(self) -> bytes:
        """The end of the stretch: the samples the resampler still holds."""
        return self._skipped(self._resample(None))

    def _skipped(self, pcm: bytes) -> bytes:
        if not self._skip:
            return pcm
        cut = min(len(pcm) // 2, self._skip)
        self._skip -= cut
        return pcm[2 * cut:]


class Encodings:
    """A recording's 200 ms chunks at each rung, encoded as they are first sent: PCM as
    cut; Opus by one encoder per bitrate, fed chunk after chunk from where the stream went
    at that bitrate (a switch starts it there, as a live encoder would be; a gap starts it
    anew), the last chunk with the encoder's flush. Every chunk is kept as encoded, so a
    resend after a reconnect sends the same packets."""

    def __init__(self, pcm: list[bytes]):
        self.pcm = pcm
        self._encoders: dict[int, tuple[OpusEncoder, int]] = {}  # bitrate: it, next seq
        self._opus: dict[tuple[int, int], list[bytes]] = {}

    def opus(self, seq: int, bitrate: int) -> list[bytes]:
        if (bitrate, seq) not in self._opus:
            encoder, following = self._encoders.get(bitrate, (None, -1))
            if encoder is None or following != seq:
                encoder = OpusEncoder(bitrate)
            packets = encoder.encode(self.pcm[seq])
            if seq == len(self.pcm) - 1:
                packets += encoder.flush()
            self._encoders[bitrate] = (encoder, seq + 1)
            self._opus[bitrate, seq] = packets
        return self._opus[bitrate, seq]


class SessionAudio:
    """A session's chunks as PCM for its engine, in order: a PCM chunk as it is, at its
    rate (0: the session's current one); an Opus chunk through the decoder of its stretch
    of Opus chunks (one decoder per stretch, kept across bitrate changes, flushed when PCM
    follows or the stream ends), at 16 kHz. ``on_undecodable(n)`` hears of packets libopus
    refused (each became silence of its length)."""

    def __init__(self, rate: int, on_undecodable: Callable[[int], object] = lambda n: None,
                 opus: OpusDecoder | None = None):
        self.rate = rate
        self.opus = opus
        self._on_undecodable = on_undecodable

    def pieces(self, chunk: AudioChunkProto) -> list[tuple[bytes, int]]:
        """The chunk's audio as (PCM, rate) pieces to feed in this order: the end of an
        Opus stretch that a PCM chunk closes comes first."""
        out: list[tuple[bytes, int]] = []
        if chunk.codec == Codec.OPUS:
            if self.opus is None:
                self.opus = OpusDecoder()
            errors = self.opus.errors
            pcm = self.opus.decode(chunk.opus)
            if chunk.last:
                pcm += self.opus.flush()
            if self.opus.errors > errors:
                self._on_undecodable(self.opus.errors - errors)
            self.rate = RATE
        else:
            if self.opus is not None:  # the Opus stretch ends: its last samples come first
                out.append((self.opus.flush(), RATE))
                self.opus = None
            pcm, self.rate = chunk.pcm, chunk.sample_rate or self.rate
        return out + [(pcm, self.rate)]

    @classmethod
    def resumed(cls, rate: int, back: Iterable[AudioChunkProto], seq: int,
                on_undecodable: Callable[[int], object] = lambda n: None) -> SessionAudio:
        """A session's audio as the lost worker had it after chunk ``seq``, the
        checkpoint's, from the stored chunks up to it, newest first (``back``).

        Decoder state runs from packet to packet: a decoder started at the checkpoint
        would decode the next second a little differently, and its finals could differ.
        So the packets of the stretch before it (back to ``WARMUP_MS``, or to the PCM
        chunk that began the stretch) are decoded again and the output discarded; libopus
        and the resampler are bit-exact again well within that time
        (tests/unit/test_codecs.py). No decoder when the checkpoint's chunk is not Opus.
        """
        chunks: list[AudioChunkProto] = []
        ms = 0.0
        for chunk in back:
            if chunk.seq != seq:
                continue  # a stale duplicate, which the lost worker skipped too
            if chunk.codec != Codec.OPUS:
                break  # the stretch began after this chunk, with a fresh decoder
            chunks.append(chunk)
            ms += packets_ms(chunk.opus)
            seq -= 1
            if ms >= WARMUP_MS:
                break
        decoder = None
        if chunks:
            decoder = OpusDecoder()
            for chunk in reversed(chunks):
                decoder.decode(chunk.opus)
        return cls(rate, on_undecodable, decoder)


def chunk_bytes(sample_rate: int, ms: int = CHUNK_MS) -> int:
    """Bytes of PCM in ``ms`` milliseconds of 16-bit mono audio at ``sample_rate``."""
    return sample_rate * ms // 1000 * SAMPLE_WIDTH


def split_chunks(pcm: bytes, rate: int, ms: int = CHUNK_MS) -> list[bytes]:
    """Cut PCM into chunks of ``ms`` milliseconds (the last may be shorter)."""
    size = chunk_bytes(rate, ms)
    return [pcm[i:i + size] for i in range(0, len(pcm), size)] or [b""]


def opus_chunks(pcm: bytes, bitrate: int) -> list[list[bytes]]:
    """16 kHz PCM as 200 ms chunks of Opus packets (``PACKETS_PER_CHUNK`` each), all at
    one bitrate: as many chunks as the PCM makes, chunk ``k`` holding the audio of PCM
    chunk ``k``, the encoder's last packets (the padded partial frame and its look-ahead)
    with the last one."""
    encodings = Encodings(split_chunks(pcm, RATE))
    return [encodings.opus(seq, bitrate) for seq in range(len(encodings.pcm))]


def parse_bitrate(text: str) -> int:
    """A bitrate as people write it: ``24k``, ``24000`` or ``24kbit``, in bit/s."""
    value = text.strip().lower().removesuffix("bit/s").removesuffix("bps").removesuffix("bit")
    scale = 1000 if value.endswith("k") else 1
    try:
        return int(float(value.removesuffix("k")) * scale)
    except ValueError:
        raise ValueError(f"not a bitrate: {text!r} (say 24k or 24000)") from None


def resample(pcm: bytes, rate: int, to: int) -> bytes:
    """16-bit mono PCM from ``rate`` to ``to`` Hz (soxr, as the engines' front end)."""
    import soxr

    samples = np.frombuffer(pcm, dtype="<i2")
    return soxr.resample(samples, rate, to).astype("<i2").tobytes()
