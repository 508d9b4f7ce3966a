"""The wire codec: the AudioChunkProto message and the rules every chunk must pass.

Pure functions, no I/O: the gateway validates with ``decode_chunk`` before anything
reaches Redis, and the worker decodes the stored bytes with ``parse_stored``.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import codecs
from .chunk_pb import AudioChunkProto, Codec
from .codecs import CHUNK_MS as CHUNK_MS  # re-exported: the wire's chunk length
from .codecs import SAMPLE_WIDTH, chunk_bytes
from .errors import BadChunk, BadPacket, TooLarge, UnsupportedCodec, UnsupportedRate

# The Socket.IO namespace of the streaming protocol.
NAMESPACE = "/ws"
# Sample rates a session may stream at: every engine's front end resamples them exactly.
SUPPORTED_RATES = (8000, 16000, 24000, 48000)
# Field tags and varint lengths around the PCM: a generous bound for the envelope.
_ENVELOPE_BYTES = 64
_UINT32_MAX = 2**32 - 1
_UINT64_MAX = 2**64 - 1
# The wire enum's names for the codec names of the ``session`` event and ``auth``
CODEC_OF_WIRE = {Codec.PCM16: codecs.PCM16, Codec.OPUS: codecs.OPUS}


@dataclass(frozen=True)
class Chunk:
    """A validated audio chunk. ``sample_rate`` is resolved (never 0): for Opus, the
    rate of the audio the packets decode to. ``audio_ms`` is how much audio it holds,
    whatever the codec."""

    pcm: bytes
    seq: int
    last: bool
    sample_rate: int
    sent_ms: int
    codec: str = codecs.PCM16
    opus: tuple[bytes, ...] = ()  # codec opus: the packets, in order
    bitrate: int = 0  # codec opus: the encoder's target, bit/s (0: not said)
    audio_ms: float = 0.0
    finalize: bool = False  # the utterance in progress ends after this chunk

    @property
    def duration_s(self) -> float:
        return self.audio_ms / 1000


def max_payload_bytes(max_chunk_ms: int) -> int:
    """Largest ``audio_chunk`` payload accepted at any supported rate."""
    return chunk_bytes(max(SUPPORTED_RATES), max_chunk_ms) + _ENVELOPE_BYTES


def encode_chunk(pcm: bytes, seq: int, *, last: bool = False, sample_rate: int = 0,
                 sent_ms: int = 0, finalize: bool = False) -> bytes:
    """Serialise one PCM chunk as the client sends it."""
    return bytes(AudioChunkProto(pcm=pcm, seq=seq, last=last, sample_rate=sample_rate,
                                 sent_ms=sent_ms, finalize=finalize))


def encode_opus_chunk(packets: list[bytes], seq: int, *, bitrate: int, last: bool = False,
                      sent_ms: int = 0, finalize: bool = False) -> bytes:
    """Serialise one chunk of Opus packets (16 kHz audio) as the client sends it."""
    return bytes(AudioChunkProto(codec=Codec.OPUS, opus=list(packets), bitrate=bitrate,
                                 seq=seq, last=last, sent_ms=sent_ms, finalize=finalize))


def _parse(data: bytes) -> AudioChunkProto:
    try:
        msg = AudioChunkProto().parse(data)
    except Exception as exc:  # betterproto raises assorted errors on junk
        raise BadChunk(f"not an AudioChunkProto message ({type(exc).__name__})") from exc
    # betterproto accepts wrong wire types and hands back ints for bytes, lists for
    # ints: check every field's type, not just that parsing returned.
    if not isinstance(msg.pcm, bytes):
        raise BadChunk("field pcm must be bytes")
    if not isinstance(msg.opus, list) or not all(isinstance(p, bytes) for p in msg.opus):
        raise BadChunk("field opus must hold bytes")
    for name, limit in (("seq", _UINT32_MAX), ("sample_rate", _UINT32_MAX),
                        ("sent_ms", _UINT64_MAX), ("bitrate", _UINT32_MAX)):
        value = getattr(msg, name)
        if type(value) is not int or not 0 <= value <= limit:
            raise BadChunk(f"field {name} must be an unsigned integer")
    if type(msg.last) is not bool or type(msg.finalize) is not bool:
        raise BadChunk("fields last and finalize must be bools")
    if not isinstance(msg.codec, int) or isinstance(msg.codec, bool):
        raise BadChunk("field codec must be an enum number")
    if msg.codec not in CODEC_OF_WIRE:
        raise UnsupportedCodec(f"unknown codec {msg.codec!r}; expected one of "
                               f"{[c.name for c in CODEC_OF_WIRE]}", seq=msg.seq)
    return msg


def _opus_chunk(msg: AudioChunkProto, max_chunk_ms: int) -> Chunk:
    """The rules of a chunk of Opus packets: their framing (RFC 6716 section 3) is
    checked here, their contents by the worker's decoder."""
    if msg.pcm:
        raise BadChunk("an Opus chunk carries its audio in opus, not pcm", seq=msg.seq)
    if msg.sample_rate not in (0, codecs.RATE):
        raise UnsupportedRate(f"Opus audio is {codecs.RATE} Hz, not {msg.sample_rate}",
                              seq=msg.seq)
    if not msg.opus and not (msg.last or msg.finalize):
        raise BadChunk("empty chunk: opus may be empty only with last or finalize",
                       seq=msg.seq)
    ms = 0.0
    for i, packet in enumerate(msg.opus):
        try:
            ms += codecs.packets_ms([packet])
        except ValueError as exc:
            raise BadPacket(f"Opus packet {i}: {exc}", seq=msg.seq) from exc
    if ms > max_chunk_ms:
        raise TooLarge(f"chunk holds more than {max_chunk_ms} ms of audio", seq=msg.seq)
    return Chunk(pcm=b"", seq=msg.seq, last=msg.last, sample_rate=codecs.RATE,
                 sent_ms=msg.sent_ms, codec=codecs.OPUS, opus=tuple(msg.opus),
                 bitrate=msg.bitrate, audio_ms=ms, finalize=msg.finalize)


def decode_chunk(data, current_rate: int, max_chunk_ms: int,
                 accepted: tuple[str, ...] = codecs.CODECS) -> Chunk:
    """Validate one ``audio_chunk`` payload against the session's current rate and the
    codecs the server ``accepted``.

    Raises ``BadChunk``, ``BadPacket``, ``TooLarge``, ``UnsupportedRate`` or
    ``UnsupportedCodec``; sequence rules are the gateway's (they need the session's
    state in Redis).
    """
    if isinstance(data, bytearray):
        data = bytes(data)
    if not isinstance(data, bytes):
        raise BadChunk("audio_chunk payload must be binary protobuf bytes")
    if len(data) > max_payload_bytes(max_chunk_ms):
        raise TooLarge(f"payload of {len(data)} bytes exceeds the limit")
    msg = _parse(data)
    codec = CODEC_OF_WIRE[msg.codec]
    if codec not in accepted:
        raise UnsupportedCodec(f"this server takes {list(accepted)}, not {codec}",
                               seq=msg.seq)
    if codec == codecs.OPUS:
        return _opus_chunk(msg, max_chunk_ms)
    if msg.opus:
        raise BadChunk("a PCM chunk cannot carry Opus packets; set codec OPUS", seq=msg.seq)
    rate = msg.sample_rate or current_rate
    if rate not in SUPPORTED_RATES:
        raise UnsupportedRate(f"sample rate {rate} not in {SUPPORTED_RATES}", seq=msg.seq)
    if len(msg.pcm) % SAMPLE_WIDTH:
        raise BadChunk(f"pcm length {len(msg.pcm)} is odd; 16-bit samples expected",
                       seq=msg.seq)
    if len(msg.pcm) > chunk_bytes(rate, max_chunk_ms):
        raise TooLarge(f"chunk holds more than {max_chunk_ms} ms of audio", seq=msg.seq)
    if not msg.pcm and not (msg.last or msg.finalize):
        raise BadChunk("empty chunk: pcm may be empty only with last or finalize",
                       seq=msg.seq)
    return Chunk(pcm=msg.pcm, seq=msg.seq, last=msg.last, sample_rate=rate,
                 sent_ms=msg.sent_ms, audio_ms=len(msg.pcm) / SAMPLE_WIDTH / rate * 1000,
                 finalize=msg.finalize)


def parse_stored(data: bytes) -> AudioChunkProto:
    """Parse a chunk the gateway already validated and stored."""
    return AudioChunkProto().parse(data)
